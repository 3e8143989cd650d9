// requires: matmul_params
enable f16;
enable subgroups;
enable chromium_experimental_subgroup_matrix;
diagnostic(off, chromium_experimental.subgroup_matrix_uniformity);
// matmul_sgmat: matmul_f16's product on subgroup matrices (tensor cores from WGSL: Dawn's
// chromium_experimental_subgroup_matrix, f16 x f16 -> f32 at 16x16x16), for --precision
// mixed on adapters that have them (Runtime.has_subgroup_matrix).
//
// C[M, N] (f32) (+)= op(A) @ op(B) (+ bias, f32), A and B f16 in memory; the same uniform
// block, flags and split-K slices as matmul_fast / matmul_f16 (shaders/matmul_params.wgsl:
// FastParams, k_slice, UNSCALE), the same layout conditions (offsets, leading dimensions,
// N and K multiples of 4; M too when A is transposed).
//
// A workgroup of WM x WN = 2 x 2 subgroups (WG = 128 invocations: subgroups are 32 wide)
// makes a BM x BN = 128 x 128 tile of C (engine/kernels/matmul.py `SGMAT_TILE`); a subgroup
// makes a 64 x 64 part as 4 x 4 result matrices of 16 x 16, named accumulators (no private
// arrays: see DEVELOPERS.md). K advances in tiles of BK = 32 staged through workgroup
// memory with vec4 loads (16-byte words in interior tiles), zeros outside the matrices (so
// any M, N, K the layout allows), the next tile's loads held in registers while the current
// one multiplies. Each tile
// keeps its operand's layout in memory (K-contiguous or M/N-contiguous rows), and
// subgroupMatrixLoad reads it row- or column-major accordingly; the rows are padded by 8
// halves (16 bytes), so that the eight 16-byte rows a matrix load reads at once fall in
// different banks. Measured on an H100 (benchmarks/results/h100/sgmat_tune/README.md),
// against the 128 x 128 tile of 2 x 4 results a subgroup this kernel had before: the subgroup's
// 64 x 64 part 1.4-2.9x; the padding alone 1.7-2.1x where B is stored [K, N] but 0.8x where it
// is stored [N, K]; double-buffered staging slower in every layout. Interior tiles take a
// path without bounds checks whose offsets are fixed outside the K loop (interior_tiles):
// 1.34-1.44x on the weight gradients (A transposed), 1.00-1.11x elsewhere, the step's products
// 143 -> 110 ms (benchmarks/results/h100/sgmat_interior/README.md). Workgroups of 4 subgroups
// (128 x 128) against 8 (128 x 256 or 256 x 128), the same 64 x 64 part a subgroup: 1.00-1.12x
// on the step's products (two share an SM, where the registers allow one of 8 subgroups, so
// one's barriers overlap the other's products; benchmarks/results/h100/sgmat_wg128/README.md).
//
// The epilogue: a whole tile without bias (or a split-K slice) stores its results straight
// from the subgroup matrices, unscaled (subgroupMatrixScalarMultiply by the two factors
// store_c multiplies by); where it accumulates into C, its results start as C's blocks scaled
// up by the operands' 2^(ea + eb) (sg_preload). Other tiles go through a 16 x 16 patch of
// workgroup memory per subgroup to store_c (bias, the old C, the edges guarded).

@group(0) @binding(0) var<storage, read_write> C1: array<f32>;
@group(0) @binding(1) var<storage, read> A4: array<vec4<f16>>;
@group(0) @binding(2) var<storage, read> B4: array<vec4<f16>>;
@group(0) @binding(3) var<storage, read> bias1: array<f32>;
@group(0) @binding(4) var<uniform> F: FastParams;
// the operands' scale table (F16Scales): exponents first, A's at F.sa, B's at F.sb
@group(0) @binding(5) var<storage, read> f16_exps: array<i32>;

