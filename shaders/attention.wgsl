// Causal self-attention with grouped KV heads, forward and backward, with an online softmax
// (flash attention's recurrence): no L x L matrix is ever stored (engine/kernels/attention.py).
// Letters: B sequences of L tokens, rows m = b*L + t; Hq query heads, Hkv = Hq / REP key/value
// heads (query head h reads kv head h / REP, transformers' repeat_kv), D head_dim (a multiple
// of 4, at most 256), s = scale * q.k (Granite: attention_multiplier; else 1/sqrt(D)).
//     q [M, ldq] (head h at column h*D), k and v [M, ldk] (head g at column g*D), o [M, ldq]
//     stats [M, Hq]: lse = m + log l (between forward segments the running max m and sum l).
// Tiled (flash-attention style, f32): a workgroup takes a block of 64 query rows (forward,
// dq) or 64 keys (dk, dv) and walks the other side's blocks of 32, staged in workgroup
// memory, below the causal diagonal only.  On a GPU each kernel walks all of L in one
// dispatch; on a CPU adapter the host splits the walk into segments of whole blocks, one
// dispatch each, short enough for every invocation's loop count to stay far below lavapipe's
// 65535, the online state (o unnormalised, m, l; dq; dk, dv) kept in the output buffers
// between them.  The backward recomputes p = exp(s - lse), with delta = rowsum(dO * O).

const MAXD4: u32 = 64u;   // D <= 256 (the decode step's registers)

struct AP { B: u32, L: u32, Hq: u32, Hkv: u32, D4: u32, REP: u32, ldq: u32, ldk: u32,
            s0: u32, s1: u32, first: u32, rows: u32,
            oq: u32, ok: u32, ov: u32, oo: u32, om: u32, ol: u32, od: u32, oe: u32,
            scale: f32, factor: f32, p0: u32, p1: u32 }


// ---------------------------------------------------------------- forward
@group(0) @binding(0) var<storage, read> fq: array<f32>;
@group(0) @binding(1) var<storage, read> fk: array<f32>;
@group(0) @binding(2) var<storage, read> fv: array<f32>;
@group(0) @binding(3) var<storage, read_write> fo: array<f32>;
@group(0) @binding(4) var<storage, read_write> fm: array<f32>;
@group(0) @binding(5) var<storage, read_write> fl: array<f32>;
@group(0) @binding(6) var<uniform> FU: AP;

// ---------------------------------------------------------------- backward
// delta[row, h] = factor * sum_d dO[row, h*D + d] * O[row, h*D + d]
@group(0) @binding(0) var<storage, read> ddo: array<f32>;
@group(0) @binding(1) var<storage, read> dout: array<f32>;
@group(0) @binding(2) var<storage, read_write> ddelta: array<f32>;
@group(0) @binding(3) var<uniform> DU: AP;

@compute @workgroup_size(256)
fn attention_delta(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) lid: u32) {
    let u = DU;
    let st = lin(wid, nwg, lid);
    if (st >= u.rows * u.Hq) { return; }
    let row = st / u.Hq;
    let h = st % u.Hq;
    let base = row * u.ldq + h * u.D4 * 4u;
    var acc = vec4<f32>(0.0);
    for (var d = 0u; d < u.D4; d++) {
        acc += ld_ddo(u.od + base + 4u * d) * ld_dout(u.oo + base + 4u * d);
    }
    ddelta[u.oe + st] = u.factor * (acc.x + acc.y + acc.z + acc.w);
}

// out[o_out + i] = sum_{r < REP} part[o_part + r * n + i], i < n: the per-head shares of dk and dv
// that attention_sgmat.wgsl's attention_sg_dkv writes where it splits the heads (split = 1)
struct SP { n: u32, REP: u32, o_part: u32, o_out: u32 }
@group(0) @binding(0) var<storage, read> sp_part: array<f32>;
@group(0) @binding(1) var<storage, read_write> sp_out: array<f32>;
@group(0) @binding(2) var<uniform> SPU: SP;

@compute @workgroup_size(256)
fn attention_sum_parts(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                       @builtin(local_invocation_index) lid: u32) {
    let u = SPU;
    let i = lin(wid, nwg, lid);
    if (i >= u.n) { return; }
    var acc = 0.0;
    for (var r = 0u; r < u.REP; r++) { acc += sp_part[u.o_part + r * u.n + i]; }
    sp_out[u.o_out + i] = acc;
}

