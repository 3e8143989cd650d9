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
// least 64 rows of zeros past its last row, so that a block's 16 x 16 matrices load straight
// from storage without bounds (rows past a sequence read the next one's, finite, and are
// masked).  A workgroup is 4 subgroups of 32 (128 invocations); subgroup sg takes 16 rows of
// a 64-row block (query rows: forward, dq; keys: dk, dv) as D / 16 left matrices held in
// registers, and walks the other side in blocks of KB = 32, below the causal diagonal only:
// per block its 16 x 32 scores (two results) go through workgroup memory, where invocation
// tid takes row tid / 2 of the 64 and 16 of its 32 columns (the mask, the softmax's terms,
// f16 probabilities for the next product), then the subgroup multiplies them into its D / 16
// accumulators (named fields: no private arrays of matrices).
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

@group(0) @binding(0) var<storage, read> q16: array<f16>;
@group(0) @binding(1) var<storage, read> k16: array<f16>;
@group(0) @binding(2) var<storage, read> v16: array<f16>;
@group(0) @binding(3) var<storage, read> do16: array<f16>;
@group(0) @binding(4) var<storage, read_write> out1: array<f32>;   // o; dq; dk
@group(0) @binding(5) var<storage, read_write> out2: array<f32>;   // lse; -; dv
@group(0) @binding(6) var<storage, read> st1: array<f32>;          // lse (backward)
@group(0) @binding(7) var<storage, read> st2: array<f32>;          // delta (backward)
@group(0) @binding(8) var<storage, read> f16_exps: array<i32>;
@group(0) @binding(9) var<uniform> U: SA;

override D16: u32 = 4u;        // head_dim / 16 (1 .. 8)
override D: u32 = 16u * D16;   // head_dim
const KB: u32 = 32u;           // keys (query rows) a block of the walk
const SS: u32 = KB + 4u;       // a row of the f32 patches (16 bytes of padding: a row's two halves,
                               // which adjacent invocations read, fall in different banks)
const HP: u32 = KB + 8u;       // a row of the f16 patches (16 bytes of padding)
const NEG: f32 = -3.0e38;
const QW: u32 = 0u;            // the operands, for left_of / right_t / right_n
const KW: u32 = 1u;
const VW: u32 = 2u;
const DOW: u32 = 3u;

var<workgroup> Ss: array<f32, 2304>;   // [64][SS] scores (transposed in dk/dv); the stores' patches
var<workgroup> Ds: array<f32, 2304>;   // [64][SS] dO . v (the backward)
var<workgroup> Ps: array<f16, 2560>;   // [64][HP] p
var<workgroup> Gs: array<f16, 2560>;   // [64][HP] ds (scaled)
var<workgroup> Rs: array<f32, 256>;    // row statistics

struct LM { m0: subgroup_matrix_left<f16, 16, 16>, m1: subgroup_matrix_left<f16, 16, 16>,
            m2: subgroup_matrix_left<f16, 16, 16>, m3: subgroup_matrix_left<f16, 16, 16>,
            m4: subgroup_matrix_left<f16, 16, 16>, m5: subgroup_matrix_left<f16, 16, 16>,
            m6: subgroup_matrix_left<f16, 16, 16>, m7: subgroup_matrix_left<f16, 16, 16> }
struct RM { r0: subgroup_matrix_result<f32, 16, 16>, r1: subgroup_matrix_result<f32, 16, 16>,
            r2: subgroup_matrix_result<f32, 16, 16>, r3: subgroup_matrix_result<f32, 16, 16>,
            r4: subgroup_matrix_result<f32, 16, 16>, r5: subgroup_matrix_result<f32, 16, 16>,
            r6: subgroup_matrix_result<f32, 16, 16>, r7: subgroup_matrix_result<f32, 16, 16> }

fn left_of(w: u32, off: u32, ld: u32) -> subgroup_matrix_left<f16, 16, 16> {
    switch w {
        case 0u: { return subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>>(&q16, off, false, ld); }
        case 1u: { return subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>>(&k16, off, false, ld); }
        case 2u: { return subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>>(&v16, off, false, ld); }
        default: { return subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>>(&do16, off, false, ld); }
    }
}

// 16 x 16 of operand w as a right matrix: its rows' elements are the matrix's columns (k^T and
// the like; right_t) or its rows are the matrix's rows (right_n); col_major must be a constant
fn right_t(w: u32, off: u32, ld: u32) -> subgroup_matrix_right<f16, 16, 16> {
    switch w {
        case 0u: { return subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>>(&q16, off, true, ld); }
        case 1u: { return subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>>(&k16, off, true, ld); }
        case 2u: { return subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>>(&v16, off, true, ld); }
        default: { return subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>>(&do16, off, true, ld); }
    }
}

fn right_n(w: u32, off: u32, ld: u32) -> subgroup_matrix_right<f16, 16, 16> {
    switch w {
        case 0u: { return subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>>(&q16, off, false, ld); }
        case 1u: { return subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>>(&k16, off, false, ld); }
        case 2u: { return subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>>(&v16, off, false, ld); }
        default: { return subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>>(&do16, off, false, ld); }
    }
}

