// Causal self-attention with grouped KV heads, forward and backward, with an online softmax
// (flash attention's recurrence): no L x L matrix is ever stored (engine/kernels/attention.py).
// Letters: B sequences of L tokens, rows m = b*L + t; Hq query heads, Hkv = Hq / REP key/value
// heads (query head h reads kv head h / REP, transformers' repeat_kv), D head_dim (a multiple
// of 4, at most 4*MAXD4), s = scale * q.k (Granite: attention_multiplier; else 1/sqrt(D)).
//     q [M, ldq] (head h at column h*D), k and v [M, ldk] (head g at column g*D), o [M, ldq]
//     stats [M, Hq]: the running max m and sum l during the forward, then lse = m + log l.
// The key range is walked in segments [k0, k1), one dispatch each (the host picks segments
// short enough for every invocation's loop count to stay far below lavapipe's 65535), the
// online state (o unnormalised, m, l) kept in the output buffers between them; the backward
// recomputes p = exp(s - lse) and walks keys (dq) or queries (dk, dv) in segments alike.
// One invocation per (b, head, row); an invocation's rows of q, k, v and its accumulators
// live in registers as vec4s.

const MAXD4: u32 = 64u;   // D <= 256

struct AP { B: u32, L: u32, Hq: u32, Hkv: u32, D4: u32, REP: u32, ldq: u32, ldk: u32,
            s0: u32, s1: u32, first: u32, rows: u32,
            oq: u32, ok: u32, ov: u32, oo: u32, om: u32, ol: u32, od: u32, oe: u32,
            scale: f32, factor: f32, p0: u32, p1: u32 }


// ---------------------------------------------------------------- forward, one key segment
@group(0) @binding(0) var<storage, read> fq: array<f32>;
@group(0) @binding(1) var<storage, read> fk: array<f32>;
@group(0) @binding(2) var<storage, read> fv: array<f32>;
@group(0) @binding(3) var<storage, read_write> fo: array<f32>;
@group(0) @binding(4) var<storage, read_write> fm: array<f32>;
@group(0) @binding(5) var<storage, read_write> fl: array<f32>;
@group(0) @binding(6) var<uniform> FU: AP;

// rows t in [s0, L) of every (b, h) (a row before s0 sees no key of the segment)
@compute @workgroup_size(256)
fn attention_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) lid: u32) {
    let u = FU;
    let idx = lin(wid, nwg, lid);
    let nt = u.L - u.s0;
    if (idx >= u.B * u.Hq * nt) { return; }
    let t = u.s0 + idx % nt;
    let h = (idx / nt) % u.Hq;
    let b = idx / (nt * u.Hq);
    let g = h / u.REP;
    let row = b * u.L + t;
    let qb = u.oq + row * u.ldq + h * u.D4 * 4u;
    let ob = u.oo + row * u.ldq + h * u.D4 * 4u;
    let st = row * u.Hq + h;
    var q: array<vec4<f32>, MAXD4>;
    var o: array<vec4<f32>, MAXD4>;
    var m = -3.0e38;
    var l = 0.0;
    for (var d = 0u; d < u.D4; d++) {
        q[d] = ld_fq(qb + 4u * d) * u.scale;
        if (u.first == 1u) {
            o[d] = vec4<f32>(0.0);
        } else {
            o[d] = vec4<f32>(fo[ob + 4u * d], fo[ob + 4u * d + 1u], fo[ob + 4u * d + 2u], fo[ob + 4u * d + 3u]);
        }
    }
    if (u.first != 1u) {
        m = fm[u.om + st];
        l = fl[u.ol + st];
    }
    let jend = min(u.s1, t + 1u);
    for (var j = u.s0; j < jend; j++) {
        let kb = u.ok + (b * u.L + j) * u.ldk + g * u.D4 * 4u;
        let vb = u.ov + (b * u.L + j) * u.ldk + g * u.D4 * 4u;
        var acc = vec4<f32>(0.0);
        for (var d = 0u; d < u.D4; d++) {
            acc += q[d] * ld_fk(kb + 4u * d);
        }
        let s = acc.x + acc.y + acc.z + acc.w;
        let mn = max(m, s);
        let c = exp(m - mn);
        let p = exp(s - mn);
        l = l * c + p;
        m = mn;
        for (var d = 0u; d < u.D4; d++) {
            o[d] = o[d] * c + p * ld_fv(vb + 4u * d);
        }
    }
    for (var d = 0u; d < u.D4; d++) {
        let e = ob + 4u * d;
        fo[e] = o[d].x; fo[e + 1u] = o[d].y; fo[e + 2u] = o[d].z; fo[e + 3u] = o[d].w;
    }
    fm[u.om + st] = m;
    fl[u.ol + st] = l;
}