@group(0) @binding(0) var<storage, read> bq: array<f32>;
@group(0) @binding(1) var<storage, read> bk: array<f32>;
@group(0) @binding(2) var<storage, read> bv: array<f32>;
@group(0) @binding(3) var<storage, read> bdo: array<f32>;
@group(0) @binding(4) var<storage, read> blse: array<f32>;
@group(0) @binding(5) var<storage, read> bdelta: array<f32>;
@group(0) @binding(6) var<storage, read_write> bd1: array<f32>;
@group(0) @binding(7) var<storage, read_write> bd2: array<f32>;
@group(0) @binding(8) var<uniform> BU: AP;

// vec4 loads of four consecutive f32 (any alignment)
fn ld_fq(i: u32) -> vec4<f32> { return vec4<f32>(fq[i], fq[i + 1u], fq[i + 2u], fq[i + 3u]); }
fn ld_fk(i: u32) -> vec4<f32> { return vec4<f32>(fk[i], fk[i + 1u], fk[i + 2u], fk[i + 3u]); }
fn ld_fv(i: u32) -> vec4<f32> { return vec4<f32>(fv[i], fv[i + 1u], fv[i + 2u], fv[i + 3u]); }
fn ld_ddo(i: u32) -> vec4<f32> { return vec4<f32>(ddo[i], ddo[i + 1u], ddo[i + 2u], ddo[i + 3u]); }
fn ld_dout(i: u32) -> vec4<f32> { return vec4<f32>(dout[i], dout[i + 1u], dout[i + 2u], dout[i + 3u]); }
fn ld_bq(i: u32) -> vec4<f32> { return vec4<f32>(bq[i], bq[i + 1u], bq[i + 2u], bq[i + 3u]); }
fn ld_bk(i: u32) -> vec4<f32> { return vec4<f32>(bk[i], bk[i + 1u], bk[i + 2u], bk[i + 3u]); }
fn ld_bv(i: u32) -> vec4<f32> { return vec4<f32>(bv[i], bv[i + 1u], bv[i + 2u], bv[i + 3u]); }
fn ld_bdo(i: u32) -> vec4<f32> { return vec4<f32>(bdo[i], bdo[i + 1u], bdo[i + 2u], bdo[i + 3u]); }

// ---------------------------------------------------------------- the tiled kernels
// A workgroup of 256 takes 64 query rows of one (b, head) (forward, dq) or 64 keys of one
// (b, kv head) (dk, dv) and walks blocks of the other side (32 keys, or 32 query rows), staged
// in workgroup memory shared by all its invocations, skipping blocks above the causal
// diagonal.  Invocation (rg, cg) = (lid / 16, lid % 16) owns the scores of the block's rows
// 4 rg .. 4 rg + 3 against its columns cg and cg + 16, and of the outputs the same 4 rows at
// the vec4 columns 16 ci + cg (ci < NCH = ceil(D4 / 16)), in registers.  Workgroup memory:
// ts and tp, 8 KiB each: the staged operand chunks, then the block's scores or probabilities
// in tp as [column][rg] vec4s (the 4 rows of an rg), the other operand's chunk in ts.
override NCH: u32 = 4u;

var<workgroup> ts: array<vec4<f32>, 512>;
var<workgroup> tp: array<vec4<f32>, 512>;

fn ld_fo(i: u32) -> vec4<f32> { return vec4<f32>(fo[i], fo[i + 1u], fo[i + 2u], fo[i + 3u]); }
fn ld_bd1(i: u32) -> vec4<f32> { return vec4<f32>(bd1[i], bd1[i + 1u], bd1[i + 2u], bd1[i + 3u]); }
fn ld_bd2(i: u32) -> vec4<f32> { return vec4<f32>(bd2[i], bd2[i + 1u], bd2[i + 2u], bd2[i + 3u]); }
fn st_fo(i: u32, x: vec4<f32>) { fo[i] = x.x; fo[i + 1u] = x.y; fo[i + 2u] = x.z; fo[i + 3u] = x.w; }
fn st_bd1(i: u32, x: vec4<f32>) { bd1[i] = x.x; bd1[i + 1u] = x.y; bd1[i + 2u] = x.z; bd1[i + 3u] = x.w; }
fn st_bd2(i: u32, x: vec4<f32>) { bd2[i] = x.x; bd2[i + 1u] = x.y; bd2[i + 2u] = x.z; bd2[i + 3u] = x.w; }