// the operands' layouts (flags bits 2 and 3 as matmul_fast's TA, TB) as pipeline constants,
// so that the driver compiles one load path per operand and layout
override TA: u32 = 0u;
override TB: u32 = 0u;
const WM: u32 = 2u;   // subgroups down the tile and across it (an invocation stages 16 / WN
const WN: u32 = 2u;   // vec4 of A's tile and 16 / WM of B's: WM, WN >= 2)
const BM: u32 = WM * 64u;
const BN: u32 = WN * 64u;
const WG: u32 = WM * WN * 32u;   // invocations a workgroup
const BK: u32 = 32u;
const PAD: u32 = 8u;
// a tile of BM rows of BK + PAD (or BK rows of BM + PAD), B's likewise (constant sizes:
// subgroupMatrixLoad takes no array sized by a pipeline constant); a 16 x 16 result patch
// per subgroup
const A_HALVES: u32 = max(BM * (BK + PAD), BK * (BM + PAD));
const B_HALVES: u32 = max(BN * (BK + PAD), BK * (BN + PAD));
var<workgroup> As: array<f16, A_HALVES>;
var<workgroup> Bs: array<f16, B_HALVES>;
var<workgroup> Cs: array<f32, WG * 8u>;

// C[r, c..c+3] = acc unscaled (+ bias) (+ C), or the plain partial product of a split-K
// slice (unscaled too: the reduce adds the bias and C); nothing outside C
fn store_c(c_base: u32, r: u32, c: u32, acc: vec4<f32>) {
    if (r >= F.M || c >= F.N) { return; }
    var v = (acc * UNSCALE.x) * UNSCALE.y;
    let i = c_base + r * F.ldc + c;
    if (F.ksplit == 0u) {
        if ((F.flags & 2u) != 0u) {
            v += vec4<f32>(bias1[F.bias_off + c], bias1[F.bias_off + c + 1u],
                           bias1[F.bias_off + c + 2u], bias1[F.bias_off + c + 3u]);
        }
        if ((F.flags & 1u) != 0u) { v += vec4<f32>(C1[i], C1[i + 1u], C1[i + 2u], C1[i + 3u]); }
    }
    C1[i] = v.x; C1[i + 1u] = v.y; C1[i + 2u] = v.z; C1[i + 3u] = v.w;
}

// vec4 e of the A tile at K offset k0, zeros outside A (and past the tile: e >= BM * BK / 4)
fn load_a(k0: u32, k_hi: u32, row0: u32, e: u32) -> vec4<f16> {
    if (e >= BM * BK / 4u) { return vec4<f16>(0.0h); }
    if (TA != 0u) {                         // A^T stored [K, lda]: tile [k][m], BM / 4 vec4 a row
        let k = e / (BM / 4u);
        let mq = e % (BM / 4u);
        if (k0 + k < k_hi && row0 + mq * 4u < F.M) {
            return A4[(F.a_off + (k0 + k) * F.lda + row0 + mq * 4u) / 4u];
        }
    } else {                                // A stored [M, lda]: tile [m][k], BK / 4 vec4 a row
        let m = e / (BK / 4u);
        let kq = e % (BK / 4u);
        if (row0 + m < F.M && k0 + kq * 4u < k_hi) {
            return A4[(F.a_off + (row0 + m) * F.lda + k0 + kq * 4u) / 4u];
        }
    }
    return vec4<f16>(0.0h);
}

// vec4 e of the B tile at K offset k0, zeros outside B (and past the tile)
fn load_b(k0: u32, k_hi: u32, col0: u32, e: u32) -> vec4<f16> {
    if (e >= BN * BK / 4u) { return vec4<f16>(0.0h); }
    if (TB != 0u) {                         // B^T stored [N, ldb]: tile [n][k]
        let n = e / (BK / 4u);
        let kq = e % (BK / 4u);
        if (col0 + n < F.N && k0 + kq * 4u < k_hi) {
            return B4[(F.b_off + (col0 + n) * F.ldb + k0 + kq * 4u) / 4u];
        }
    } else {                                // B stored [K, ldb]: tile [k][n]
        let k = e / (BN / 4u);
        let nq = e % (BN / 4u);
        if (k0 + k < k_hi && col0 + nq * 4u < F.N) {
            return B4[(F.b_off + (k0 + k) * F.ldb + col0 + nq * 4u) / 4u];
        }
    }
    return vec4<f16>(0.0h);
}

