enable f16;
enable subgroups;
enable chromium_experimental_subgroup_matrix;
diagnostic(off, chromium_experimental.subgroup_matrix_uniformity);
// attention_sgmat: shaders/attention.wgsl's causal GQA attention, forward and backward, on
// subgroup matrices (tensor cores from WGSL: f16 x f16 -> f32 at 16x16x16), for --precision
// mixed on adapters that have them (engine/kernels/attention.py `takes_subgroup_matrices`:
// head_dim D a multiple of 16, at most 128).  Letters and layouts as attention.wgsl's: rows
// m = b*L + t, q and o [M, ldq] (head h at column h*D), k and v [M, ldk] (kv head g = h / REP),
// s = scale * q.k, lse [M, Hq].
//
// The operands are f16 copies scaled per tensor (q16 = q * 2^eq ..., exponents in the scale
// table at the slots the uniform names: engine/kernels/matmul.py `F16Scales`), each with at
// least 64 rows of zeros past its last row, so that a block's rows load without bounds (rows
// past a sequence read the next one's, finite, and are masked), as 16-byte words through
// workgroup memory (below: "operands, staged").  A workgroup is 4 subgroups of 32 (128
// invocations); subgroup sg takes 16 rows of a 64-row block (query rows: forward, dq; keys:
// dk, dv) as D / 16 left matrices held in registers, and walks the other side in blocks of
// KB = 32, below the causal diagonal only: per block its 16 x 32 scores (two results) go
// through workgroup memory, where invocation tid takes row tid / 2 of the 64 and 16 of its 32
// columns (the mask, the softmax's terms, f16 probabilities for the next product), then the
// subgroup multiplies them into its D / 16 accumulators (named fields: no private arrays of
// matrices).
//
// Workgroup memory: at most 32,000 bytes (D 128; 23,808 at D 64), under the 32 KiB that WebGPU
// adapters may offer (Dawn on Mesa 25's lavapipe, where CI runs these kernels emulated, refuses
// more): one f32 patch of scores, which in the backward holds s and then dP (each invocation
// keeps its 16 p in registers between them), one f16 patch, p and then ds, and the two staged
// blocks, sized by D.
//
// No online rescaling: a result matrix cannot be scaled row by row, so the forward walks the
// keys twice, first for each row's max and sum (lse), then with p = exp(s - lse) final for
// o += p v.  The backward recomputes p from lse (delta = rowsum(dO * o) from attention.wgsl's
// attention_delta):
//     ds = p (dp - delta),  dp = dO . v,   dq = scale ds k,  dk = scale ds^T q,  dv = p^T dO
// ds is rounded to f16 as ds * 2^(edo + ev - cexp): |ds| <= 2 D amax(dO) amax(v), so with
// cexp = ceil(log2 D) + 18 it stays under 2^15 for operands up to 2^3 past their scale's
// target (the engine's F16_TARGET_EXP 12), and far above f16's smallest normals.

struct SA { B: u32, L: u32, Hq: u32, REP: u32, ldq: u32, ldk: u32, nqb: u32, nkb: u32,
            oq: u32, ok: u32, ov: u32, odo: u32, o1: u32, o2: u32, os1: u32, os2: u32,
            sq: u32, sk: u32, sv: u32, sdo: u32, cexp: i32, Hkv: u32, scale: f32, p0: u32 }

@group(0) @binding(0) var<storage, read> q8: array<vec4<u32>>;    // the f16 operands as 16-byte words
@group(0) @binding(1) var<storage, read> k8: array<vec4<u32>>;    // (8 halves)
@group(0) @binding(2) var<storage, read> v8: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> do8: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read_write> out1: array<f32>;   // o; dq; dk
@group(0) @binding(5) var<storage, read_write> out2: array<f32>;   // lse; -; dv
@group(0) @binding(6) var<storage, read> st1: array<f32>;          // lse (backward)
@group(0) @binding(7) var<storage, read> st2: array<f32>;          // delta (backward)
@group(0) @binding(8) var<storage, read> f16_exps: array<i32>;
@group(0) @binding(9) var<uniform> U: SA;

