// requires: subgroups
// matmul_lanes: matmul_fast's product (shaders/matmul.wgsl: same parameters, bindings and
// flags, the same alignment requirements) for CPU adapters such as lavapipe, where a
// workgroup runs as SIMD vectors of 8 lanes and every load whose address differs between
// the lanes is a gather costing tens of cycles, from workgroup memory as much as from a
// buffer.  A 32x32 tile of C per workgroup of one 8-lane subgroup: lane l loads rows
// 4l..4l+3 of the A tile and columns 4l..4l+3 of the B tile, four steps of K at a time
// (eight vec4 loads), then takes every row's four K values from its owner by subgroup
// broadcast: 512 multiply-adds per lane for eight loads.  engine/ops/matmul.py uses it only
// where the subgroup is these 8 lanes (engine/ops/lanes.py), and K is a multiple of 4.

struct FastParams {
    M: u32, N: u32, K: u32, flags: u32,
    a_off: u32, lda: u32, b_off: u32, ldb: u32,
    c_off: u32, ldc: u32, bias_off: u32, ksplit: u32,
}

@group(0) @binding(0) var<storage, read_write> C4: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> A4: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> B4: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> bias1: array<f32>;
@group(0) @binding(4) var<uniform> F: FastParams;

// The layouts are pipeline constants, so each pipeline keeps only its own loads.
override TA: bool = false;   // A stored [K, lda] (M contiguous); else [M, lda] (K contiguous)
override TB: bool = false;   // B stored [N, ldb] (K contiguous); else [K, ldb] (N contiguous)

// a row (or column) past the matrix reads as zeros (the load itself stays inside the binding
// or is clamped by the runtime)
fn lanes_load(v: vec4<f32>, ok: bool) -> vec4<f32> { return select(vec4<f32>(0.0), v, ok); }

// column j: the K values k..k+3 of row r0 + j (r0 = the lane's first row of the tile)
fn lanes_a(r0: u32, k: u32) -> mat4x4<f32> {
    if (TA) {   // four K rows of four consecutive rows, transposed
        if (r0 >= F.M) { return mat4x4<f32>(); }
        let i = (F.a_off + k * F.lda + r0) / 4u;
        let q = F.lda / 4u;
        return transpose(mat4x4<f32>(A4[i], A4[i + q], A4[i + 2u * q], A4[i + 3u * q]));
    }
    let i = (F.a_off + r0 * F.lda + k) / 4u;
    let q = F.lda / 4u;
    return mat4x4<f32>(lanes_load(A4[i], r0 < F.M), lanes_load(A4[i + q], r0 + 1u < F.M),
                       lanes_load(A4[i + 2u * q], r0 + 2u < F.M), lanes_load(A4[i + 3u * q], r0 + 3u < F.M));
}

// column q: the K values k..k+3 of column c0 + q of op(B)
fn lanes_b(c0: u32, k: u32) -> mat4x4<f32> {
    if (!TB) {
        if (c0 >= F.N) { return mat4x4<f32>(); }
        let i = (F.b_off + k * F.ldb + c0) / 4u;
        let q = F.ldb / 4u;
        return transpose(mat4x4<f32>(B4[i], B4[i + q], B4[i + 2u * q], B4[i + 3u * q]));
    }
    let i = (F.b_off + c0 * F.ldb + k) / 4u;
    let q = F.ldb / 4u;
    return mat4x4<f32>(lanes_load(B4[i], c0 < F.N), lanes_load(B4[i + q], c0 + 1u < F.N),
                       lanes_load(B4[i + 2u * q], c0 + 2u < F.N), lanes_load(B4[i + 3u * q], c0 + 3u < F.N));
}

fn lanes_store(r: u32, c: u32, acc: vec4<f32>) {
    if (r >= F.M || c >= F.N) { return; }
    var v = acc;
    if ((F.flags & 2u) != 0u) {
        v += vec4<f32>(bias1[F.bias_off + c], bias1[F.bias_off + c + 1u],
                       bias1[F.bias_off + c + 2u], bias1[F.bias_off + c + 3u]);
    }
    let idx = (F.c_off + r * F.ldc + c) / 4u;
    if ((F.flags & 1u) != 0u) { v += C4[idx]; }
    C4[idx] = v;
}

