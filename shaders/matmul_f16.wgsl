// requires: matmul_block
enable f16;
// matmul_f16: matmul_fast (shaders/matmul.wgsl) with f16 operands, for --precision mixed.
//
// C[M, N] (f32) (+)= op(A) @ op(B) (+ bias, f32), where A and B are f16 in memory and in
// workgroup memory (half the bytes of the f32 kernel's loads and tiles) and every product
// is accumulated in f32: the tile values are widened to f32 as they enter registers, so
// the only error beyond the f32 kernel's is the rounding of A and B to f16 (relative
// 2^-11 per operand).  Same tiling as matmul_fast: a 128x128 tile of C per workgroup of
// 256 threads, an 8x8 register block per thread, K tiles of 16, register prefetch.
// Same uniform block and flags (bit 0 accumulate, bit 1 bias, bit 2 A transposed, bit 3
// B transposed), same split-K slices (reduced by matmul.wgsl's matmul_splitk_reduce).
// Offsets and leading dimensions are in elements and multiples of 4.
//
// cast_f16: dst[i] = f16(src[i]) for n elements, written a vec4 at a time (dst offset a
// multiple of 4; a last partial vec4 gets zeros past n).
// Values beyond the f16 range (and NaN) become +-inf: loss scaling detects them downstream.

// (FastParams, the register block and store_fast: shaders/matmul_block.wgsl)

@group(0) @binding(0) var<storage, read_write> C4: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> A4: array<vec4<f16>>;
@group(0) @binding(2) var<storage, read> B4: array<vec4<f16>>;
@group(0) @binding(3) var<storage, read> bias1: array<f32>;
@group(0) @binding(4) var<uniform> F: FastParams;

const BK: u32 = 16u;
var<workgroup> As4: array<array<vec4<f16>, 32>, 16>;
var<workgroup> Bs4: array<array<vec4<f16>, 32>, 16>;

fn fast_load_a(k0: u32, k_hi: u32, row0: u32, e: u32) -> vec4<f16> {
    if ((F.flags & 4u) != 0u) {            // A^T stored [K, lda]: M contiguous
        let k = e / 32u;
        let mq = e % 32u;
        if (k0 + k < k_hi && row0 + mq * 4u < F.M) {
            return A4[(F.a_off + (k0 + k) * F.lda + row0 + mq * 4u) / 4u];
        }
    } else {                                // A stored [M, lda]: K contiguous
        let m = e / 4u;
        let kq = e % 4u;
        if (row0 + m < F.M && k0 + kq * 4u < k_hi) {
            return A4[(F.a_off + (row0 + m) * F.lda + k0 + kq * 4u) / 4u];
        }
    }
    return vec4<f16>(0.0h);
}

fn fast_store_a(v: vec4<f16>, e: u32) {
    if ((F.flags & 4u) != 0u) {
        As4[e / 32u][e % 32u] = v;
    } else {
        let m = e / 4u;
        let k = (e % 4u) * 4u;
        let q = m / 4u;
        let c = m % 4u;
        As4[k][q][c] = v.x;
        As4[k + 1u][q][c] = v.y;
        As4[k + 2u][q][c] = v.z;
        As4[k + 3u][q][c] = v.w;
    }
}

fn fast_load_b(k0: u32, k_hi: u32, col0: u32, e: u32) -> vec4<f16> {
    if ((F.flags & 8u) != 0u) {            // B^T stored [N, ldb]: K contiguous
        let n = e / 4u;
        let kq = e % 4u;
        if (col0 + n < F.N && k0 + kq * 4u < k_hi) {
            return B4[(F.b_off + (col0 + n) * F.ldb + k0 + kq * 4u) / 4u];
        }
    } else {                                // B stored [K, ldb]: N contiguous
        let k = e / 32u;
        let nq = e % 32u;
        if (k0 + k < k_hi && col0 + nq * 4u < F.N) {
            return B4[(F.b_off + (k0 + k) * F.ldb + col0 + nq * 4u) / 4u];
        }
    }
    return vec4<f16>(0.0h);
}

fn fast_store_b(v: vec4<f16>, e: u32) {
    if ((F.flags & 8u) != 0u) {
        let n = e / 4u;
        let k = (e % 4u) * 4u;
        let q = n / 4u;
        let c = n % 4u;
        Bs4[k][q][c] = v.x;
        Bs4[k + 1u][q][c] = v.y;
        Bs4[k + 2u][q][c] = v.z;
        Bs4[k + 3u][q][c] = v.w;
    } else {
        Bs4[e / 32u][e % 32u] = v;
    }
}