override D16: u32 = 4u;        // head_dim / 16 (1 .. 8)
override D: u32 = 16u * D16;   // head_dim
override BS: u32 = D + 8u;     // a staged row (16 bytes of padding)
const KB: u32 = 32u;           // keys (query rows) a block of the walk
const SS: u32 = KB + 4u;       // a row of the f32 patches (16 bytes of padding: a row's two halves,
                               // which adjacent invocations read, fall in different banks)
const HP: u32 = KB + 8u;       // a row of the f16 patches (16 bytes of padding)
const NEG: f32 = -3.0e38;
const QW: u32 = 0u;            // the operands, for word()
const KW: u32 = 1u;
const VW: u32 = 2u;
const DOW: u32 = 3u;

var<workgroup> Ss: array<f32, 2304>;   // [64][SS] scores, then dP (transposed in dk/dv); the stores' patches
var<workgroup> Ps: array<f16, 2560>;   // [64][HP] p, then ds (scaled)
var<workgroup> Rs: array<f32, 64>;     // the walked rows' lse and delta (dk/dv)
var<workgroup> Ab: array<f16, KB * BS>;   // [KB][BS] a walked block of one operand
var<workgroup> Bb: array<f16, KB * BS>;   // [KB][BS] and of another (or rows 32..63 of a held block)

struct LM { m0: subgroup_matrix_left<f16, 16, 16>, m1: subgroup_matrix_left<f16, 16, 16>,
            m2: subgroup_matrix_left<f16, 16, 16>, m3: subgroup_matrix_left<f16, 16, 16>,
            m4: subgroup_matrix_left<f16, 16, 16>, m5: subgroup_matrix_left<f16, 16, 16>,
            m6: subgroup_matrix_left<f16, 16, 16>, m7: subgroup_matrix_left<f16, 16, 16> }
struct RM { r0: subgroup_matrix_result<f32, 16, 16>, r1: subgroup_matrix_result<f32, 16, 16>,
            r2: subgroup_matrix_result<f32, 16, 16>, r3: subgroup_matrix_result<f32, 16, 16>,
            r4: subgroup_matrix_result<f32, 16, 16>, r5: subgroup_matrix_result<f32, 16, 16>,
            r6: subgroup_matrix_result<f32, 16, 16>, r7: subgroup_matrix_result<f32, 16, 16> }

// a block's two 16 x 16 score matrices of the subgroup (rows sg*16..) into workgroup memory
fn put_scores(sg: u32, s0: subgroup_matrix_result<f32, 16, 16>, s1: subgroup_matrix_result<f32, 16, 16>) {
    subgroupMatrixStore(&Ss, sg * 16u * SS, s0, false, SS);
    subgroupMatrixStore(&Ss, sg * 16u * SS + 16u, s1, false, SS);
}

// one 16 x 16 column block j of every subgroup's accumulator, times f, to rows r0 + sg*16 + r
// (those before `end`, relative to the sequence's first row `base`) of out1 (dst 0) or out2
// at columns col + 16 j, ld apart; through workgroup memory (Ss: 256 floats a subgroup)
fn store_block(m: subgroup_matrix_result<f32, 16, 16>, j: u32, f: f32, dst: u32, sg: u32, tid: u32,
               base: u32, r0: u32, end: u32, col: u32, ld: u32) {
    subgroupMatrixStore(&Ss, sg * 256u, m, false, 16u);
    workgroupBarrier();
    for (var e = tid; e < 1024u; e += 128u) {
        let r = r0 + (e / 256u) * 16u + (e % 256u) / 16u;
        if (r < end) {
            let i = (base + r) * ld + col + 16u * j + e % 16u;
            if (dst == 0u) { out1[i] = Ss[e] * f; } else { out2[i] = Ss[e] * f; }
        }
    }
    workgroupBarrier();
}