@compute @workgroup_size(8)
fn matmul_lanes(@builtin(local_invocation_index) l: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let row0 = wid.y * 32u;
    let c = wid.x * 32u + 4u * l;
    // c{L}{j}: row row0 + 4L + j, columns c..c+3
    var c00 = vec4<f32>(0.0); var c01 = vec4<f32>(0.0); var c02 = vec4<f32>(0.0); var c03 = vec4<f32>(0.0);
    var c10 = vec4<f32>(0.0); var c11 = vec4<f32>(0.0); var c12 = vec4<f32>(0.0); var c13 = vec4<f32>(0.0);
    var c20 = vec4<f32>(0.0); var c21 = vec4<f32>(0.0); var c22 = vec4<f32>(0.0); var c23 = vec4<f32>(0.0);
    var c30 = vec4<f32>(0.0); var c31 = vec4<f32>(0.0); var c32 = vec4<f32>(0.0); var c33 = vec4<f32>(0.0);
    var c40 = vec4<f32>(0.0); var c41 = vec4<f32>(0.0); var c42 = vec4<f32>(0.0); var c43 = vec4<f32>(0.0);
    var c50 = vec4<f32>(0.0); var c51 = vec4<f32>(0.0); var c52 = vec4<f32>(0.0); var c53 = vec4<f32>(0.0);
    var c60 = vec4<f32>(0.0); var c61 = vec4<f32>(0.0); var c62 = vec4<f32>(0.0); var c63 = vec4<f32>(0.0);
    var c70 = vec4<f32>(0.0); var c71 = vec4<f32>(0.0); var c72 = vec4<f32>(0.0); var c73 = vec4<f32>(0.0);
    for (var k = 0u; k < F.K; k += 4u) {
        let am = lanes_a(row0 + 4u * l, k);
        let bm = lanes_b(c, k);
        c00 += subgroupBroadcast(am[0], 0u) * bm; c01 += subgroupBroadcast(am[1], 0u) * bm; c02 += subgroupBroadcast(am[2], 0u) * bm; c03 += subgroupBroadcast(am[3], 0u) * bm;
        c10 += subgroupBroadcast(am[0], 1u) * bm; c11 += subgroupBroadcast(am[1], 1u) * bm; c12 += subgroupBroadcast(am[2], 1u) * bm; c13 += subgroupBroadcast(am[3], 1u) * bm;
        c20 += subgroupBroadcast(am[0], 2u) * bm; c21 += subgroupBroadcast(am[1], 2u) * bm; c22 += subgroupBroadcast(am[2], 2u) * bm; c23 += subgroupBroadcast(am[3], 2u) * bm;
        c30 += subgroupBroadcast(am[0], 3u) * bm; c31 += subgroupBroadcast(am[1], 3u) * bm; c32 += subgroupBroadcast(am[2], 3u) * bm; c33 += subgroupBroadcast(am[3], 3u) * bm;
        c40 += subgroupBroadcast(am[0], 4u) * bm; c41 += subgroupBroadcast(am[1], 4u) * bm; c42 += subgroupBroadcast(am[2], 4u) * bm; c43 += subgroupBroadcast(am[3], 4u) * bm;
        c50 += subgroupBroadcast(am[0], 5u) * bm; c51 += subgroupBroadcast(am[1], 5u) * bm; c52 += subgroupBroadcast(am[2], 5u) * bm; c53 += subgroupBroadcast(am[3], 5u) * bm;
        c60 += subgroupBroadcast(am[0], 6u) * bm; c61 += subgroupBroadcast(am[1], 6u) * bm; c62 += subgroupBroadcast(am[2], 6u) * bm; c63 += subgroupBroadcast(am[3], 6u) * bm;
        c70 += subgroupBroadcast(am[0], 7u) * bm; c71 += subgroupBroadcast(am[1], 7u) * bm; c72 += subgroupBroadcast(am[2], 7u) * bm; c73 += subgroupBroadcast(am[3], 7u) * bm;
    }
    lanes_store(row0 + 0u, c, c00); lanes_store(row0 + 1u, c, c01); lanes_store(row0 + 2u, c, c02); lanes_store(row0 + 3u, c, c03);
    lanes_store(row0 + 4u, c, c10); lanes_store(row0 + 5u, c, c11); lanes_store(row0 + 6u, c, c12); lanes_store(row0 + 7u, c, c13);
    lanes_store(row0 + 8u, c, c20); lanes_store(row0 + 9u, c, c21); lanes_store(row0 + 10u, c, c22); lanes_store(row0 + 11u, c, c23);
    lanes_store(row0 + 12u, c, c30); lanes_store(row0 + 13u, c, c31); lanes_store(row0 + 14u, c, c32); lanes_store(row0 + 15u, c, c33);
    lanes_store(row0 + 16u, c, c40); lanes_store(row0 + 17u, c, c41); lanes_store(row0 + 18u, c, c42); lanes_store(row0 + 19u, c, c43);
    lanes_store(row0 + 20u, c, c50); lanes_store(row0 + 21u, c, c51); lanes_store(row0 + 22u, c, c52); lanes_store(row0 + 23u, c, c53);
    lanes_store(row0 + 24u, c, c60); lanes_store(row0 + 25u, c, c61); lanes_store(row0 + 26u, c, c62); lanes_store(row0 + 27u, c, c63);
    lanes_store(row0 + 28u, c, c70); lanes_store(row0 + 29u, c, c71); lanes_store(row0 + 30u, c, c72); lanes_store(row0 + 31u, c, c73);
}