// vec4 e of a tile into workgroup memory, its rows padded
fn stage_a(v: vec4<f16>, e: u32) {
    if (e >= BM * BK / 4u) { return; }
    var i = (e / (BK / 4u)) * (BK + PAD) + (e % (BK / 4u)) * 4u;
    if (TA != 0u) { i = (e / (BM / 4u)) * (BM + PAD) + (e % (BM / 4u)) * 4u; }
    As[i] = v.x; As[i + 1u] = v.y; As[i + 2u] = v.z; As[i + 3u] = v.w;
}

fn stage_b(v: vec4<f16>, e: u32) {
    if (e >= BN * BK / 4u) { return; }
    var i = (e / (BN / 4u)) * (BN + PAD) + (e % (BN / 4u)) * 4u;
    if (TB != 0u) { i = (e / (BK / 4u)) * (BK + PAD) + (e % (BK / 4u)) * 4u; }
    Bs[i] = v.x; Bs[i + 1u] = v.y; Bs[i + 2u] = v.z; Bs[i + 3u] = v.w;
}

// Interior tiles (whole in M and N, their K range a multiple of BK, the operands' offsets and
// leading dimensions multiples of 8 halves) take a path without bounds checks whose offsets
// are fixed outside the K loop and whose loads are 16 bytes (8 halves, A8 / B8: the operands
// bound again as vec4<u32>): an invocation's t-th word of an operand's tile lies at g + t * gt
// in memory (g advancing by gk a K tile) and at s + t * st in the staged tile. A tile row
// holds R words (BK / 8 where K is contiguous in memory, else the tile's M or N side / 8);
// WG / R rows apart. A tile is BM * BK / 8 = 4 WG words: 4 of each operand an invocation.
@group(0) @binding(6) var<storage, read> A8: array<vec4<u32>>;
@group(0) @binding(7) var<storage, read> B8: array<vec4<u32>>;

struct Walk { g: u32, gt: u32, gk: u32, s: u32, st: u32 }

// kc: K contiguous in memory ([m][k] of A, [n][k] of B^T); mn: the tile's M or N side;
// rc0: its first row or column in C; off, ld: the operand's offset and leading dimension
fn walk(kc: bool, mn: u32, off: u32, ld: u32, rc0: u32, k_lo: u32, tid: u32) -> Walk {
    let ld8 = ld / 8u;
    if (kc) {
        let r = tid / (BK / 8u);
        let c = tid % (BK / 8u);
        return Walk(off / 8u + (rc0 + r) * ld8 + k_lo / 8u + c, (WG / (BK / 8u)) * ld8, BK / 8u,
                    r * (BK + PAD) + c * 8u, (WG / (BK / 8u)) * (BK + PAD));
    }
    let r = tid / (mn / 8u);
    let c = tid % (mn / 8u);
    return Walk(off / 8u + (k_lo + r) * ld8 + rc0 / 8u + c, (WG / (mn / 8u)) * ld8, BK * ld8,
                r * (mn + PAD) + c * 8u, (WG / (mn / 8u)) * (mn + PAD));
}

// the t-th word (8 halves) into a staged tile
fn put_a(v: vec4<u32>, w: Walk, t: u32) {
    let i = w.s + t * w.st;
    let h0 = bitcast<vec2<f16>>(v.x); let h1 = bitcast<vec2<f16>>(v.y);
    let h2 = bitcast<vec2<f16>>(v.z); let h3 = bitcast<vec2<f16>>(v.w);
    As[i] = h0.x; As[i + 1u] = h0.y; As[i + 2u] = h1.x; As[i + 3u] = h1.y;
    As[i + 4u] = h2.x; As[i + 5u] = h2.y; As[i + 6u] = h3.x; As[i + 7u] = h3.y;
}