fn store_rows(acc: ptr<function, RM>, f: f32, dst: u32, sg: u32, tid: u32, base: u32, r0: u32, end: u32,
              col: u32, ld: u32) {
    store_block((*acc).r0, 0u, f, dst, sg, tid, base, r0, end, col, ld);
    if (D16 > 1u) { store_block((*acc).r1, 1u, f, dst, sg, tid, base, r0, end, col, ld); }
    if (D16 > 2u) { store_block((*acc).r2, 2u, f, dst, sg, tid, base, r0, end, col, ld); }
    if (D16 > 3u) { store_block((*acc).r3, 3u, f, dst, sg, tid, base, r0, end, col, ld); }
    if (D16 > 4u) { store_block((*acc).r4, 4u, f, dst, sg, tid, base, r0, end, col, ld); }
    if (D16 > 5u) { store_block((*acc).r5, 5u, f, dst, sg, tid, base, r0, end, col, ld); }
    if (D16 > 6u) { store_block((*acc).r6, 6u, f, dst, sg, tid, base, r0, end, col, ld); }
    if (D16 > 7u) { store_block((*acc).r7, 7u, f, dst, sg, tid, base, r0, end, col, ld); }
}

// ---------------------------------------------------------------- operands, staged
// Every operand goes through workgroup memory as 16-byte words (elements off + r ld + c; off
// and ld multiples of 8): a workgroup's 64 held rows (queries for the forward and dq, keys for
// dk/dv) once, into the subgroups' registers, then each block of KB rows of the side it walks,
// two operands at a time; the four subgroups load their matrices from there, not each from
// storage.

fn put8(dst: u32, i: u32, v: vec4<u32>) {
    let h0 = bitcast<vec2<f16>>(v.x); let h1 = bitcast<vec2<f16>>(v.y);
    let h2 = bitcast<vec2<f16>>(v.z); let h3 = bitcast<vec2<f16>>(v.w);
    if (dst == 0u) {
        Ab[i] = h0.x; Ab[i + 1u] = h0.y; Ab[i + 2u] = h1.x; Ab[i + 3u] = h1.y;
        Ab[i + 4u] = h2.x; Ab[i + 5u] = h2.y; Ab[i + 6u] = h3.x; Ab[i + 7u] = h3.y;
    } else {
        Bb[i] = h0.x; Bb[i + 1u] = h0.y; Bb[i + 2u] = h1.x; Bb[i + 3u] = h1.y;
        Bb[i + 4u] = h2.x; Bb[i + 5u] = h2.y; Bb[i + 6u] = h3.x; Bb[i + 7u] = h3.y;
    }
}

// word i of operand w
fn word(w: u32, i: u32) -> vec4<u32> {
    switch w {
        case 0u: { return q8[i]; }
        case 1u: { return k8[i]; }
        case 2u: { return v8[i]; }
        default: { return do8[i]; }
    }
}

// KB rows of operand w1 (from element o1, rows ld apart) into Ab and of w2 (from o2) into Bb,
// between barriers (the block before may still be read)
fn stage(w1: u32, o1: u32, w2: u32, o2: u32, ld: u32, tid: u32) {
    workgroupBarrier();
    let wpr = D / 8u;
    for (var i = tid; i < KB * wpr; i += 128u) {
        let r = i / wpr;
        let c = (i % wpr) * 8u;
        put8(0u, r * BS + c, word(w1, (o1 + r * ld + c) / 8u));
        put8(1u, r * BS + c, word(w2, (o2 + r * ld + c) / 8u));
    }
    workgroupBarrier();
}

// a left matrix of Ab (s 0) or Bb (1) from element off
fn staged_l(s: u32, off: u32) -> subgroup_matrix_left<f16, 16, 16> {
    if (s == 0u) { return subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>>(&Ab, off, false, BS); }
    return subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>>(&Bb, off, false, BS);
}

