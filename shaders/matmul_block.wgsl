// The 8x8 register block of matmul_fast (shaders/matmul.wgsl) and matmul_f16
// (shaders/matmul_f16.wgsl), put in front of a module whose first line requires
// `matmul_params, matmul_block`; both declare C4 (binding 0), bias1 (3) and F (4) as matmul_fast does.
// A thread's block: rows r0..r0+3 and r1..r1+3, columns q0..q0+3 and q1..q1+3 (c{2i} the
// q0 half, c{2i+1} the q1 half; i = row, 0-3 from r0, 4-7 from r1).
//
// The kernels call block_fma for several K steps in a row, written out: on the H200 a
// register-only loop of 64 multiply-adds per iteration ran 40.7 TFLOP/s as a loop and 51.5
// written out 16 times (modules compiled without naga's checks; with its loop counter, 27.7
// as a loop). matmul_fast writes 8 steps out, matmul_f16 16. The block is updated
// through a pointer: passed and returned by value it cost matmul_fast 12% there (in_proj
// forward 29.0 vs 33.8 TFLOP/s; benchmarks/README.md).

struct Block {
    c0: vec4<f32>, c1: vec4<f32>, c2: vec4<f32>, c3: vec4<f32>,
    c4: vec4<f32>, c5: vec4<f32>, c6: vec4<f32>, c7: vec4<f32>,
    c8: vec4<f32>, c9: vec4<f32>, c10: vec4<f32>, c11: vec4<f32>,
    c12: vec4<f32>, c13: vec4<f32>, c14: vec4<f32>, c15: vec4<f32>,
}

// one K step: a0/a1 = the K value of rows r0..r0+3 / r1..r1+3, b0/b1 of columns q0.. / q1..
fn block_fma(t: ptr<function, Block>, a0: vec4<f32>, a1: vec4<f32>, b0: vec4<f32>, b1: vec4<f32>) {
    (*t).c0 += a0.x * b0;  (*t).c1 += a0.x * b1;
    (*t).c2 += a0.y * b0;  (*t).c3 += a0.y * b1;
    (*t).c4 += a0.z * b0;  (*t).c5 += a0.z * b1;
    (*t).c6 += a0.w * b0;  (*t).c7 += a0.w * b1;
    (*t).c8 += a1.x * b0;  (*t).c9 += a1.x * b1;
    (*t).c10 += a1.y * b0; (*t).c11 += a1.y * b1;
    (*t).c12 += a1.z * b0; (*t).c13 += a1.z * b1;
    (*t).c14 += a1.w * b0; (*t).c15 += a1.w * b1;
}

fn block_store(c_base: u32, r0: u32, r1: u32, q0: u32, q1: u32, t: Block) {
    store_fast(c_base, r0, q0, t.c0);       store_fast(c_base, r0, q1, t.c1);
    store_fast(c_base, r0 + 1u, q0, t.c2);  store_fast(c_base, r0 + 1u, q1, t.c3);
    store_fast(c_base, r0 + 2u, q0, t.c4);  store_fast(c_base, r0 + 2u, q1, t.c5);
    store_fast(c_base, r0 + 3u, q0, t.c6);  store_fast(c_base, r0 + 3u, q1, t.c7);
    store_fast(c_base, r1, q0, t.c8);       store_fast(c_base, r1, q1, t.c9);
    store_fast(c_base, r1 + 1u, q0, t.c10); store_fast(c_base, r1 + 1u, q1, t.c11);
    store_fast(c_base, r1 + 2u, q0, t.c12); store_fast(c_base, r1 + 2u, q1, t.c13);
    store_fast(c_base, r1 + 3u, q0, t.c14); store_fast(c_base, r1 + 3u, q1, t.c15);
}

// C[r, c..c+3] = acc unscaled (+ bias) (+ C), or the plain partial product of a split-K
// slice (unscaled too: the reduce adds the bias and C)
fn store_fast(c_base: u32, r: u32, c: u32, acc: vec4<f32>) {
    if (r >= F.M || c >= F.N) { return; }
    var v = (acc * UNSCALE.x) * UNSCALE.y;
    if (F.ksplit != 0u) {   // a partial product: plain store into its slice
        C4[(c_base + r * F.ldc + c) / 4u] = v;
        return;
    }
    if ((F.flags & 2u) != 0u) {
        v += vec4<f32>(bias1[F.bias_off + c], bias1[F.bias_off + c + 1u],
                       bias1[F.bias_off + c + 2u], bias1[F.bias_off + c + 3u]);
    }
    let idx = (c_base + r * F.ldc + c) / 4u;
    if ((F.flags & 1u) != 0u) { v += C4[idx]; }
    C4[idx] = v;
}