@compute @workgroup_size(256)
fn matmul_f16(@builtin(local_invocation_index) tid: u32,
              @builtin(workgroup_id) wid: vec3<u32>) {
    let row0 = wid.y * 128u;
    let col0 = wid.x * 128u;
    let tx = tid % 16u;
    let ty = tid / 16u;
    let ks = k_slice(wid.z);
    let k_lo = ks.x;
    let k_hi = ks.y;
    let c_base = ks.z;
    var acc: Block;   // zero-initialised

    var va0 = fast_load_a(k_lo, k_hi, row0, tid);
    var va1 = fast_load_a(k_lo, k_hi, row0, tid + 256u);
    var vb0 = fast_load_b(k_lo, k_hi, col0, tid);
    var vb1 = fast_load_b(k_lo, k_hi, col0, tid + 256u);
    for (var k0 = k_lo; k0 < k_hi; k0 += BK) {
        fast_store_a(va0, tid);
        fast_store_a(va1, tid + 256u);
        fast_store_b(vb0, tid);
        fast_store_b(vb1, tid + 256u);
        workgroupBarrier();
        if (k0 + BK < k_hi) {
            va0 = fast_load_a(k0 + BK, k_hi, row0, tid);
            va1 = fast_load_a(k0 + BK, k_hi, row0, tid + 256u);
            vb0 = fast_load_b(k0 + BK, k_hi, col0, tid);
            vb1 = fast_load_b(k0 + BK, k_hi, col0, tid + 256u);
        }
        // the 16 K steps written out (matmul_block.wgsl says why): 26.0 -> 30.1 TFLOP/s for
        // in_proj's forward on the H200 (benchmarks/README.md)
        f16_step(&acc, 0u, tx, ty);
        f16_step(&acc, 1u, tx, ty);
        f16_step(&acc, 2u, tx, ty);
        f16_step(&acc, 3u, tx, ty);
        f16_step(&acc, 4u, tx, ty);
        f16_step(&acc, 5u, tx, ty);
        f16_step(&acc, 6u, tx, ty);
        f16_step(&acc, 7u, tx, ty);
        f16_step(&acc, 8u, tx, ty);
        f16_step(&acc, 9u, tx, ty);
        f16_step(&acc, 10u, tx, ty);
        f16_step(&acc, 11u, tx, ty);
        f16_step(&acc, 12u, tx, ty);
        f16_step(&acc, 13u, tx, ty);
        f16_step(&acc, 14u, tx, ty);
        f16_step(&acc, 15u, tx, ty);
        workgroupBarrier();
    }

    block_store(c_base, row0 + ty * 4u, row0 + 64u + ty * 4u, col0 + tx * 4u, col0 + 64u + tx * 4u, acc);
}

// K step k of the tile in workgroup memory, widened to f32 as it enters registers
fn f16_step(acc: ptr<function, Block>, k: u32, tx: u32, ty: u32) {
    block_fma(acc, vec4<f32>(As4[k][ty]), vec4<f32>(As4[k][16u + ty]),
                     vec4<f32>(Bs4[k][tx]), vec4<f32>(Bs4[k][16u + tx]));
}

// ---------------------------------------------------------------------------------------
struct CastParams { n: u32, n4: u32, src_off: u32, dst_off4: u32 }

@group(0) @binding(0) var<storage, read> cast_src: array<f32>;
@group(0) @binding(1) var<storage, read_write> cast_dst: array<vec4<f16>>;
@group(0) @binding(2) var<uniform> CP: CastParams;

@compute @workgroup_size(256)
fn cast_f16(@builtin(global_invocation_id) gid: vec3<u32>,
            @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= CP.n4) { return; }
    var v = vec4<f32>(0.0);   // the last vec4 of a range that is not a multiple of 4: zeros
    for (var j = 0u; j < 4u; j++) {
        if (4u * i + j < CP.n) { v[j] = cast_src[CP.src_off + 4u * i + j]; }
    }
    // out-of-range (and NaN) values: explicitly +-inf (WGSL leaves such conversions undefined)
    let over = !(abs(v) <= vec4<f32>(65504.0));
    let safe = select(v, vec4<f32>(0.0), over);
    // +-65504 * 2 rounds to +-inf at run time (an inf literal is not allowed in WGSL)
    let sgn = select(vec4<f16>(1.0h), vec4<f16>(-1.0h), v < vec4<f32>(0.0));
    let big = (sgn * 65504.0h) * 2.0h;
    cast_dst[CP.dst_off4 + i] = select(vec4<f16>(safe), big, over);
}