// Forward over the key segment [s0, s1) (s0 a multiple of 32) for the query blocks that see
// any of it; a block whose keys end in the segment writes o normalised and lse (no finish
// pass), the others the online state (o unnormalised, m, l) for the next segment.
@compute @workgroup_size(256)
fn attention_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                           @builtin(local_invocation_index) lid: u32) {
    let u = FU;
    let nqb = (u.L + 63u) / 64u;
    let nb = nqb - u.s0 / 64u;
    let wg = wid.x + wid.y * nwg.x;
    if (wg >= u.B * u.Hq * nb) { return; }
    let qb = nqb - 1u - wg % nb;            // the longest rows first
    let h = (wg / nb) % u.Hq;
    let b = wg / (nb * u.Hq);
    let g = h / u.REP;
    let t0 = qb * 64u;
    let rg = lid / 16u;
    let cg = lid % 16u;
    var o: array<vec4<f32>, 16>;            // [a * 4 + ci]
    var m: array<f32, 4>;
    var lp: array<f32, 4>;                  // this invocation's share of the row's sum
    for (var a = 0u; a < 4u; a++) {
        let t = t0 + 4u * rg + a;
        m[a] = -3.0e38;
        lp[a] = 0.0;
        for (var ci = 0u; ci < NCH; ci++) { o[a * 4u + ci] = vec4<f32>(0.0); }
        if (u.first != 1u && t < u.L) {
            let row = b * u.L + t;
            m[a] = fm[u.om + row * u.Hq + h];
            if (cg == 0u) { lp[a] = fl[u.ol + row * u.Hq + h]; }
            for (var ci = 0u; ci < NCH; ci++) {
                let d4 = 16u * ci + cg;
                if (d4 < u.D4) { o[a * 4u + ci] = ld_fo(u.oo + row * u.ldq + (h * u.D4 + d4) * 4u); }
            }
        }
    }
    let kend = min(u.s1, min(u.L, t0 + 64u));
    for (var k0 = u.s0; k0 < kend; k0 += 32u) {
        var sc: array<f32, 8>;              // [a * 2 + e]: row 4 rg + a, key k0 + cg + 16 e
        for (var i = 0u; i < 8u; i++) { sc[i] = 0.0; }
        for (var c0 = 0u; c0 < u.D4; c0 += 8u) {
            // q * scale (64 rows x 8 vec4) into ts as [c][row], k (32 keys x 8) into tp as [c][key]
            for (var n = lid; n < 512u; n += 256u) {
                let r = n / 8u;
                let c = n % 8u;
                let t = t0 + r;
                var x = vec4<f32>(0.0);
                if (t < u.L && c0 + c < u.D4) { x = ld_fq(u.oq + (b * u.L + t) * u.ldq + (h * u.D4 + c0 + c) * 4u) * u.scale; }
                ts[c * 64u + r] = x;
            }
            {
                let j = lid / 8u;
                let c = lid % 8u;
                var x = vec4<f32>(0.0);
                if (k0 + j < u.L && c0 + c < u.D4) { x = ld_fk(u.ok + (b * u.L + k0 + j) * u.ldk + (g * u.D4 + c0 + c) * 4u); }
                tp[c * 32u + j] = x;
            }
            workgroupBarrier();
            for (var c = 0u; c < 8u; c++) {
                let ka = tp[c * 32u + cg];
                let kb = tp[c * 32u + cg + 16u];
                for (var a = 0u; a < 4u; a++) {
                    let qv = ts[c * 64u + 4u * rg + a];
                    sc[a * 2u] += dot(qv, ka);
                    sc[a * 2u + 1u] += dot(qv, kb);
                }
            }
            workgroupBarrier();
        }
        // mask (a key after the row, or past L); the block's row maxima through tp
        for (var e = 0u; e < 2u; e++) {
            let j = k0 + cg + 16u * e;
            var s4 = vec4<f32>(-3.0e38);
            for (var a = 0u; a < 4u; a++) {
                let t = t0 + 4u * rg + a;
                if (j <= t && j < u.L) { s4[a] = sc[a * 2u + e]; } else { sc[a * 2u + e] = -3.0e38; }
            }
            tp[(cg + 16u * e) * 16u + rg] = s4;
        }
        workgroupBarrier();
        var mx = vec4<f32>(-3.0e38);
        for (var j = 0u; j < 32u; j++) { mx = max(mx, tp[j * 16u + rg]); }
        workgroupBarrier();
        var cr: array<f32, 4>;
        var pe: array<vec4<f32>, 2>;
        for (var a = 0u; a < 4u; a++) {
            let mn = max(m[a], mx[a]);
            cr[a] = exp(m[a] - mn);
            var ps = 0.0;
            for (var e = 0u; e < 2u; e++) {
                var p = 0.0;
                if (sc[a * 2u + e] > -1.0e38) { p = exp(sc[a * 2u + e] - mn); }
                pe[e][a] = p;
                ps += p;
            }
            lp[a] = lp[a] * cr[a] + ps;
            m[a] = mn;
            for (var ci = 0u; ci < NCH; ci++) { o[a * 4u + ci] *= cr[a]; }
        }
        tp[cg * 16u + rg] = pe[0];
        tp[(cg + 16u) * 16u + rg] = pe[1];
        // o += p v, v staged 32 keys x 16 vec4 at a time
        for (var ci = 0u; ci < NCH; ci++) {
            for (var n = lid; n < 512u; n += 256u) {
                let j = n / 16u;
                let d4 = 16u * ci + n % 16u;
                var x = vec4<f32>(0.0);
                if (k0 + j < u.L && d4 < u.D4) { x = ld_fv(u.ov + (b * u.L + k0 + j) * u.ldk + (g * u.D4 + d4) * 4u); }
                ts[n] = x;
            }
            workgroupBarrier();
            for (var j = 0u; j < 32u; j++) {
                let pv = tp[j * 16u + rg];
                let vv = ts[j * 16u + cg];
                for (var a = 0u; a < 4u; a++) { o[a * 4u + ci] += pv[a] * vv; }
            }
            workgroupBarrier();
        }
    }
    // the row sums: the 16 shares of each row through tp
    workgroupBarrier();
    tp[cg * 16u + rg] = vec4<f32>(lp[0], lp[1], lp[2], lp[3]);
    workgroupBarrier();
    var l = vec4<f32>(0.0);
    for (var i = 0u; i < 16u; i++) { l += tp[i * 16u + rg]; }
    for (var a = 0u; a < 4u; a++) {
        let t = t0 + 4u * rg + a;
        if (t < u.L) {
            let row = b * u.L + t;
            let last = min(u.L, t0 + 64u) <= u.s1;   // the block's last keys: o normalised, lse
            let inv = select(1.0, 1.0 / l[a], last);
            for (var ci = 0u; ci < NCH; ci++) {
                let d4 = 16u * ci + cg;
                if (d4 < u.D4) { st_fo(u.oo + row * u.ldq + (h * u.D4 + d4) * 4u, o[a * 4u + ci] * inv); }
            }
            if (cg == 0u) {
                if (last) {
                    fm[u.om + row * u.Hq + h] = m[a] + log(l[a]);
                } else {
                    fm[u.om + row * u.Hq + h] = m[a];
                    fl[u.ol + row * u.Hq + h] = l[a];
                }
            }
        }
    }
}