// the subgroup's 16 of 64 held rows of operand w (from element off, rows ld apart) as D16 left
// matrices: the 64 rows staged in Ab (0..31) and Bb (32..63)
fn held_rows(w: u32, off: u32, ld: u32, sg: u32, tid: u32) -> LM {
    stage(w, off, w, off + KB * ld, ld, tid);
    var a: LM;
    let s = sg / 2u;
    let o = (sg % 2u) * 16u * BS;
    a.m0 = staged_l(s, o);
    if (D16 > 1u) { a.m1 = staged_l(s, o + 16u); }
    if (D16 > 2u) { a.m2 = staged_l(s, o + 32u); }
    if (D16 > 3u) { a.m3 = staged_l(s, o + 48u); }
    if (D16 > 4u) { a.m4 = staged_l(s, o + 64u); }
    if (D16 > 5u) { a.m5 = staged_l(s, o + 80u); }
    if (D16 > 6u) { a.m6 = staged_l(s, o + 96u); }
    if (D16 > 7u) { a.m7 = staged_l(s, o + 112u); }
    return a;
}

// 16 x 16 of a staged block (s 0: Ab, 1: Bb) from element off as a right matrix: transposed
// (its rows' elements are the matrix's columns: k^T) or not
fn staged_t(s: u32, off: u32) -> subgroup_matrix_right<f16, 16, 16> {
    if (s == 0u) { return subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>>(&Ab, off, true, BS); }
    return subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>>(&Bb, off, true, BS);
}

fn staged_n(s: u32, off: u32) -> subgroup_matrix_right<f16, 16, 16> {
    if (s == 0u) { return subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>>(&Ab, off, false, BS); }
    return subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>>(&Bb, off, false, BS);
}

// a (16 rows) . (rows r0..r0+15 of staged block s)^T, summed over D
fn dots_staged(a: ptr<function, LM>, s: u32, r0: u32) -> subgroup_matrix_result<f32, 16, 16> {
    let o = r0 * BS;
    var r: subgroup_matrix_result<f32, 16, 16>;
    r = subgroupMatrixMultiplyAccumulate((*a).m0, staged_t(s, o), r);
    if (D16 > 1u) { r = subgroupMatrixMultiplyAccumulate((*a).m1, staged_t(s, o + 16u), r); }
    if (D16 > 2u) { r = subgroupMatrixMultiplyAccumulate((*a).m2, staged_t(s, o + 32u), r); }
    if (D16 > 3u) { r = subgroupMatrixMultiplyAccumulate((*a).m3, staged_t(s, o + 48u), r); }
    if (D16 > 4u) { r = subgroupMatrixMultiplyAccumulate((*a).m4, staged_t(s, o + 64u), r); }
    if (D16 > 5u) { r = subgroupMatrixMultiplyAccumulate((*a).m5, staged_t(s, o + 80u), r); }
    if (D16 > 6u) { r = subgroupMatrixMultiplyAccumulate((*a).m6, staged_t(s, o + 96u), r); }
    if (D16 > 7u) { r = subgroupMatrixMultiplyAccumulate((*a).m7, staged_t(s, o + 112u), r); }
    return r;
}

// acc += (the subgroup's 16 x KB patch of Ps) . (staged block s, all D columns)
fn accum_staged(acc: ptr<function, RM>, sg: u32, s: u32) {
    for (var c = 0u; c < KB / 16u; c++) {
        let p = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>>(&Ps, sg * 16u * HP + c * 16u, false, HP);
        let o = c * 16u * BS;
        (*acc).r0 = subgroupMatrixMultiplyAccumulate(p, staged_n(s, o), (*acc).r0);
        if (D16 > 1u) { (*acc).r1 = subgroupMatrixMultiplyAccumulate(p, staged_n(s, o + 16u), (*acc).r1); }
        if (D16 > 2u) { (*acc).r2 = subgroupMatrixMultiplyAccumulate(p, staged_n(s, o + 32u), (*acc).r2); }
        if (D16 > 3u) { (*acc).r3 = subgroupMatrixMultiplyAccumulate(p, staged_n(s, o + 48u), (*acc).r3); }
        if (D16 > 4u) { (*acc).r4 = subgroupMatrixMultiplyAccumulate(p, staged_n(s, o + 64u), (*acc).r4); }
        if (D16 > 5u) { (*acc).r5 = subgroupMatrixMultiplyAccumulate(p, staged_n(s, o + 80u), (*acc).r5); }
        if (D16 > 6u) { (*acc).r6 = subgroupMatrixMultiplyAccumulate(p, staged_n(s, o + 96u), (*acc).r6); }
        if (D16 > 7u) { (*acc).r7 = subgroupMatrixMultiplyAccumulate(p, staged_n(s, o + 112u), (*acc).r7); }
    }
}