fn put_b(v: vec4<u32>, w: Walk, t: u32) {
    let i = w.s + t * w.st;
    let h0 = bitcast<vec2<f16>>(v.x); let h1 = bitcast<vec2<f16>>(v.y);
    let h2 = bitcast<vec2<f16>>(v.z); let h3 = bitcast<vec2<f16>>(v.w);
    Bs[i] = h0.x; Bs[i + 1u] = h0.y; Bs[i + 2u] = h1.x; Bs[i + 3u] = h1.y;
    Bs[i + 4u] = h2.x; Bs[i + 5u] = h2.y; Bs[i + 6u] = h3.x; Bs[i + 7u] = h3.y;
}

// the left matrix of rows m0..m0+15 of the tile and K steps kk..kk+15
fn sg_left(m0: u32, kk: u32) -> subgroup_matrix_left<f16, 16, 16> {
    if (TA != 0u) {   // [k][m]: column-major
        return subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>>(&As, kk * (BM + PAD) + m0, true, BM + PAD);
    }
    return subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>>(&As, m0 * (BK + PAD) + kk, false, BK + PAD);
}

// the right matrix of K steps kk..kk+15 and columns n0..n0+15 of the tile
fn sg_right(n0: u32, kk: u32) -> subgroup_matrix_right<f16, 16, 16> {
    if (TB != 0u) {   // [n][k]: column-major
        return subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>>(&Bs, n0 * (BK + PAD) + kk, true, BK + PAD);
    }
    return subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>>(&Bs, kk * (BN + PAD) + n0, false, BN + PAD);
}

struct SgAcc {
    c00: subgroup_matrix_result<f32, 16, 16>, c01: subgroup_matrix_result<f32, 16, 16>,
    c02: subgroup_matrix_result<f32, 16, 16>, c03: subgroup_matrix_result<f32, 16, 16>,
    c10: subgroup_matrix_result<f32, 16, 16>, c11: subgroup_matrix_result<f32, 16, 16>,
    c12: subgroup_matrix_result<f32, 16, 16>, c13: subgroup_matrix_result<f32, 16, 16>,
    c20: subgroup_matrix_result<f32, 16, 16>, c21: subgroup_matrix_result<f32, 16, 16>,
    c22: subgroup_matrix_result<f32, 16, 16>, c23: subgroup_matrix_result<f32, 16, 16>,
    c30: subgroup_matrix_result<f32, 16, 16>, c31: subgroup_matrix_result<f32, 16, 16>,
    c32: subgroup_matrix_result<f32, 16, 16>, c33: subgroup_matrix_result<f32, 16, 16>,
}

// 16 K steps from kk of the staged tiles into the subgroup's 4 x 4 results
fn sg_step(acc: ptr<function, SgAcc>, sm: u32, sn: u32, kk: u32) {
    let a0 = sg_left(sm, kk);
    let a1 = sg_left(sm + 16u, kk);
    let a2 = sg_left(sm + 32u, kk);
    let a3 = sg_left(sm + 48u, kk);
    var b = sg_right(sn + 0u, kk);
    (*acc).c00 = subgroupMatrixMultiplyAccumulate(a0, b, (*acc).c00);
    (*acc).c10 = subgroupMatrixMultiplyAccumulate(a1, b, (*acc).c10);
    (*acc).c20 = subgroupMatrixMultiplyAccumulate(a2, b, (*acc).c20);
    (*acc).c30 = subgroupMatrixMultiplyAccumulate(a3, b, (*acc).c30);
    b = sg_right(sn + 16u, kk);
    (*acc).c01 = subgroupMatrixMultiplyAccumulate(a0, b, (*acc).c01);
    (*acc).c11 = subgroupMatrixMultiplyAccumulate(a1, b, (*acc).c11);
    (*acc).c21 = subgroupMatrixMultiplyAccumulate(a2, b, (*acc).c21);
    (*acc).c31 = subgroupMatrixMultiplyAccumulate(a3, b, (*acc).c31);
    b = sg_right(sn + 32u, kk);
    (*acc).c02 = subgroupMatrixMultiplyAccumulate(a0, b, (*acc).c02);
    (*acc).c12 = subgroupMatrixMultiplyAccumulate(a1, b, (*acc).c12);
    (*acc).c22 = subgroupMatrixMultiplyAccumulate(a2, b, (*acc).c22);
    (*acc).c32 = subgroupMatrixMultiplyAccumulate(a3, b, (*acc).c32);
    b = sg_right(sn + 48u, kk);
    (*acc).c03 = subgroupMatrixMultiplyAccumulate(a0, b, (*acc).c03);
    (*acc).c13 = subgroupMatrixMultiplyAccumulate(a1, b, (*acc).c13);
    (*acc).c23 = subgroupMatrixMultiplyAccumulate(a2, b, (*acc).c23);
    (*acc).c33 = subgroupMatrixMultiplyAccumulate(a3, b, (*acc).c33);
}