// 16 rows of operand w from element off (rows ld apart), all D columns: D16 left matrices
fn rows_left(w: u32, off: u32, ld: u32) -> LM {
    var a: LM;
    a.m0 = left_of(w, off, ld);
    if (D16 > 1u) { a.m1 = left_of(w, off + 16u, ld); }
    if (D16 > 2u) { a.m2 = left_of(w, off + 32u, ld); }
    if (D16 > 3u) { a.m3 = left_of(w, off + 48u, ld); }
    if (D16 > 4u) { a.m4 = left_of(w, off + 64u, ld); }
    if (D16 > 5u) { a.m5 = left_of(w, off + 80u, ld); }
    if (D16 > 6u) { a.m6 = left_of(w, off + 96u, ld); }
    if (D16 > 7u) { a.m7 = left_of(w, off + 112u, ld); }
    return a;
}

// a (16 rows) . (16 rows of operand w from off)^T, summed over D: one 16 x 16 result
fn dots(a: ptr<function, LM>, w: u32, off: u32, ld: u32) -> subgroup_matrix_result<f32, 16, 16> {
    var r: subgroup_matrix_result<f32, 16, 16>;
    r = subgroupMatrixMultiplyAccumulate((*a).m0, right_t(w, off, ld), r);
    if (D16 > 1u) { r = subgroupMatrixMultiplyAccumulate((*a).m1, right_t(w, off + 16u, ld), r); }
    if (D16 > 2u) { r = subgroupMatrixMultiplyAccumulate((*a).m2, right_t(w, off + 32u, ld), r); }
    if (D16 > 3u) { r = subgroupMatrixMultiplyAccumulate((*a).m3, right_t(w, off + 48u, ld), r); }
    if (D16 > 4u) { r = subgroupMatrixMultiplyAccumulate((*a).m4, right_t(w, off + 64u, ld), r); }
    if (D16 > 5u) { r = subgroupMatrixMultiplyAccumulate((*a).m5, right_t(w, off + 80u, ld), r); }
    if (D16 > 6u) { r = subgroupMatrixMultiplyAccumulate((*a).m6, right_t(w, off + 96u, ld), r); }
    if (D16 > 7u) { r = subgroupMatrixMultiplyAccumulate((*a).m7, right_t(w, off + 112u, ld), r); }
    return r;
}

// a block's two 16 x 16 score matrices of the subgroup (rows sg*16..) into workgroup memory
fn put_scores(dst: u32, sg: u32, s0: subgroup_matrix_result<f32, 16, 16>, s1: subgroup_matrix_result<f32, 16, 16>) {
    if (dst == 0u) {
        subgroupMatrixStore(&Ss, sg * 16u * SS, s0, false, SS);
        subgroupMatrixStore(&Ss, sg * 16u * SS + 16u, s1, false, SS);
    } else {
        subgroupMatrixStore(&Ds, sg * 16u * SS, s0, false, SS);
        subgroupMatrixStore(&Ds, sg * 16u * SS + 16u, s1, false, SS);
    }
}

fn patch_left(src: u32, off: u32) -> subgroup_matrix_left<f16, 16, 16> {
    if (src == 0u) { return subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>>(&Ps, off, false, HP); }
    return subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>>(&Gs, off, false, HP);
}

