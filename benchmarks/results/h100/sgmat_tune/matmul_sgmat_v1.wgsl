// requires: matmul_params, matmul_block
enable f16;
enable subgroups;
enable chromium_experimental_subgroup_matrix;
diagnostic(off, chromium_experimental.subgroup_matrix_uniformity);
// matmul_sgmat: matmul_f16's product on subgroup matrices (tensor cores from WGSL: Dawn's
// chromium_experimental_subgroup_matrix, f16 x f16 -> f32 at 16x16x16), for --precision
// mixed on adapters that have them (Runtime.has_subgroup_matrix).
//
// C[M, N] (f32) (+)= op(A) @ op(B) (+ bias, f32), A and B f16 in memory; the same uniform
// block, flags and split-K slices as matmul_fast / matmul_f16 (shaders/matmul_block.wgsl:
// FastParams, k_slice, store_fast), the same layout conditions (offsets, leading dimensions,
// N and K multiples of 4; M too when A is transposed).
//
// A workgroup of 8 subgroups (4 x 2, 256 invocations: subgroups are 32 wide) makes a
// BM x BN = 128 x 128 tile of C; a subgroup its 32 x 64 part as 2 x 4 result matrices of
// 16 x 16, named accumulators (no private arrays: see DEVELOPERS.md). On the H200 the
// 128 x 128 tile ran the mamba-130m mixed step 1.18x as fast as 64 x 128 tiles of 4
// subgroups (60,663 against 51,491 tokens/s in one call; in_proj forward 98 against 69 TFLOP/s). K advances in tiles of
// BK = 32 staged through workgroup memory with vec4 loads, zeros outside the matrices (so
// any M, N, K the layout allows), the next tile's loads held in registers while the current
// one multiplies. Each tile keeps its operand's layout in memory (K-contiguous or
// M/N-contiguous rows), and subgroupMatrixLoad reads it row- or column-major accordingly.
// The results go through a 16 x 16 patch of workgroup memory per subgroup to store_fast,
// which undoes the operands' f16 scales (UNSCALE, set from the scale table at binding 5 as
// matmul_f16 does), adds the bias and the old C and guards the edges.

@group(0) @binding(0) var<storage, read_write> C4: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> A4: array<vec4<f16>>;
@group(0) @binding(2) var<storage, read> B4: array<vec4<f16>>;
@group(0) @binding(3) var<storage, read> bias1: array<f32>;
@group(0) @binding(4) var<uniform> F: FastParams;
// the operands' scale table (F16Scales): exponents first, A's at F.sa, B's at F.sb
@group(0) @binding(5) var<storage, read> f16_exps: array<i32>;

// the operands' layouts as pipeline constants (flags bits 2 and 3 as matmul_fast's TA, TB),
// so that the driver compiles one load path per operand
override TA: u32 = 0u;
override TB: u32 = 0u;
const SG_BM: u32 = 128u;
const SG_BN: u32 = 128u;
const SG_BK: u32 = 32u;
const SG_THREADS: u32 = 256u;
var<workgroup> As: array<f16, 4096>;   // SG_BM * SG_BK: [128][32] (A rows) or [32][128] (A^T rows)
var<workgroup> Bs: array<f16, 4096>;   // SG_BK * SG_BN: [32][128] (B rows) or [128][32] (B^T rows)
var<workgroup> Cs: array<f32, 2048>;   // a 16 x 16 result patch per subgroup

// vec4 e of the A tile at K offset k0 (e < 1024), zeros outside A
fn sg_load_a(k0: u32, k_hi: u32, row0: u32, e: u32) -> vec4<f16> {
    if (TA != 0u) {                         // A^T stored [K, lda]: tile [k][m], 32 vec4 a row
        let k = e / 32u;
        let mq = e % 32u;
        if (k0 + k < k_hi && row0 + mq * 4u < F.M) {
            return A4[(F.a_off + (k0 + k) * F.lda + row0 + mq * 4u) / 4u];
        }
    } else {                                // A stored [M, lda]: tile [m][k], 8 vec4 a row
        let m = e / 8u;
        let kq = e % 8u;
        if (row0 + m < F.M && k0 + kq * 4u < k_hi) {
            return A4[(F.a_off + (row0 + m) * F.lda + k0 + kq * 4u) / 4u];
        }
    }
    return vec4<f16>(0.0h);
}