// the K loop of an interior tile: the same staging and products as the guarded loop in
// matmul_sgmat, its loads and stores at the walk's offsets
fn interior_tiles(acc: ptr<function, SgAcc>, tid: u32, row0: u32, col0: u32, sm: u32, sn: u32,
                  k_lo: u32, k_hi: u32) {
    var wa = walk(TA == 0u, BM, F.a_off, F.lda, row0, k_lo, tid);
    var wb = walk(TB != 0u, BN, F.b_off, F.ldb, col0, k_lo, tid);
    var va0 = A8[wa.g]; var va1 = A8[wa.g + wa.gt]; var va2 = A8[wa.g + 2u * wa.gt]; var va3 = A8[wa.g + 3u * wa.gt];
    var vb0 = B8[wb.g]; var vb1 = B8[wb.g + wb.gt]; var vb2 = B8[wb.g + 2u * wb.gt]; var vb3 = B8[wb.g + 3u * wb.gt];
    for (var k0 = k_lo; k0 < k_hi; k0 += BK) {
        put_a(va0, wa, 0u); put_a(va1, wa, 1u); put_a(va2, wa, 2u); put_a(va3, wa, 3u);
        put_b(vb0, wb, 0u); put_b(vb1, wb, 1u); put_b(vb2, wb, 2u); put_b(vb3, wb, 3u);
        workgroupBarrier();
        if (k0 + BK < k_hi) {
            wa.g += wa.gk;
            wb.g += wb.gk;
            va0 = A8[wa.g]; va1 = A8[wa.g + wa.gt]; va2 = A8[wa.g + 2u * wa.gt]; va3 = A8[wa.g + 3u * wa.gt];
            vb0 = B8[wb.g]; vb1 = B8[wb.g + wb.gt]; vb2 = B8[wb.g + 2u * wb.gt]; vb3 = B8[wb.g + 3u * wb.gt];
        }
        sg_step(acc, sm, sn, 0u);
        sg_step(acc, sm, sn, 16u);
        workgroupBarrier();
    }
}

// the results' start where a whole tile accumulates into C without bias (flags 1) and K whole:
// C's 16 x 16 blocks times 2^(ea + eb) (p), so that the direct stores' unscaling gives C plus
// the product (PRELOAD_EXP: 2^s exact and C * 2^s short of overflow unless |C| >= 2^64)
const PRELOAD_EXP_MIN: i32 = -32;
const PRELOAD_EXP_MAX: i32 = 64;

fn sg_c(p: f32, c_base: u32, r0: u32, q0: u32) -> subgroup_matrix_result<f32, 16, 16> {
    let m = subgroupMatrixLoad<subgroup_matrix_result<f32, 16, 16>>(&C1, c_base + r0 * F.ldc + q0, false, F.ldc);
    return subgroupMatrixScalarMultiply(m, p);
}