// dq (bd1 at oo) over the key segment [s0, s1) (s0 a multiple of 32)
@compute @workgroup_size(256)
fn attention_backward_dq(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                               @builtin(local_invocation_index) lid: u32) {
    let u = BU;
    let nqb = (u.L + 63u) / 64u;
    let nb = nqb - u.s0 / 64u;
    let wg = wid.x + wid.y * nwg.x;
    if (wg >= u.B * u.Hq * nb) { return; }
    let qb = nqb - 1u - wg % nb;
    let h = (wg / nb) % u.Hq;
    let b = wg / (nb * u.Hq);
    let g = h / u.REP;
    let t0 = qb * 64u;
    let rg = lid / 16u;
    let cg = lid % 16u;
    var dq: array<vec4<f32>, 16>;
    var lse: array<f32, 4>;
    var dl: array<f32, 4>;
    for (var a = 0u; a < 4u; a++) {
        let t = t0 + 4u * rg + a;
        lse[a] = 0.0;
        dl[a] = 0.0;
        for (var ci = 0u; ci < NCH; ci++) { dq[a * 4u + ci] = vec4<f32>(0.0); }
        if (t < u.L) {
            let row = b * u.L + t;
            lse[a] = blse[u.om + row * u.Hq + h];
            dl[a] = bdelta[u.oe + row * u.Hq + h];
            if (u.first != 1u) {
                for (var ci = 0u; ci < NCH; ci++) {
                    let d4 = 16u * ci + cg;
                    if (d4 < u.D4) { dq[a * 4u + ci] = ld_bd1(u.oo + row * u.ldq + (h * u.D4 + d4) * 4u); }
                }
            }
        }
    }
    let kend = min(u.s1, min(u.L, t0 + 64u));
    for (var k0 = u.s0; k0 < kend; k0 += 32u) {
        var sc: array<f32, 8>;
        var dp: array<f32, 8>;
        for (var i = 0u; i < 8u; i++) { sc[i] = 0.0; dp[i] = 0.0; }
        for (var c0 = 0u; c0 < u.D4; c0 += 4u) {
            // q * scale and do (64 rows x 4 vec4) into ts, k and v (32 keys x 4) into tp, as [c][row]
            for (var n = lid; n < 512u; n += 256u) {
                let w = n / 256u;
                let r = (n % 256u) / 4u;
                let c = n % 4u;
                let t = t0 + r;
                var x = vec4<f32>(0.0);
                if (t < u.L && c0 + c < u.D4) {
                    let e = (b * u.L + t) * u.ldq + (h * u.D4 + c0 + c) * 4u;
                    if (w == 0u) { x = ld_bq(u.oq + e) * u.scale; } else { x = ld_bdo(u.od + e); }
                }
                ts[w * 256u + c * 64u + r] = x;
            }
            {
                let w = lid / 128u;
                let j = (lid % 128u) / 4u;
                let c = lid % 4u;
                var x = vec4<f32>(0.0);
                if (k0 + j < u.L && c0 + c < u.D4) {
                    let e = (b * u.L + k0 + j) * u.ldk + (g * u.D4 + c0 + c) * 4u;
                    if (w == 0u) { x = ld_bk(u.ok + e); } else { x = ld_bv(u.ov + e); }
                }
                tp[w * 128u + c * 32u + j] = x;
            }
            workgroupBarrier();
            for (var c = 0u; c < 4u; c++) {
                let ka = tp[c * 32u + cg];
                let kb = tp[c * 32u + cg + 16u];
                let va = tp[128u + c * 32u + cg];
                let vb = tp[128u + c * 32u + cg + 16u];
                for (var a = 0u; a < 4u; a++) {
                    let qv = ts[c * 64u + 4u * rg + a];
                    let gv = ts[256u + c * 64u + 4u * rg + a];
                    sc[a * 2u] += dot(qv, ka);
                    sc[a * 2u + 1u] += dot(qv, kb);
                    dp[a * 2u] += dot(gv, va);
                    dp[a * 2u + 1u] += dot(gv, vb);
                }
            }
            workgroupBarrier();
        }
        // ds = p (dO.v - delta) scale, p = exp(s - lse), into tp as [key][rg]
        for (var e = 0u; e < 2u; e++) {
            let j = k0 + cg + 16u * e;
            var d4v = vec4<f32>(0.0);
            for (var a = 0u; a < 4u; a++) {
                let t = t0 + 4u * rg + a;
                if (j <= t && t < u.L) {
                    d4v[a] = exp(sc[a * 2u + e] - lse[a]) * (dp[a * 2u + e] - dl[a]) * u.scale;
                }
            }
            tp[(cg + 16u * e) * 16u + rg] = d4v;
        }
        // dq += ds k, k staged 32 keys x 16 vec4 at a time
        for (var ci = 0u; ci < NCH; ci++) {
            for (var n = lid; n < 512u; n += 256u) {
                let j = n / 16u;
                let d4 = 16u * ci + n % 16u;
                var x = vec4<f32>(0.0);
                if (k0 + j < u.L && d4 < u.D4) { x = ld_bk(u.ok + (b * u.L + k0 + j) * u.ldk + (g * u.D4 + d4) * 4u); }
                ts[n] = x;
            }
            workgroupBarrier();
            for (var j = 0u; j < 32u; j++) {
                let pv = tp[j * 16u + rg];
                let kv = ts[j * 16u + cg];
                for (var a = 0u; a < 4u; a++) { dq[a * 4u + ci] += pv[a] * kv; }
            }
            workgroupBarrier();
        }
    }
    for (var a = 0u; a < 4u; a++) {
        let t = t0 + 4u * rg + a;
        if (t < u.L) {
            for (var ci = 0u; ci < NCH; ci++) {
                let d4 = 16u * ci + cg;
                if (d4 < u.D4) { st_bd1(u.oo + (b * u.L + t) * u.ldq + (h * u.D4 + d4) * 4u, dq[a * 4u + ci]); }
            }
        }
    }
}