// o /= l; stats m -> lse = m + log(l).  One invocation per (row, head).
@compute @workgroup_size(256)
fn attention_finish(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) lid: u32) {
    let u = FU;
    let st = lin(wid, nwg, lid);
    if (st >= u.rows * u.Hq) { return; }
    let row = st / u.Hq;
    let h = st % u.Hq;
    let l = fl[u.ol + st];
    let inv = 1.0 / l;
    let ob = u.oo + row * u.ldq + h * u.D4 * 4u;
    for (var d = 0u; d < u.D4 * 4u; d++) {
        fo[ob + d] = fo[ob + d] * inv;
    }
    fm[u.om + st] = fm[u.om + st] + log(l);
}

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

@group(0) @binding(0) var<storage, read> bq: array<f32>;
@group(0) @binding(1) var<storage, read> bk: array<f32>;
@group(0) @binding(2) var<storage, read> bv: array<f32>;
@group(0) @binding(3) var<storage, read> bdo: array<f32>;
@group(0) @binding(4) var<storage, read> blse: array<f32>;
@group(0) @binding(5) var<storage, read> bdelta: array<f32>;
@group(0) @binding(6) var<storage, read_write> bd1: array<f32>;
@group(0) @binding(7) var<storage, read_write> bd2: array<f32>;
@group(0) @binding(8) var<uniform> BU: AP;

// dq (bd1, [M, ldq]) over the key segment [s0, s1), rows t >= s0:
//     p = exp(s - lse), ds = p * (dO.v - delta), dq += scale * ds * k
@compute @workgroup_size(256)
fn attention_backward_dq(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_index) lid: u32) {
    let u = BU;
    let idx = lin(wid, nwg, lid);
    let nt = u.L - u.s0;
    if (idx >= u.B * u.Hq * nt) { return; }
    let t = u.s0 + idx % nt;
    let h = (idx / nt) % u.Hq;
    let b = idx / (nt * u.Hq);
    let g = h / u.REP;
    let row = b * u.L + t;
    let qb = row * u.ldq + h * u.D4 * 4u;
    let st = row * u.Hq + h;
    let lse = blse[u.om + st];
    let dl = bdelta[u.oe + st];
    var q: array<vec4<f32>, MAXD4>;
    var go: array<vec4<f32>, MAXD4>;
    var dq: array<vec4<f32>, MAXD4>;
    for (var d = 0u; d < u.D4; d++) {
        q[d] = ld_bq(u.oq + qb + 4u * d) * u.scale;
        go[d] = ld_bdo(u.od + qb + 4u * d);
        if (u.first == 1u) {
            dq[d] = vec4<f32>(0.0);
        } else {
            let e = u.oo + qb + 4u * d;
            dq[d] = vec4<f32>(bd1[e], bd1[e + 1u], bd1[e + 2u], bd1[e + 3u]);
        }
    }
    let jend = min(u.s1, t + 1u);
    for (var j = u.s0; j < jend; j++) {
        let kb = u.ok + (b * u.L + j) * u.ldk + g * u.D4 * 4u;
        let vb = u.ov + (b * u.L + j) * u.ldk + g * u.D4 * 4u;
        var a = vec4<f32>(0.0);
        var c = vec4<f32>(0.0);
        for (var d = 0u; d < u.D4; d++) {
            a += q[d] * ld_bk(kb + 4u * d);
            c += go[d] * ld_bv(vb + 4u * d);
        }
        let p = exp(a.x + a.y + a.z + a.w - lse);
        let ds = p * (c.x + c.y + c.z + c.w - dl) * u.scale;
        for (var d = 0u; d < u.D4; d++) {
            dq[d] += ds * ld_bk(kb + 4u * d);
        }
    }
    for (var d = 0u; d < u.D4; d++) {
        let e = u.oo + qb + 4u * d;
        bd1[e] = dq[d].x; bd1[e + 1u] = dq[d].y; bd1[e + 2u] = dq[d].z; bd1[e + 3u] = dq[d].w;
    }
}