fn sg_preload(acc: ptr<function, SgAcc>, p: f32, c_base: u32, r0: u32, q0: u32) {
    (*acc).c00 = sg_c(p, c_base, r0 + 0u, q0 + 0u);
    (*acc).c01 = sg_c(p, c_base, r0 + 0u, q0 + 16u);
    (*acc).c02 = sg_c(p, c_base, r0 + 0u, q0 + 32u);
    (*acc).c03 = sg_c(p, c_base, r0 + 0u, q0 + 48u);
    (*acc).c10 = sg_c(p, c_base, r0 + 16u, q0 + 0u);
    (*acc).c11 = sg_c(p, c_base, r0 + 16u, q0 + 16u);
    (*acc).c12 = sg_c(p, c_base, r0 + 16u, q0 + 32u);
    (*acc).c13 = sg_c(p, c_base, r0 + 16u, q0 + 48u);
    (*acc).c20 = sg_c(p, c_base, r0 + 32u, q0 + 0u);
    (*acc).c21 = sg_c(p, c_base, r0 + 32u, q0 + 16u);
    (*acc).c22 = sg_c(p, c_base, r0 + 32u, q0 + 32u);
    (*acc).c23 = sg_c(p, c_base, r0 + 32u, q0 + 48u);
    (*acc).c30 = sg_c(p, c_base, r0 + 48u, q0 + 0u);
    (*acc).c31 = sg_c(p, c_base, r0 + 48u, q0 + 16u);
    (*acc).c32 = sg_c(p, c_base, r0 + 48u, q0 + 32u);
    (*acc).c33 = sg_c(p, c_base, r0 + 48u, q0 + 48u);
}

// one 16 x 16 result at C rows r0.., columns q0..: stored whole, unscaled by us (uniform:
// the scalar matrix operations want it so)
fn sg_direct(m: subgroup_matrix_result<f32, 16, 16>, us: vec2<f32>, c_base: u32, r0: u32, q0: u32) {
    let v = subgroupMatrixScalarMultiply(subgroupMatrixScalarMultiply(m, us.x), us.y);
    subgroupMatrixStore(&C1, c_base + r0 * F.ldc + q0, v, false, F.ldc);
}

// one 16 x 16 result at C rows r0.., columns q0..: through the subgroup's patch of Cs
fn sg_patch(m: subgroup_matrix_result<f32, 16, 16>, sg: u32, lane: u32, lanes: u32,
            c_base: u32, r0: u32, q0: u32) {
    subgroupMatrixStore(&Cs, sg * 256u, m, false, 16u);
    workgroupBarrier();
    for (var e = lane; e < 64u; e += lanes) {
        let r = e / 4u;
        let q = (e % 4u) * 4u;
        let o = sg * 256u + r * 16u + q;
        store_c(c_base, r0 + r, q0 + q, vec4<f32>(Cs[o], Cs[o + 1u], Cs[o + 2u], Cs[o + 3u]));
    }
    workgroupBarrier();
}