// dk (bd1 at oo) and dv (bd2 at ol), [M, ldk], over the query segment [s0, s1) (s0 a multiple
// of 32), keys j < s1, summed over the REP query heads of kv head g inside the workgroup
@compute @workgroup_size(256)
fn attention_backward_dkv(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                                @builtin(local_invocation_index) lid: u32) {
    let u = BU;
    let nb = (u.s1 + 63u) / 64u;
    let wg = wid.x + wid.y * nwg.x;
    if (wg >= u.B * u.Hkv * nb) { return; }
    let kb0 = wg % nb;                      // the first keys (the most queries) first
    let g = (wg / nb) % u.Hkv;
    let b = wg / (nb * u.Hkv);
    let k0 = kb0 * 64u;
    let rg = lid / 16u;
    let cg = lid % 16u;
    var dk: array<vec4<f32>, 16>;
    var dv: array<vec4<f32>, 16>;
    for (var a = 0u; a < 4u; a++) {
        let j = k0 + 4u * rg + a;
        for (var ci = 0u; ci < NCH; ci++) {
            dk[a * 4u + ci] = vec4<f32>(0.0);
            dv[a * 4u + ci] = vec4<f32>(0.0);
            let d4 = 16u * ci + cg;
            if (u.first != 1u && j < u.L && d4 < u.D4) {
                let e = (b * u.L + j) * u.ldk + (g * u.D4 + d4) * 4u;
                dk[a * 4u + ci] = ld_bd1(u.oo + e);
                dv[a * 4u + ci] = ld_bd2(u.ol + e);
            }
        }
    }
    let qend = min(u.s1, u.L);
    for (var r = 0u; r < u.REP; r++) {
        let h = g * u.REP + r;
        for (var i0 = max(u.s0, k0); i0 < qend; i0 += 32u) {
            var sc: array<f32, 8>;          // [a * 2 + e]: key k0 + 4 rg + a, query i0 + cg + 16 e
            var dp: array<f32, 8>;
            for (var i = 0u; i < 8u; i++) { sc[i] = 0.0; dp[i] = 0.0; }
            for (var c0 = 0u; c0 < u.D4; c0 += 4u) {
                // k * scale and v (64 keys x 4 vec4) into ts, q and do (32 rows x 4) into tp
                for (var n = lid; n < 512u; n += 256u) {
                    let w = n / 256u;
                    let jj = (n % 256u) / 4u;
                    let c = n % 4u;
                    var x = vec4<f32>(0.0);
                    if (k0 + jj < u.L && c0 + c < u.D4) {
                        let e = (b * u.L + k0 + jj) * u.ldk + (g * u.D4 + c0 + c) * 4u;
                        if (w == 0u) { x = ld_bk(u.ok + e) * u.scale; } else { x = ld_bv(u.ov + e); }
                    }
                    ts[w * 256u + c * 64u + jj] = x;
                }
                {
                    let w = lid / 128u;
                    let ii = (lid % 128u) / 4u;
                    let c = lid % 4u;
                    var x = vec4<f32>(0.0);
                    if (i0 + ii < u.L && c0 + c < u.D4) {
                        let e = (b * u.L + i0 + ii) * u.ldq + (h * u.D4 + c0 + c) * 4u;
                        if (w == 0u) { x = ld_bq(u.oq + e); } else { x = ld_bdo(u.od + e); }
                    }
                    tp[w * 128u + c * 32u + ii] = x;
                }
                workgroupBarrier();
                for (var c = 0u; c < 4u; c++) {
                    let qa = tp[c * 32u + cg];
                    let qb = tp[c * 32u + cg + 16u];
                    let ga = tp[128u + c * 32u + cg];
                    let gb = tp[128u + c * 32u + cg + 16u];
                    for (var a = 0u; a < 4u; a++) {
                        let kv = ts[c * 64u + 4u * rg + a];
                        let vv = ts[256u + c * 64u + 4u * rg + a];
                        sc[a * 2u] += dot(kv, qa);
                        sc[a * 2u + 1u] += dot(kv, qb);
                        dp[a * 2u] += dot(vv, ga);
                        dp[a * 2u + 1u] += dot(vv, gb);
                    }
                }
                workgroupBarrier();
            }
            var pe: array<vec4<f32>, 2>;
            var de: array<vec4<f32>, 2>;
            for (var e = 0u; e < 2u; e++) {
                let i = i0 + cg + 16u * e;
                pe[e] = vec4<f32>(0.0);
                de[e] = vec4<f32>(0.0);
                if (i < qend) {
                    let st = (b * u.L + i) * u.Hq + h;
                    let lse = blse[u.om + st];
                    let dl = bdelta[u.oe + st];
                    for (var a = 0u; a < 4u; a++) {
                        if (k0 + 4u * rg + a <= i) {
                            let p = exp(sc[a * 2u + e] - lse);
                            pe[e][a] = p;
                            de[e][a] = p * (dp[a * 2u + e] - dl) * u.scale;
                        }
                    }
                }
            }
            // dv += p^T do, then dk += ds^T q: the block's p (then ds) in tp as [query][rg]
            for (var w = 0u; w < 2u; w++) {
                if (w == 0u) {
                    tp[cg * 16u + rg] = pe[0];
                    tp[(cg + 16u) * 16u + rg] = pe[1];
                } else {
                    tp[cg * 16u + rg] = de[0];
                    tp[(cg + 16u) * 16u + rg] = de[1];
                }
                for (var ci = 0u; ci < NCH; ci++) {
                    for (var n = lid; n < 512u; n += 256u) {
                        let ii = n / 16u;
                        let d4 = 16u * ci + n % 16u;
                        var x = vec4<f32>(0.0);
                        if (i0 + ii < u.L && d4 < u.D4) {
                            let e = (b * u.L + i0 + ii) * u.ldq + (h * u.D4 + d4) * 4u;
                            if (w == 0u) { x = ld_bdo(u.od + e); } else { x = ld_bq(u.oq + e); }
                        }
                        ts[n] = x;
                    }
                    workgroupBarrier();
                    for (var ii = 0u; ii < 32u; ii++) {
                        let pv = tp[ii * 16u + rg];
                        let xv = ts[ii * 16u + cg];
                        for (var a = 0u; a < 4u; a++) {
                            if (w == 0u) { dv[a * 4u + ci] += pv[a] * xv; } else { dk[a * 4u + ci] += pv[a] * xv; }
                        }
                    }
                    workgroupBarrier();
                }
            }
        }
    }
    for (var a = 0u; a < 4u; a++) {
        let j = k0 + 4u * rg + a;
        if (j < u.L) {
            for (var ci = 0u; ci < NCH; ci++) {
                let d4 = 16u * ci + cg;
                if (d4 < u.D4) {
                    let e = (b * u.L + j) * u.ldk + (g * u.D4 + d4) * 4u;
                    st_bd1(u.oo + e, dk[a * 4u + ci]);
                    st_bd2(u.ol + e, dv[a * 4u + ci]);
                }
            }
        }
    }
}