// vec4 e of the B tile at K offset k0 (e < 1024), zeros outside B
fn sg_load_b(k0: u32, k_hi: u32, col0: u32, e: u32) -> vec4<f16> {
    if (TB != 0u) {                         // B^T stored [N, ldb]: tile [n][k], 8 vec4 a row
        let n = e / 8u;
        let kq = e % 8u;
        if (col0 + n < F.N && k0 + kq * 4u < k_hi) {
            return B4[(F.b_off + (col0 + n) * F.ldb + k0 + kq * 4u) / 4u];
        }
    } else {                                // B stored [K, ldb]: tile [k][n], 32 vec4 a row
        let k = e / 32u;
        let nq = e % 32u;
        if (k0 + k < k_hi && col0 + nq * 4u < F.N) {
            return B4[(F.b_off + (k0 + k) * F.ldb + col0 + nq * 4u) / 4u];
        }
    }
    return vec4<f16>(0.0h);
}

// both tiles are stored in the order of their vec4 index: element 4e..4e+3
fn sg_store_a(v: vec4<f16>, e: u32) {
    As[4u * e] = v.x; As[4u * e + 1u] = v.y; As[4u * e + 2u] = v.z; As[4u * e + 3u] = v.w;
}

fn sg_store_b(v: vec4<f16>, e: u32) {
    Bs[4u * e] = v.x; Bs[4u * e + 1u] = v.y; Bs[4u * e + 2u] = v.z; Bs[4u * e + 3u] = v.w;
}

// the left matrix of rows m0..m0+15 of the tile and K steps kk..kk+15
fn sg_left(m0: u32, kk: u32) -> subgroup_matrix_left<f16, 16, 16> {
    if (TA != 0u) {   // [k][m]: column-major, stride BM
        return subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>>(&As, kk * SG_BM + m0, true, SG_BM);
    }
    return subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>>(&As, m0 * SG_BK + kk, false, SG_BK);
}

// the right matrix of K steps kk..kk+15 and columns n0..n0+15 of the tile
fn sg_right(n0: u32, kk: u32) -> subgroup_matrix_right<f16, 16, 16> {
    if (TB != 0u) {   // [n][k]: column-major, stride BK
        return subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>>(&Bs, n0 * SG_BK + kk, true, SG_BK);
    }
    return subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>>(&Bs, kk * SG_BN + n0, false, SG_BN);
}

struct SgAcc {
    c00: subgroup_matrix_result<f32, 16, 16>, c01: subgroup_matrix_result<f32, 16, 16>,
    c02: subgroup_matrix_result<f32, 16, 16>, c03: subgroup_matrix_result<f32, 16, 16>,
    c10: subgroup_matrix_result<f32, 16, 16>, c11: subgroup_matrix_result<f32, 16, 16>,
    c12: subgroup_matrix_result<f32, 16, 16>, c13: subgroup_matrix_result<f32, 16, 16>,
}

// 16 K steps from kk of the staged tiles into the subgroup's 2 x 4 results
fn sg_step(acc: ptr<function, SgAcc>, sm: u32, sn: u32, kk: u32) {
    let a0 = sg_left(sm, kk);
    let a1 = sg_left(sm + 16u, kk);
    var b = sg_right(sn, kk);
    (*acc).c00 = subgroupMatrixMultiplyAccumulate(a0, b, (*acc).c00);
    (*acc).c10 = subgroupMatrixMultiplyAccumulate(a1, b, (*acc).c10);
    b = sg_right(sn + 16u, kk);
    (*acc).c01 = subgroupMatrixMultiplyAccumulate(a0, b, (*acc).c01);
    (*acc).c11 = subgroupMatrixMultiplyAccumulate(a1, b, (*acc).c11);
    b = sg_right(sn + 32u, kk);
    (*acc).c02 = subgroupMatrixMultiplyAccumulate(a0, b, (*acc).c02);
    (*acc).c12 = subgroupMatrixMultiplyAccumulate(a1, b, (*acc).c12);
    b = sg_right(sn + 48u, kk);
    (*acc).c03 = subgroupMatrixMultiplyAccumulate(a0, b, (*acc).c03);
    (*acc).c13 = subgroupMatrixMultiplyAccumulate(a1, b, (*acc).c13);
}