@compute @workgroup_size(WG)
fn matmul_sgmat(@builtin(local_invocation_index) tid: u32,
                @builtin(workgroup_id) wid: vec3<u32>,
                @builtin(subgroup_id) sg: u32,
                @builtin(subgroup_invocation_id) lane: u32,
                @builtin(subgroup_size) lanes: u32) {
    let row0 = wid.y * BM;
    let col0 = wid.x * BN;
    let sm = (sg / WN) * 64u;   // the subgroup's rows and columns in the tile
    let sn = (sg % WN) * 64u;
    let ks = k_slice(wid.z);
    let k_lo = ks.x;
    let k_hi = ks.y;
    let c_base = ks.z;
    // the factors that undo the operands' scales: a let of uniform values for the direct
    // stores, the private copy for store_c
    let ea = f16_exps[F.sa];
    let eb = f16_exps[F.sb];
    let us = f16_unscale(ea, eb);
    UNSCALE = us;
    let r0 = row0 + sm;
    let q0 = col0 + sn;
    let whole = row0 + BM <= F.M && col0 + BN <= F.N;
    let preload = whole && F.ksplit == 0u && (F.flags & 3u) == 1u &&
                  ea + eb >= PRELOAD_EXP_MIN && ea + eb <= PRELOAD_EXP_MAX;   // workgroup-uniform
    var acc: SgAcc;   // zero-initialised
    if (preload) { sg_preload(&acc, f16_pow2(ea + eb), c_base, r0, q0); }

    let words = ((F.a_off | F.lda | F.b_off | F.ldb) & 7u) == 0u;
    if (whole && (k_hi - k_lo) % BK == 0u && words) {   // workgroup-uniform
        interior_tiles(&acc, tid, row0, col0, sm, sn, k_lo, k_hi);
    } else {
        // at most 8 vec4 of each tile an invocation (a side of 64 WG / 32 rows): past the tile
        // zeros nobody stores (load_a / stage_a skip them)
        var va0 = load_a(k_lo, k_hi, row0, tid + 0u);
        var va1 = load_a(k_lo, k_hi, row0, tid + 1u * WG);
        var va2 = load_a(k_lo, k_hi, row0, tid + 2u * WG);
        var va3 = load_a(k_lo, k_hi, row0, tid + 3u * WG);
        var va4 = load_a(k_lo, k_hi, row0, tid + 4u * WG);
        var va5 = load_a(k_lo, k_hi, row0, tid + 5u * WG);
        var va6 = load_a(k_lo, k_hi, row0, tid + 6u * WG);
        var va7 = load_a(k_lo, k_hi, row0, tid + 7u * WG);
        var vb0 = load_b(k_lo, k_hi, col0, tid + 0u);
        var vb1 = load_b(k_lo, k_hi, col0, tid + 1u * WG);
        var vb2 = load_b(k_lo, k_hi, col0, tid + 2u * WG);
        var vb3 = load_b(k_lo, k_hi, col0, tid + 3u * WG);
        var vb4 = load_b(k_lo, k_hi, col0, tid + 4u * WG);
        var vb5 = load_b(k_lo, k_hi, col0, tid + 5u * WG);
        var vb6 = load_b(k_lo, k_hi, col0, tid + 6u * WG);
        var vb7 = load_b(k_lo, k_hi, col0, tid + 7u * WG);
        for (var k0 = k_lo; k0 < k_hi; k0 += BK) {
            stage_a(va0, tid + 0u);
            stage_a(va1, tid + 1u * WG);
            stage_a(va2, tid + 2u * WG);
            stage_a(va3, tid + 3u * WG);
            stage_a(va4, tid + 4u * WG);
            stage_a(va5, tid + 5u * WG);
            stage_a(va6, tid + 6u * WG);
            stage_a(va7, tid + 7u * WG);
            stage_b(vb0, tid + 0u);
            stage_b(vb1, tid + 1u * WG);
            stage_b(vb2, tid + 2u * WG);
            stage_b(vb3, tid + 3u * WG);
            stage_b(vb4, tid + 4u * WG);
            stage_b(vb5, tid + 5u * WG);
            stage_b(vb6, tid + 6u * WG);
            stage_b(vb7, tid + 7u * WG);
            workgroupBarrier();
            if (k0 + BK < k_hi) {   // the next tile's loads, in flight while this one multiplies
                let k1 = k0 + BK;
                va0 = load_a(k1, k_hi, row0, tid + 0u);
                va1 = load_a(k1, k_hi, row0, tid + 1u * WG);
                va2 = load_a(k1, k_hi, row0, tid + 2u * WG);
                va3 = load_a(k1, k_hi, row0, tid + 3u * WG);
                va4 = load_a(k1, k_hi, row0, tid + 4u * WG);
                va5 = load_a(k1, k_hi, row0, tid + 5u * WG);
                va6 = load_a(k1, k_hi, row0, tid + 6u * WG);
                va7 = load_a(k1, k_hi, row0, tid + 7u * WG);
                vb0 = load_b(k1, k_hi, col0, tid + 0u);
                vb1 = load_b(k1, k_hi, col0, tid + 1u * WG);
                vb2 = load_b(k1, k_hi, col0, tid + 2u * WG);
                vb3 = load_b(k1, k_hi, col0, tid + 3u * WG);
                vb4 = load_b(k1, k_hi, col0, tid + 4u * WG);
                vb5 = load_b(k1, k_hi, col0, tid + 5u * WG);
                vb6 = load_b(k1, k_hi, col0, tid + 6u * WG);
                vb7 = load_b(k1, k_hi, col0, tid + 7u * WG);
            }
            sg_step(&acc, sm, sn, 0u);
            sg_step(&acc, sm, sn, 16u);
            workgroupBarrier();
        }
    }

    if (whole && (F.ksplit != 0u || (F.flags & 3u) == 0u || preload)) {   // workgroup-uniform
        sg_direct(acc.c00, us, c_base, r0 + 0u, q0 + 0u);
        sg_direct(acc.c01, us, c_base, r0 + 0u, q0 + 16u);
        sg_direct(acc.c02, us, c_base, r0 + 0u, q0 + 32u);
        sg_direct(acc.c03, us, c_base, r0 + 0u, q0 + 48u);
        sg_direct(acc.c10, us, c_base, r0 + 16u, q0 + 0u);
        sg_direct(acc.c11, us, c_base, r0 + 16u, q0 + 16u);
        sg_direct(acc.c12, us, c_base, r0 + 16u, q0 + 32u);
        sg_direct(acc.c13, us, c_base, r0 + 16u, q0 + 48u);
        sg_direct(acc.c20, us, c_base, r0 + 32u, q0 + 0u);
        sg_direct(acc.c21, us, c_base, r0 + 32u, q0 + 16u);
        sg_direct(acc.c22, us, c_base, r0 + 32u, q0 + 32u);
        sg_direct(acc.c23, us, c_base, r0 + 32u, q0 + 48u);
        sg_direct(acc.c30, us, c_base, r0 + 48u, q0 + 0u);
        sg_direct(acc.c31, us, c_base, r0 + 48u, q0 + 16u);
        sg_direct(acc.c32, us, c_base, r0 + 48u, q0 + 32u);
        sg_direct(acc.c33, us, c_base, r0 + 48u, q0 + 48u);
        return;
    }
    sg_patch(acc.c00, sg, lane, lanes, c_base, r0 + 0u, q0 + 0u);
    sg_patch(acc.c01, sg, lane, lanes, c_base, r0 + 0u, q0 + 16u);
    sg_patch(acc.c02, sg, lane, lanes, c_base, r0 + 0u, q0 + 32u);
    sg_patch(acc.c03, sg, lane, lanes, c_base, r0 + 0u, q0 + 48u);
    sg_patch(acc.c10, sg, lane, lanes, c_base, r0 + 16u, q0 + 0u);
    sg_patch(acc.c11, sg, lane, lanes, c_base, r0 + 16u, q0 + 16u);
    sg_patch(acc.c12, sg, lane, lanes, c_base, r0 + 16u, q0 + 32u);
    sg_patch(acc.c13, sg, lane, lanes, c_base, r0 + 16u, q0 + 48u);
    sg_patch(acc.c20, sg, lane, lanes, c_base, r0 + 32u, q0 + 0u);
    sg_patch(acc.c21, sg, lane, lanes, c_base, r0 + 32u, q0 + 16u);
    sg_patch(acc.c22, sg, lane, lanes, c_base, r0 + 32u, q0 + 32u);
    sg_patch(acc.c23, sg, lane, lanes, c_base, r0 + 32u, q0 + 48u);
    sg_patch(acc.c30, sg, lane, lanes, c_base, r0 + 48u, q0 + 0u);
    sg_patch(acc.c31, sg, lane, lanes, c_base, r0 + 48u, q0 + 16u);
    sg_patch(acc.c32, sg, lane, lanes, c_base, r0 + 48u, q0 + 32u);
    sg_patch(acc.c33, sg, lane, lanes, c_base, r0 + 48u, q0 + 48u);
}