// ---------------------------------------------------------------- decoding (batch 1)
// The KV cache of a layer: kc, vc [cap, Hkv*D]; pos[0] = the position of the step's token (the
// number of tokens before it).  A step appends its k, v at row pos, then attends over rows
// 0..pos in segments of SEG keys (one invocation per (head, segment): partial max, sum and
// unnormalised output into `part` [Hq, nseg, D + 2]), and combines the segments per head.
struct DP { Hq: u32, Hkv: u32, D4: u32, REP: u32, cap: u32, seg: u32, nseg: u32, ldk: u32,
            scale: f32, p0: u32, p1: u32, p2: u32 }

@group(0) @binding(0) var<storage, read> ak: array<f32>;
@group(0) @binding(1) var<storage, read> av: array<f32>;
@group(0) @binding(2) var<storage, read_write> akc: array<f32>;
@group(0) @binding(3) var<storage, read_write> avc: array<f32>;
@group(0) @binding(4) var<storage, read> apos: array<u32>;
@group(0) @binding(5) var<uniform> AU: DP;

@compute @workgroup_size(256)
fn attention_decode_append(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                           @builtin(local_invocation_index) lid: u32) {
    let u = AU;
    let i = lin(wid, nwg, lid);
    let p = apos[0];
    if (i >= u.ldk || p >= u.cap) { return; }
    akc[p * u.ldk + i] = ak[i];
    avc[p * u.ldk + i] = av[i];
}