// one 16 x 16 result at C rows r0.., columns q0..: through the subgroup's patch of Cs
fn sg_out(m: subgroup_matrix_result<f32, 16, 16>, sg: u32, lane: u32, lanes: u32,
          c_base: u32, r0: u32, q0: u32) {
    subgroupMatrixStore(&Cs, sg * 256u, m, false, 16u);
    workgroupBarrier();
    for (var e = lane; e < 64u; e += lanes) {
        let r = e / 4u;
        let q = (e % 4u) * 4u;
        let o = sg * 256u + r * 16u + q;
        store_fast(c_base, r0 + r, q0 + q, vec4<f32>(Cs[o], Cs[o + 1u], Cs[o + 2u], Cs[o + 3u]));
    }
    workgroupBarrier();
}

@compute @workgroup_size(256)
fn matmul_sgmat(@builtin(local_invocation_index) tid: u32,
                @builtin(workgroup_id) wid: vec3<u32>,
                @builtin(subgroup_id) sg: u32,
                @builtin(subgroup_invocation_id) lane: u32,
                @builtin(subgroup_size) lanes: u32) {
    let row0 = wid.y * SG_BM;
    let col0 = wid.x * SG_BN;
    let sm = (sg / 2u) * 32u;   // the subgroup's rows and columns in the tile
    let sn = (sg % 2u) * 64u;
    let ks = k_slice(wid.z);
    let k_lo = ks.x;
    let k_hi = ks.y;
    let c_base = ks.z;
    UNSCALE = f16_unscale(f16_exps[F.sa], f16_exps[F.sb]);   // undone in store_fast
    var acc: SgAcc;   // zero-initialised

    var va0 = sg_load_a(k_lo, k_hi, row0, tid);
    let T = SG_THREADS;   // 4 vec4 of each tile a thread
    var va1 = sg_load_a(k_lo, k_hi, row0, tid + T);
    var va2 = sg_load_a(k_lo, k_hi, row0, tid + 2u * T);
    var va3 = sg_load_a(k_lo, k_hi, row0, tid + 3u * T);
    var vb0 = sg_load_b(k_lo, k_hi, col0, tid);
    var vb1 = sg_load_b(k_lo, k_hi, col0, tid + T);
    var vb2 = sg_load_b(k_lo, k_hi, col0, tid + 2u * T);
    var vb3 = sg_load_b(k_lo, k_hi, col0, tid + 3u * T);
    for (var k0 = k_lo; k0 < k_hi; k0 += SG_BK) {
        sg_store_a(va0, tid);
        sg_store_a(va1, tid + T);
        sg_store_a(va2, tid + 2u * T);
        sg_store_a(va3, tid + 3u * T);
        sg_store_b(vb0, tid);
        sg_store_b(vb1, tid + T);
        sg_store_b(vb2, tid + 2u * T);
        sg_store_b(vb3, tid + 3u * T);
        workgroupBarrier();
        if (k0 + SG_BK < k_hi) {   // the next tile's loads, in flight while this one multiplies
            let k1 = k0 + SG_BK;
            va0 = sg_load_a(k1, k_hi, row0, tid);
            va1 = sg_load_a(k1, k_hi, row0, tid + T);
            va2 = sg_load_a(k1, k_hi, row0, tid + 2u * T);
            va3 = sg_load_a(k1, k_hi, row0, tid + 3u * T);
            vb0 = sg_load_b(k1, k_hi, col0, tid);
            vb1 = sg_load_b(k1, k_hi, col0, tid + T);
            vb2 = sg_load_b(k1, k_hi, col0, tid + 2u * T);
            vb3 = sg_load_b(k1, k_hi, col0, tid + 3u * T);
        }
        sg_step(&acc, sm, sn, 0u);
        sg_step(&acc, sm, sn, 16u);
        workgroupBarrier();
    }

    let r0 = row0 + sm;
    let q0 = col0 + sn;
    sg_out(acc.c00, sg, lane, lanes, c_base, r0, q0);
    sg_out(acc.c01, sg, lane, lanes, c_base, r0, q0 + 16u);
    sg_out(acc.c02, sg, lane, lanes, c_base, r0, q0 + 32u);
    sg_out(acc.c03, sg, lane, lanes, c_base, r0, q0 + 48u);
    sg_out(acc.c10, sg, lane, lanes, c_base, r0 + 16u, q0);
    sg_out(acc.c11, sg, lane, lanes, c_base, r0 + 16u, q0 + 16u);
    sg_out(acc.c12, sg, lane, lanes, c_base, r0 + 16u, q0 + 32u);
    sg_out(acc.c13, sg, lane, lanes, c_base, r0 + 16u, q0 + 48u);
}