fn exps(slot: u32) -> i32 { return f16_exps[slot]; }

// the factors of the operands' scales (2^eq ...): sc the scores' (scale 2^-(eq + ek)), dl
// delta's into dP's units 2^(edo + ev), and those that undo the products' scales: o 2^-ev,
// dq scale 2^-(edo + ev - cexp + ek), dk likewise with eq, dv 2^-edo
struct Fx { sc: f32, dl: f32, o: f32, dq: f32, dk: f32, dv: f32 }

fn factors(u: SA) -> Fx {
    let eq = exps(u.sq);
    let ek = exps(u.sk);
    let ev = exps(u.sv);
    let edo = exps(u.sdo);
    let ds = u.scale * f16_pow2(-edo) * f16_pow2(-ev) * f16_pow2(u.cexp);
    return Fx(u.scale * f16_pow2(-eq) * f16_pow2(-ek), f16_pow2(edo) * f16_pow2(ev), f16_pow2(-ev),
              ds * f16_pow2(-ek), ds * f16_pow2(-eq), f16_pow2(-edo));
}

// workgroup w's block of 64 query rows (the longest first): (t0, h, b, g)
fn query_block(u: SA, w: u32) -> vec4<u32> {
    let h = (w / u.nqb) % u.Hq;
    return vec4<u32>((u.nqb - 1u - w % u.nqb) * 64u, h, w / (u.nqb * u.Hq), h / u.REP);
}

// ---------------------------------------------------------------- forward
// o (out1, [M, ldq]) and lse (out2, [M, Hq]) of 64 query rows of one (b, h), in two walks over
// the keys: each row's max and sum (lse) first, then o with p = exp(s - lse) final
@compute @workgroup_size(128)
fn attention_sg_forward(@builtin(local_invocation_index) tid: u32, @builtin(workgroup_id) wid: vec3<u32>,
                        @builtin(num_workgroups) nwg: vec3<u32>, @builtin(subgroup_id) sg: u32) {
    let u = U;
    let w = wid.x + wid.y * nwg.x;
    if (w >= u.B * u.Hq * u.nqb) { return; }
    let qb = query_block(u, w);
    let t0 = qb.x;
    let h = qb.y;
    let g = qb.w;
    let base = qb.z * u.L;
    let fx = factors(u);
    var a = held_rows(QW, u.oq + (base + t0) * u.ldq + h * D, u.ldq, sg, tid);
    let rr = tid / 2u;          // this invocation's row of the block and its 16 columns
    let c0 = (tid % 2u) * 16u;
    let t = t0 + rr;
    let kend = min(u.L, t0 + 64u);
    var m = NEG;
    var l = 0.0;
    for (var k0 = 0u; k0 < kend; k0 += KB) {
        let ko = (base + k0) * u.ldk + g * D;
        stage(KW, u.ok + ko, KW, u.ok + ko, u.ldk, tid);   // k (twice: Bb unread)
        put_scores(sg, dots_staged(&a, 0u, 0u), dots_staged(&a, 0u, 16u));
        workgroupBarrier();
        var mx = NEG;
        for (var c = 0u; c < 16u; c++) {
            let j = k0 + c0 + c;
            if (j <= t && t < u.L) { mx = max(mx, Ss[rr * SS + c0 + c] * fx.sc); }
        }
        if (mx > NEG) {
            let mn = max(m, mx);
            var ps = 0.0;
            for (var c = 0u; c < 16u; c++) {
                let j = k0 + c0 + c;
                if (j <= t && t < u.L) { ps += exp(Ss[rr * SS + c0 + c] * fx.sc - mn); }
            }
            l = l * exp(m - mn) + ps;
            m = mn;
        }
    }
    workgroupBarrier();
    Ss[tid] = m;             // the row's other half's statistics
    Ss[128u + tid] = l;
    workgroupBarrier();
    let mo = Ss[tid ^ 1u];
    let lo = Ss[128u + (tid ^ 1u)];
    let mm = max(m, mo);
    var lse = 0.0;
    if (t < u.L) {
        lse = mm + log(l * exp(m - mm) + lo * exp(mo - mm));
        if (c0 == 0u) { out2[u.o2 + (base + t) * u.Hq + h] = lse; }
    }
    var o: RM;
    for (var k0 = 0u; k0 < kend; k0 += KB) {
        let ko = (base + k0) * u.ldk + g * D;
        stage(KW, u.ok + ko, VW, u.ov + ko, u.ldk, tid);   // (its first barrier: Ss read above)
        put_scores(sg, dots_staged(&a, 0u, 0u), dots_staged(&a, 0u, 16u));
        workgroupBarrier();
        for (var c = 0u; c < 16u; c++) {
            let j = k0 + c0 + c;
            var p = 0.0;
            if (j <= t && t < u.L) { p = exp(Ss[rr * SS + c0 + c] * fx.sc - lse); }
            Ps[rr * HP + c0 + c] = f16(p);
        }
        workgroupBarrier();
        accum_staged(&o, sg, 1u);
    }
    store_rows(&o, fx.o, 0u, sg, tid, base, t0, u.L, u.o1 + h * D, u.ldq);
}

