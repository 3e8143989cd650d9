// matmul: C[M,N] (+)= op(A)[M,K] @ op(B)[K,N] (+ bias[N]).
//
// Every operand is addressed through (offset, row stride, column stride), so one kernel
// serves the linear layer's forward (Y = X W^T), its input gradient (dX = dY W) and its
// weight gradient (dW += dY^T X), and column slices of wider matrices (x_proj's dt/B/C).
//
// Tiling: a 64x64 tile of C per workgroup of 16x16 threads, each thread holding a 4x4
// register block; K is walked in steps of 16 through workgroup memory.
// flags: bit 0 = accumulate into C, bit 1 = add bias, bit 2 = A's column stride is 1
// (load A along K), bit 3 = B's column stride is 1 (load B along N).

struct Params {
    M: u32, N: u32, K: u32, flags: u32,
    a_off: u32, a_rs: u32, a_cs: u32, b_off: u32,
    b_rs: u32, b_cs: u32, c_off: u32, ldc: u32,
    bias_off: u32, _p0: u32, _p1: u32, _p2: u32,
}

@group(0) @binding(0) var<storage, read_write> C: array<f32>;
@group(0) @binding(1) var<storage, read> A: array<f32>;
@group(0) @binding(2) var<storage, read> Bmat: array<f32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
@group(0) @binding(4) var<uniform> P: Params;

const TM: u32 = 64u;
const TN: u32 = 64u;
const TK: u32 = 16u;

var<workgroup> As: array<f32, 1024>;   // [TK][TM]
var<workgroup> Bs: array<f32, 1024>;   // [TK][TN]

fn load_a(r: u32, k: u32) -> f32 {
    if (r < P.M && k < P.K) { return A[P.a_off + r * P.a_rs + k * P.a_cs]; }
    return 0.0;
}

fn load_b(k: u32, c: u32) -> f32 {
    if (k < P.K && c < P.N) { return Bmat[P.b_off + k * P.b_rs + c * P.b_cs]; }
    return 0.0;
}

@compute @workgroup_size(16, 16)
fn matmul_forward(@builtin(local_invocation_id) lid: vec3<u32>,
                  @builtin(workgroup_id) wid: vec3<u32>) {
    let row0 = wid.y * TM;
    let col0 = wid.x * TN;
    let tid = lid.y * 16u + lid.x;
    let a_k_fast = (P.flags & 4u) != 0u;
    let b_n_fast = (P.flags & 8u) != 0u;

    var acc: array<f32, 16>;
    for (var i = 0u; i < 16u; i++) { acc[i] = 0.0; }

    for (var k0 = 0u; k0 < P.K; k0 += TK) {
        for (var i = 0u; i < 4u; i++) {
            let e = tid + i * 256u;
            var kk: u32; var mm: u32;
            if (a_k_fast) { kk = e % TK; mm = e / TK; } else { kk = e / TM; mm = e % TM; }
            As[kk * TM + mm] = load_a(row0 + mm, k0 + kk);
            var kb: u32; var nn: u32;
            if (b_n_fast) { kb = e / TN; nn = e % TN; } else { kb = e % TK; nn = e / TK; }
            Bs[kb * TN + nn] = load_b(k0 + kb, col0 + nn);
        }
        workgroupBarrier();
        for (var kk = 0u; kk < TK; kk++) {
            let a = vec4<f32>(As[kk * TM + lid.y * 4u], As[kk * TM + lid.y * 4u + 1u],
                              As[kk * TM + lid.y * 4u + 2u], As[kk * TM + lid.y * 4u + 3u]);
            let b = vec4<f32>(Bs[kk * TN + lid.x * 4u], Bs[kk * TN + lid.x * 4u + 1u],
                              Bs[kk * TN + lid.x * 4u + 2u], Bs[kk * TN + lid.x * 4u + 3u]);
            for (var i = 0u; i < 4u; i++) {
                acc[i * 4u + 0u] += a[i] * b.x;
                acc[i * 4u + 1u] += a[i] * b.y;
                acc[i * 4u + 2u] += a[i] * b.z;
                acc[i * 4u + 3u] += a[i] * b.w;
            }
        }
        workgroupBarrier();
    }

    let accumulate = (P.flags & 1u) != 0u;
    let has_bias = (P.flags & 2u) != 0u;
    for (var i = 0u; i < 4u; i++) {
        let r = row0 + lid.y * 4u + i;
        if (r >= P.M) { continue; }
        for (var j = 0u; j < 4u; j++) {
            let c = col0 + lid.x * 4u + j;
            if (c >= P.N) { continue; }
            var v = acc[i * 4u + j];
            if (has_bias) { v += bias[P.bias_off + c]; }
            let idx = P.c_off + r * P.ldc + c;
            if (accumulate) { v += C[idx]; }
            C[idx] = v;
        }
    }
}