// acc += (the subgroup's 16 x KB patch of Ps (src 0) or Gs (1)) . (KB rows of operand w from
// off, all D columns)
fn accum(acc: ptr<function, RM>, src: u32, sg: u32, w: u32, off: u32, ld: u32) {
    for (var c = 0u; c < KB / 16u; c++) {
        let p = patch_left(src, sg * 16u * HP + c * 16u);
        let o = off + c * 16u * ld;
        (*acc).r0 = subgroupMatrixMultiplyAccumulate(p, right_n(w, o, ld), (*acc).r0);
        if (D16 > 1u) { (*acc).r1 = subgroupMatrixMultiplyAccumulate(p, right_n(w, o + 16u, ld), (*acc).r1); }
        if (D16 > 2u) { (*acc).r2 = subgroupMatrixMultiplyAccumulate(p, right_n(w, o + 32u, ld), (*acc).r2); }
        if (D16 > 3u) { (*acc).r3 = subgroupMatrixMultiplyAccumulate(p, right_n(w, o + 48u, ld), (*acc).r3); }
        if (D16 > 4u) { (*acc).r4 = subgroupMatrixMultiplyAccumulate(p, right_n(w, o + 64u, ld), (*acc).r4); }
        if (D16 > 5u) { (*acc).r5 = subgroupMatrixMultiplyAccumulate(p, right_n(w, o + 80u, ld), (*acc).r5); }
        if (D16 > 6u) { (*acc).r6 = subgroupMatrixMultiplyAccumulate(p, right_n(w, o + 96u, ld), (*acc).r6); }
        if (D16 > 7u) { (*acc).r7 = subgroupMatrixMultiplyAccumulate(p, right_n(w, o + 112u, ld), (*acc).r7); }
    }
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
// o (out1, [M, ldq]) and lse (out2, [M, Hq]) of 64 query rows of one (b, h)
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
    var a = rows_left(QW, u.oq + (base + t0 + sg * 16u) * u.ldq + h * D, u.ldq);
    let rr = tid / 2u;          // this invocation's row of the block and its 16 columns
    let c0 = (tid % 2u) * 16u;
    let t = t0 + rr;
    let kend = min(u.L, t0 + 64u);
    // 1. each row's max and sum (this invocation's half of the row)
    var m = NEG;
    var l = 0.0;
    for (var k0 = 0u; k0 < kend; k0 += KB) {
        let ko = u.ok + (base + k0) * u.ldk + g * D;
        put_scores(0u, sg, dots(&a, KW, ko, u.ldk), dots(&a, KW, ko + 16u * u.ldk, u.ldk));
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
        workgroupBarrier();
    }
    Rs[tid] = m;
    Rs[128u + tid] = l;
    workgroupBarrier();
    let mo = Rs[tid ^ 1u];
    let lo = Rs[128u + (tid ^ 1u)];
    let mm = max(m, mo);
    var lse = 0.0;
    if (t < u.L) {
        lse = mm + log(l * exp(m - mm) + lo * exp(mo - mm));
        if (c0 == 0u) { out2[u.o2 + (base + t) * u.Hq + h] = lse; }
    }
    // 2. o = sum_j exp(s - lse) v_j
    var o: RM;
    for (var k0 = 0u; k0 < kend; k0 += KB) {
        let ko = u.ok + (base + k0) * u.ldk + g * D;
        put_scores(0u, sg, dots(&a, KW, ko, u.ldk), dots(&a, KW, ko + 16u * u.ldk, u.ldk));
        workgroupBarrier();
        for (var c = 0u; c < 16u; c++) {
            let j = k0 + c0 + c;
            var p = 0.0;
            if (j <= t && t < u.L) { p = exp(Ss[rr * SS + c0 + c] * fx.sc - lse); }
            Ps[rr * HP + c0 + c] = f16(p);
        }
        workgroupBarrier();
        accum(&o, 0u, sg, VW, u.ov + (base + k0) * u.ldk + g * D, u.ldk);
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
    let rows = (base + t0 + sg * 16u) * u.ldq + h * D;
    var a = rows_left(QW, u.oq + rows, u.ldq);
    var gd = rows_left(DOW, u.odo + rows, u.ldq);
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
        let ko = u.ok + (base + k0) * u.ldk + g * D;
        let vo = u.ov + (base + k0) * u.ldk + g * D;
        put_scores(0u, sg, dots(&a, KW, ko, u.ldk), dots(&a, KW, ko + 16u * u.ldk, u.ldk));
        put_scores(1u, sg, dots(&gd, VW, vo, u.ldk), dots(&gd, VW, vo + 16u * u.ldk, u.ldk));
        workgroupBarrier();
        for (var c = 0u; c < 16u; c++) {
            let j = k0 + c0 + c;
            let e = rr * SS + c0 + c;
            var p = 0.0;
            if (j <= t && t < u.L) { p = exp(Ss[e] * fx.sc - lse); }
            Gs[rr * HP + c0 + c] = ds16(p, Ds[e], dl);
        }
        workgroupBarrier();
        accum(&dq, 1u, sg, KW, ko, u.ldk);
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
    let keys = (base + k0 + sg * 16u) * u.ldk + g * D;
    var ak = rows_left(KW, u.ok + keys, u.ldk);
    var av = rows_left(VW, u.ov + keys, u.ldk);
    let rr = tid / 2u;          // this invocation's key of the block and its 16 query columns
    let c0 = (tid % 2u) * 16u;
    let j = k0 + rr;
    let dlf = fx.dl;
    var dk: RM;
    var dv: RM;
    for (var i0 = k0; i0 < u.L; i0 += KB) {
        let qo = u.oq + (base + i0) * u.ldq + h * D;
        let go = u.odo + (base + i0) * u.ldq + h * D;
        put_scores(0u, sg, dots(&ak, QW, qo, u.ldq), dots(&ak, QW, qo + 16u * u.ldq, u.ldq));
        put_scores(1u, sg, dots(&av, DOW, go, u.ldq), dots(&av, DOW, go + 16u * u.ldq, u.ldq));
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
        for (var c = 0u; c < 16u; c++) {
            let t = i0 + c0 + c;
            let e = rr * SS + c0 + c;
            var p = 0.0;
            if (j <= t && t < u.L) { p = exp(Ss[e] * fx.sc - Rs[c0 + c]); }
            Ps[rr * HP + c0 + c] = f16(p);
            Gs[rr * HP + c0 + c] = ds16(p, Ds[e], Rs[KB + c0 + c]);
        }
        workgroupBarrier();
        accum(&dv, 0u, sg, DOW, go, u.ldq);
        accum(&dk, 1u, sg, QW, qo, u.ldq);
    }
    store_rows(&dv, fx.dv, 1u, sg, tid, base, k0, u.L, u.o2 + part + g * D, u.ldk);
    store_rows(&dk, fx.dk, 0u, sg, tid, base, k0, u.L, u.o1 + part + g * D, u.ldk);
}