// ---------------------------------------------------------------- backward
// ds of an element, f16 and scaled (the header): p (dP_raw - delta 2^(edo + ev)) 2^-cexp
fn ds16(p: f32, dpraw: f32, dl: f32) -> f16 {
    return f16(p * (dpraw - dl) * f16_pow2(-U.cexp));
}

// dq (out1, [M, ldq]) of 64 query rows of one (b, h)
@compute @workgroup_size(128)
fn attention_sg_dq(@builtin(local_invocation_index) tid: u32, @builtin(workgroup_id) wid: vec3<u32>,
                   @builtin(num_workgroups) nwg: vec3<u32>, @builtin(subgroup_id) sg: u32) {
    let u = U;
    let w = wid.x + wid.y * nwg.x;
    if (w >= u.B * u.Hq * u.nqb) { return; }
    let qb = query_block(u, w);
    let t0 = qb.x;
    let h = qb.y;
    let g = qb.w;
    let base = qb.z * u.L;
    let fx = factors(u);
    let rows = (base + t0) * u.ldq + h * D;
    var a = held_rows(QW, u.oq + rows, u.ldq, sg, tid);
    var gd = held_rows(DOW, u.odo + rows, u.ldq, sg, tid);
    let rr = tid / 2u;
    let c0 = (tid % 2u) * 16u;
    let t = t0 + rr;
    var lse = 0.0;
    var dl = 0.0;
    if (t < u.L) {
        lse = st1[u.os1 + (base + t) * u.Hq + h];
        dl = st2[u.os2 + (base + t) * u.Hq + h] * fx.dl;
    }
    let kend = min(u.L, t0 + 64u);
    var dq: RM;
    for (var k0 = 0u; k0 < kend; k0 += KB) {
        let ko = (base + k0) * u.ldk + g * D;
        stage(KW, u.ok + ko, VW, u.ov + ko, u.ldk, tid);   // k, v
        let dp0 = dots_staged(&gd, 1u, 0u);
        let dp1 = dots_staged(&gd, 1u, 16u);
        put_scores(sg, dots_staged(&a, 0u, 0u), dots_staged(&a, 0u, 16u));
        workgroupBarrier();
        var p: array<f32, 16>;
        for (var c = 0u; c < 16u; c++) {
            let j = k0 + c0 + c;
            p[c] = 0.0;
            if (j <= t && t < u.L) { p[c] = exp(Ss[rr * SS + c0 + c] * fx.sc - lse); }
        }
        workgroupBarrier();
        put_scores(sg, dp0, dp1);
        workgroupBarrier();
        for (var c = 0u; c < 16u; c++) {
            Ps[rr * HP + c0 + c] = ds16(p[c], Ss[rr * SS + c0 + c], dl);
        }
        workgroupBarrier();
        accum_staged(&dq, sg, 0u);
    }
    store_rows(&dq, fx.dq, 0u, sg, tid, base, t0, u.L, u.o1 + h * D, u.ldq);
}