@group(0) @binding(0) var<storage, read> pq: array<f32>;
@group(0) @binding(1) var<storage, read> pkc: array<f32>;
@group(0) @binding(2) var<storage, read> pvc: array<f32>;
@group(0) @binding(3) var<storage, read> ppos: array<u32>;
@group(0) @binding(4) var<storage, read_write> ppart: array<f32>;
@group(0) @binding(5) var<uniform> PU: DP;

@compute @workgroup_size(256)
fn attention_decode_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                            @builtin(local_invocation_index) lid: u32) {
    let u = PU;
    let i = lin(wid, nwg, lid);
    if (i >= u.Hq * u.nseg) { return; }
    let h = i / u.nseg;
    let sg = i % u.nseg;
    let g = h / u.REP;
    let last = min(ppos[0], u.cap - 1u);
    let j0 = sg * u.seg;
    let j1 = min(j0 + u.seg, last + 1u);
    let base = (h * u.nseg + sg) * (u.D4 * 4u + 2u);
    var q: array<vec4<f32>, MAXD4>;
    var o: array<vec4<f32>, MAXD4>;
    for (var d = 0u; d < u.D4; d++) {
        q[d] = ld_pq(h * u.D4 * 4u + 4u * d) * u.scale;
        o[d] = vec4<f32>(0.0);
    }
    var m = -3.0e38;
    var l = 0.0;
    for (var j = j0; j < j1; j++) {
        let kb = j * u.ldk + g * u.D4 * 4u;
        var acc = vec4<f32>(0.0);
        for (var d = 0u; d < u.D4; d++) {
            acc += q[d] * ld_pkc(kb + 4u * d);
        }
        let s = acc.x + acc.y + acc.z + acc.w;
        let mn = max(m, s);
        let c = exp(m - mn);
        let p = exp(s - mn);
        l = l * c + p;
        m = mn;
        for (var d = 0u; d < u.D4; d++) {
            o[d] = o[d] * c + p * ld_pvc(kb + 4u * d);
        }
    }
    for (var d = 0u; d < u.D4; d++) {
        let e = base + 4u * d;
        ppart[e] = o[d].x; ppart[e + 1u] = o[d].y; ppart[e + 2u] = o[d].z; ppart[e + 3u] = o[d].w;
    }
    ppart[base + u.D4 * 4u] = m;
    ppart[base + u.D4 * 4u + 1u] = l;
}