// dk (bd1) and dv (bd2), [M, ldk], over the query segment [s0, s1), keys j < s1, summed over
// the REP query heads of kv head g:  dv += p * dO,  dk += scale * ds * q
@compute @workgroup_size(256)
fn attention_backward_dkv(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                          @builtin(local_invocation_index) lid: u32) {
    let u = BU;
    let idx = lin(wid, nwg, lid);
    let nj = u.s1;
    if (idx >= u.B * u.Hkv * nj) { return; }
    let j = idx % nj;
    let g = (idx / nj) % u.Hkv;
    let b = idx / (nj * u.Hkv);
    let krow = b * u.L + j;
    let kb = krow * u.ldk + g * u.D4 * 4u;
    var k: array<vec4<f32>, MAXD4>;
    var v: array<vec4<f32>, MAXD4>;
    var dk: array<vec4<f32>, MAXD4>;
    var dv: array<vec4<f32>, MAXD4>;
    for (var d = 0u; d < u.D4; d++) {
        k[d] = ld_bk(u.ok + kb + 4u * d) * u.scale;
        v[d] = ld_bv(u.ov + kb + 4u * d);
        if (u.first == 1u) {
            dk[d] = vec4<f32>(0.0);
            dv[d] = vec4<f32>(0.0);
        } else {
            let e = u.oo + kb + 4u * d;
            dk[d] = vec4<f32>(bd1[e], bd1[e + 1u], bd1[e + 2u], bd1[e + 3u]);
            let f = u.ol + kb + 4u * d;
            dv[d] = vec4<f32>(bd2[f], bd2[f + 1u], bd2[f + 2u], bd2[f + 3u]);
        }
    }
    let ibeg = max(u.s0, j);
    for (var i = ibeg; i < u.s1; i++) {
        let row = b * u.L + i;
        for (var r = 0u; r < u.REP; r++) {
            let h = g * u.REP + r;
            let qb = row * u.ldq + h * u.D4 * 4u;
            let st = row * u.Hq + h;
            var a = vec4<f32>(0.0);
            var c = vec4<f32>(0.0);
            for (var d = 0u; d < u.D4; d++) {
                a += k[d] * ld_bq(u.oq + qb + 4u * d);
                c += v[d] * ld_bdo(u.od + qb + 4u * d);
            }
            let p = exp(a.x + a.y + a.z + a.w - blse[u.om + st]);
            let ds = p * (c.x + c.y + c.z + c.w - bdelta[u.oe + st]) * u.scale;
            for (var d = 0u; d < u.D4; d++) {
                dv[d] += p * ld_bdo(u.od + qb + 4u * d);
                dk[d] += ds * ld_bq(u.oq + qb + 4u * d);
            }
        }
    }
    for (var d = 0u; d < u.D4; d++) {
        let e = u.oo + kb + 4u * d;
        bd1[e] = dk[d].x; bd1[e + 1u] = dk[d].y; bd1[e + 2u] = dk[d].z; bd1[e + 3u] = dk[d].w;
        let f = u.ol + kb + 4u * d;
        bd2[f] = dv[d].x; bd2[f + 1u] = dv[d].y; bd2[f + 2u] = dv[d].z; bd2[f + 3u] = dv[d].w;
    }
}

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