// dk (out1) and dv (out2) of 64 keys of one (b, query head h): its share of its kv head g's
// gradients (the sum over every query row at or after each key), written to part r = h % REP
// of out1 and out2 ([REP, M, ldk] each; with REP 1 dk and dv themselves), which attention.wgsl's
// attention_sum_parts adds up.  A workgroup per kv head walking its REP query heads in turn
// (REP times fewer workgroups) ran 1.07-1.12x this one's time on the H100
// (benchmarks/results/h100/attention_sgmat/)
@compute @workgroup_size(128)
fn attention_sg_dkv(@builtin(local_invocation_index) tid: u32, @builtin(workgroup_id) wid: vec3<u32>,
                    @builtin(num_workgroups) nwg: vec3<u32>, @builtin(subgroup_id) sg: u32) {
    let u = U;
    let w = wid.x + wid.y * nwg.x;
    if (w >= u.B * u.Hq * u.nkb) { return; }
    let kb = w % u.nkb;                 // the first keys (the most query rows) first
    let h = (w / u.nkb) % u.Hq;
    let b = w / (u.nkb * u.Hq);
    let g = h / u.REP;
    let part = (h % u.REP) * u.B * u.L * u.ldk;   // the part's offset in out1 and out2
    let k0 = kb * 64u;
    let base = b * u.L;
    let fx = factors(u);
    let keys = (base + k0) * u.ldk + g * D;
    var ak = held_rows(KW, u.ok + keys, u.ldk, sg, tid);
    var av = held_rows(VW, u.ov + keys, u.ldk, sg, tid);
    let rr = tid / 2u;          // this invocation's key of the block and its 16 query columns
    let c0 = (tid % 2u) * 16u;
    let j = k0 + rr;
    let dlf = fx.dl;
    var dk: RM;
    var dv: RM;
    for (var i0 = k0; i0 < u.L; i0 += KB) {
        let qo = (base + i0) * u.ldq + h * D;
        stage(QW, u.oq + qo, DOW, u.odo + qo, u.ldq, tid);   // q, dO
        let dp0 = dots_staged(&av, 1u, 0u);
        let dp1 = dots_staged(&av, 1u, 16u);
        put_scores(sg, dots_staged(&ak, 0u, 0u), dots_staged(&ak, 0u, 16u));
        if (tid < KB) {
            var x = 0.0;
            var y = 0.0;
            if (i0 + tid < u.L) {
                x = st1[u.os1 + (base + i0 + tid) * u.Hq + h];
                y = st2[u.os2 + (base + i0 + tid) * u.Hq + h] * dlf;
            }
            Rs[tid] = x;
            Rs[KB + tid] = y;
        }
        workgroupBarrier();
        var p: array<f32, 16>;
        for (var c = 0u; c < 16u; c++) {
            let t = i0 + c0 + c;
            p[c] = 0.0;
            if (j <= t && t < u.L) { p[c] = exp(Ss[rr * SS + c0 + c] * fx.sc - Rs[c0 + c]); }
            Ps[rr * HP + c0 + c] = f16(p[c]);
        }
        workgroupBarrier();
        put_scores(sg, dp0, dp1);        // dP^T over the scores (read above)
        accum_staged(&dv, sg, 1u);       // dv += p^T dO
        workgroupBarrier();
        for (var c = 0u; c < 16u; c++) {  // p over ds (read above)
            Ps[rr * HP + c0 + c] = ds16(p[c], Ss[rr * SS + c0 + c], Rs[KB + c0 + c]);
        }
        workgroupBarrier();
        accum_staged(&dk, sg, 0u);       // dk += ds^T q
    }
    store_rows(&dv, fx.dv, 1u, sg, tid, base, k0, u.L, u.o2 + part + g * D, u.ldk);
    store_rows(&dk, fx.dk, 0u, sg, tid, base, k0, u.L, u.o1 + part + g * D, u.ldk);
}