@group(0) @binding(0) var<storage, read> cpart: array<f32>;
@group(0) @binding(1) var<storage, read_write> cout: array<f32>;
@group(0) @binding(2) var<uniform> CU: DP;

// out[h*D + d] = sum_s exp(m_s - M) o_s[d] / sum_s exp(m_s - M) l_s   (empty segments: l_s = 0)
@compute @workgroup_size(256)
fn attention_decode_combine(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                            @builtin(local_invocation_index) lid: u32) {
    let u = CU;
    let i = lin(wid, nwg, lid);
    let D = u.D4 * 4u;
    if (i >= u.Hq * D) { return; }
    let h = i / D;
    let d = i % D;
    var mx = -3.0e38;
    for (var s = 0u; s < u.nseg; s++) {
        let b = (h * u.nseg + s) * (D + 2u);
        if (cpart[b + D + 1u] > 0.0) { mx = max(mx, cpart[b + D]); }
    }
    var num = 0.0;
    var den = 0.0;
    for (var s = 0u; s < u.nseg; s++) {
        let b = (h * u.nseg + s) * (D + 2u);
        let l = cpart[b + D + 1u];
        if (l > 0.0) {
            let w = exp(cpart[b + D] - mx);
            num += w * cpart[b + d];
            den += w * l;
        }
    }
    cout[i] = num / den;
}

@group(0) @binding(0) var<storage, read_write> vpos: array<u32>;

// the next step's position
@compute @workgroup_size(1)
fn attention_decode_advance() {
    vpos[0] = vpos[0] + 1u;
}

fn ld_pq(i: u32) -> vec4<f32> { return vec4<f32>(pq[i], pq[i + 1u], pq[i + 2u], pq[i + 3u]); }
fn ld_pkc(i: u32) -> vec4<f32> { return vec4<f32>(pkc[i], pkc[i + 1u], pkc[i + 2u], pkc[i + 3u]); }
fn ld_pvc(i: u32) -> vec4<f32> { return vec4<f32>(pvc[i], pvc[i + 1u], pvc[i + 2u], pvc[i + 3u]); }
