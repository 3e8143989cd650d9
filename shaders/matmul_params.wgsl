// The uniform block and helpers of every tiled product kernel: matmul_fast (shaders/matmul.wgsl),
// matmul_f16 and matmul_sgmat, put in front of a module whose first line requires
// `matmul_params` (matmul_fast and matmul_f16 also require `matmul_block`, after it).

struct FastParams {
    M: u32, N: u32, K: u32, flags: u32,
    a_off: u32, lda: u32, b_off: u32, ldb: u32,
    c_off: u32, ldc: u32, bias_off: u32, ksplit: u32,   // ksplit: K per slice (split-K), 0 = all
    sa: u32, sb: u32, _p0: u32, _p1: u32,   // the f16 kernels: A's and B's slots in their scale table
}

// --precision mixed: the f16 operands are A * 2^ea and B * 2^eb (per-tensor scales, powers of
// two: engine/kernels/matmul.py `F16Scales`); the f16 kernels set UNSCALE from their scale
// table before the epilogue, and store_fast multiplies it in first: (acc * x) * y with
// x * y = 2^-(ea + eb), both exact (powers of two); x alone where 2^-(ea + eb) is an f32
// (y = 1), else x = 2^-ea, y = 2^-eb (two large scales down: each step grows towards the
// result, so neither overflows before it).  The f32 kernels leave it (1, 1): x * 1 = x.
var<private> UNSCALE: vec2<f32> = vec2<f32>(1.0, 1.0);

// the factors that undo scales 2^ea, 2^eb (each in [-115, 60]: F16Scales)
fn f16_unscale(ea: i32, eb: i32) -> vec2<f32> {
    if (ea + eb >= -127) { return vec2<f32>(f16_pow2(-(ea + eb)), 1.0); }
    return vec2<f32>(f16_pow2(-ea), f16_pow2(-eb));
}

// The workgroup's range of K, [x, y), and the element offset of its output, z: all of K into
// C, or under split-K slice zs of K (workgroup z = zs) into slice zs of the partial products.
fn k_slice(zs: u32) -> vec3<u32> {
    if (F.ksplit == 0u) { return vec3<u32>(0u, F.K, F.c_off); }
    let lo = zs * F.ksplit;
    return vec3<u32>(lo, min(F.K, lo + F.ksplit), F.c_off + zs * F.M * F.ldc);
}
