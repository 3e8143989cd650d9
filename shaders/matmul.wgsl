// requires: subgroups, matmul_params, matmul_block
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

// ---------------------------------------------------------------------------------------
// matmul_fast: the same product for operands whose rows start on 16-byte boundaries and
// whose contiguous dimension is a multiple of 4 (every linear layer of a real model).
// A BM x BN tile of C per workgroup of (BM/8)*(BN/8) threads, each thread an 8x8 register
// block (rows 4ty..4ty+3 and BM/2+4ty.., columns 4tx..4tx+3 and BN/2+4tx..); K walked in
// steps of BK through workgroup memory, the next tile's global loads issued before this
// tile's arithmetic (register prefetch). The tile shape is chosen per product and adapter
// by engine/ops/matmul.py through the pipeline constants below. (Measured on an H200, in
// benchmarks/README.md: BK 8 or 32, 8x16 blocks per thread, 64-row or 64-column tiles for
// large products, 8x4-thread warp layouts, row-wise loads of K-contiguous operands and no
// register prefetch all lost or gained nothing; double buffering and fma() gained nothing.)
// fast flags: bit 0 accumulate, bit 1 bias, bit 2 A transposed (stored [K, lda], M
// contiguous), bit 3 B transposed (stored [N, ldb], K contiguous).
// Offsets and leading dimensions are in floats and are multiples of 4.
// Split-K (few output tiles, long K: the weight gradients): workgroup z takes K range
// [z*ksplit, (z+1)*ksplit) and writes its partial product to slice z of C (c_off +
// z*M*ldc); matmul_splitk_reduce then adds the slices into the real output.

// (FastParams and k_slice: shaders/matmul_params.wgsl; the register block and store_fast:
// shaders/matmul_block.wgsl)

@group(0) @binding(0) var<storage, read_write> C4: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> A4: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> B4: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> bias1: array<f32>;
@group(0) @binding(4) var<uniform> F: FastParams;

override BM: u32 = 128u;    // rows of C per workgroup, a multiple of 8
override BN: u32 = 128u;    // columns of C per workgroup, a multiple of 8
override BK: u32 = 16u;     // K per workgroup-memory tile, a multiple of 8
override TX: u32 = BN / 8u;
override TY: u32 = BM / 8u;
override NT: u32 = TX * TY;   // threads per workgroup
override AQ: u32 = BM / 4u;   // vec4 per k-row of the A tile
override BQ: u32 = BN / 4u;
override NA: u32 = BK * AQ;   // vec4 of one A tile
override NB: u32 = BK * BQ;

// [k][BM/4 vec4]: a k-row of the A tile / [k][BN/4 vec4]: a k-row of the B tile
// (two-dimensional, so the inner loop's bounds clamps apply to the thread's column only,
// which does not change along the loop; rows of TQ = 32 vec4: BM, BN <= 128, valid_config)
const TQ: u32 = 32u;
var<workgroup> As4: array<array<vec4<f32>, TQ>, BK>;
var<workgroup> Bs4: array<array<vec4<f32>, TQ>, BK>;

// The operands' layouts: the pipeline constants TA, TB (declared with matmul_lanes below).
// The load functions below are the form measured: an equivalent rewrite (one function per
// operand, TA/TB in place of these helpers) compiled to other register numbers on the
// H200 and ran 2% slower (benchmarks/results/h200/diagnostics/loads_ab.txt).
fn a_trans() -> bool { return TA; }
fn b_trans() -> bool { return TB; }

// Tile loads: vec4 number e of the tile (0 <= e < NA or NB), loaded by the same thread at
// every tile, in one of two forms (OFFSETS below picks):
// - index form (index_load_a/b): the index and its bounds worked out again at each tile;
// - offset form (offset_load_a/b): the offset at K = 0 worked out once (fast_base_a/b, in
//   vec4), a tile adding k0's part (one multiply-add); rows of A past M and columns of B past
//   N read the last one instead of zeros, which only reaches rows and columns of C that are
//   never stored.
// Both read zeros for K at or past k_hi (a partial last tile, or the next split-K slice).
fn index_load_a(k0: u32, k_hi: u32, row0: u32, e: u32) -> vec4<f32> {
    if (e >= NA) { return vec4<f32>(0.0); }
    if (a_trans()) {            // A^T stored [K, lda]: M contiguous
        let k = e / AQ;
        let mq = e % AQ;
        if (k0 + k < k_hi && row0 + mq * 4u < F.M) {
            return A4[(F.a_off + (k0 + k) * F.lda + row0 + mq * 4u) / 4u];
        }
    } else {                                // A stored [M, lda]: K contiguous
        let m = e / (BK / 4u);
        let kq = e % (BK / 4u);
        if (row0 + m < F.M && k0 + kq * 4u < k_hi) {
            return A4[(F.a_off + (row0 + m) * F.lda + k0 + kq * 4u) / 4u];
        }
    }
    return vec4<f32>(0.0);
}

fn fast_base_a(row0: u32, e: u32) -> u32 {
    if (a_trans()) {            // A^T stored [K, lda]: M contiguous (M % 4 == 0)
        return (F.a_off + (e / AQ) * F.lda + min(row0 + (e % AQ) * 4u, F.M - 4u)) / 4u;
    }                           // A stored [M, lda]: K contiguous
    return (F.a_off + min(row0 + e / (BK / 4u), F.M - 1u) * F.lda + (e % (BK / 4u)) * 4u) / 4u;
}

fn fast_base_b(col0: u32, e: u32) -> u32 {
    if (b_trans()) {            // B^T stored [N, ldb]: K contiguous
        return (F.b_off + min(col0 + e / (BK / 4u), F.N - 1u) * F.ldb + (e % (BK / 4u)) * 4u) / 4u;
    }                           // B stored [K, ldb]: N contiguous (N % 4 == 0)
    return (F.b_off + (e / BQ) * F.ldb + min(col0 + (e % BQ) * 4u, F.N - 4u)) / 4u;
}

fn index_load_b(k0: u32, k_hi: u32, col0: u32, e: u32) -> vec4<f32> {
    if (e >= NB) { return vec4<f32>(0.0); }
    if (b_trans()) {            // B^T stored [N, ldb]: K contiguous
        let n = e / (BK / 4u);
        let kq = e % (BK / 4u);
        if (col0 + n < F.N && k0 + kq * 4u < k_hi) {
            return B4[(F.b_off + (col0 + n) * F.ldb + k0 + kq * 4u) / 4u];
        }
    } else {                                // B stored [K, ldb]: N contiguous
        let k = e / BQ;
        let nq = e % BQ;
        if (k0 + k < k_hi && col0 + nq * 4u < F.N) {
            return B4[(F.b_off + (k0 + k) * F.ldb + col0 + nq * 4u) / 4u];
        }
    }
    return vec4<f32>(0.0);
}

fn offset_load_a(base: u32, k0: u32, k_hi: u32, e: u32) -> vec4<f32> {
    if (e >= NA) { return vec4<f32>(0.0); }
    if (a_trans()) {
        if (k0 + e / AQ < k_hi) { return A4[base + k0 * (F.lda / 4u)]; }
    } else {
        if (k0 + (e % (BK / 4u)) * 4u < k_hi) { return A4[base + k0 / 4u]; }
    }
    return vec4<f32>(0.0);
}

fn offset_load_b(base: u32, k0: u32, k_hi: u32, e: u32) -> vec4<f32> {
    if (e >= NB) { return vec4<f32>(0.0); }
    if (b_trans()) {
        if (k0 + (e % (BK / 4u)) * 4u < k_hi) { return B4[base + k0 / 4u]; }
    } else {
        if (k0 + e / BQ < k_hi) { return B4[base + k0 * (F.ldb / 4u)]; }
    }
    return vec4<f32>(0.0);
}

// OFFSETS: the offset form, which matmul.py picks for the products with A^T (the weight
// gradients).  On the H200 it made them 4-26% faster (1,928 instructions a kernel instead
// of 2,192); where A is K-contiguous its eight offsets took the kernel to 128 registers with
// spills (the input gradients 37% slower), so those keep the index form.
override OFFSETS: bool = false;
fn fast_load_a(base: u32, k0: u32, k_hi: u32, row0: u32, e: u32) -> vec4<f32> {
    if (OFFSETS) { return offset_load_a(base, k0, k_hi, e); }
    return index_load_a(k0, k_hi, row0, e);
}
fn fast_load_b(base: u32, k0: u32, k_hi: u32, col0: u32, e: u32) -> vec4<f32> {
    if (OFFSETS) { return offset_load_b(base, k0, k_hi, e); }
    return index_load_b(k0, k_hi, col0, e);
}

// The two stores repeat the transposing store of a K-contiguous tile: one helper for both
// tiles would take a pointer to the workgroup array, and naga 0.32 refuses workgroup
// pointers as function arguments ("a pointer of space WorkGroup, which can't be passed
// into functions").
fn fast_store_a(v: vec4<f32>, e: u32) {
    if (e >= NA) { return; }
    if (a_trans()) {
        As4[e / AQ][e % AQ] = v;
    } else {
        let m = e / (BK / 4u);
        let kq = e % (BK / 4u);
        let q = m / 4u;
        let c = m % 4u;
        As4[kq * 4u][q][c] = v.x;
        As4[kq * 4u + 1u][q][c] = v.y;
        As4[kq * 4u + 2u][q][c] = v.z;
        As4[kq * 4u + 3u][q][c] = v.w;
    }
}

fn fast_store_b(v: vec4<f32>, e: u32) {
    if (e >= NB) { return; }
    if (b_trans()) {
        let n = e / (BK / 4u);
        let kq = e % (BK / 4u);
        let q = n / 4u;
        let c = n % 4u;
        Bs4[kq * 4u][q][c] = v.x;
        Bs4[kq * 4u + 1u][q][c] = v.y;
        Bs4[kq * 4u + 2u][q][c] = v.z;
        Bs4[kq * 4u + 3u][q][c] = v.w;
    } else {
        Bs4[e / BQ][e % BQ] = v;
    }
}

// up to four vec4 of each tile per thread (matmul.py keeps NA, NB <= 4 * NT)
@compute @workgroup_size(NT)
fn matmul_fast(@builtin(local_invocation_index) tid: u32,
               @builtin(workgroup_id) wid: vec3<u32>) {
    let row0 = wid.y * BM;
    let col0 = wid.x * BN;
    let tx = tid % TX;
    let ty = tid / TX;
    let ks = k_slice(wid.z);
    let k_lo = ks.x;
    let k_hi = ks.y;
    let c_base = ks.z;
    var acc: Block;   // zero-initialised
    // slot i holds vec4 number tid + i*NT of the tile; slots past the tile are never used
    let ba0 = fast_base_a(row0, tid); let ba1 = fast_base_a(row0, tid + NT);
    let ba2 = fast_base_a(row0, tid + 2u * NT); let ba3 = fast_base_a(row0, tid + 3u * NT);
    let bb0 = fast_base_b(col0, tid); let bb1 = fast_base_b(col0, tid + NT);
    let bb2 = fast_base_b(col0, tid + 2u * NT); let bb3 = fast_base_b(col0, tid + 3u * NT);
    var va0 = fast_load_a(ba0, k_lo, k_hi, row0, tid);
    var va1 = vec4<f32>(0.0); var va2 = vec4<f32>(0.0); var va3 = vec4<f32>(0.0);
    if (NT < NA) { va1 = fast_load_a(ba1, k_lo, k_hi, row0, tid + NT); }
    if (2u * NT < NA) { va2 = fast_load_a(ba2, k_lo, k_hi, row0, tid + 2u * NT); }
    if (3u * NT < NA) { va3 = fast_load_a(ba3, k_lo, k_hi, row0, tid + 3u * NT); }
    var vb0 = fast_load_b(bb0, k_lo, k_hi, col0, tid);
    var vb1 = vec4<f32>(0.0); var vb2 = vec4<f32>(0.0); var vb3 = vec4<f32>(0.0);
    if (NT < NB) { vb1 = fast_load_b(bb1, k_lo, k_hi, col0, tid + NT); }
    if (2u * NT < NB) { vb2 = fast_load_b(bb2, k_lo, k_hi, col0, tid + 2u * NT); }
    if (3u * NT < NB) { vb3 = fast_load_b(bb3, k_lo, k_hi, col0, tid + 3u * NT); }
    for (var k0 = k_lo; k0 < k_hi; k0 += BK) {
        fast_store_a(va0, tid);
        if (NT < NA) { fast_store_a(va1, tid + NT); }
        if (2u * NT < NA) { fast_store_a(va2, tid + 2u * NT); }
        if (3u * NT < NA) { fast_store_a(va3, tid + 3u * NT); }
        fast_store_b(vb0, tid);
        if (NT < NB) { fast_store_b(vb1, tid + NT); }
        if (2u * NT < NB) { fast_store_b(vb2, tid + 2u * NT); }
        if (3u * NT < NB) { fast_store_b(vb3, tid + 3u * NT); }
        workgroupBarrier();
        if (k0 + BK < k_hi) {   // the next tile's loads, in flight during this tile's arithmetic
            let k1 = k0 + BK;
            va0 = fast_load_a(ba0, k1, k_hi, row0, tid);
            if (NT < NA) { va1 = fast_load_a(ba1, k1, k_hi, row0, tid + NT); }
            if (2u * NT < NA) { va2 = fast_load_a(ba2, k1, k_hi, row0, tid + 2u * NT); }
            if (3u * NT < NA) { va3 = fast_load_a(ba3, k1, k_hi, row0, tid + 3u * NT); }
            vb0 = fast_load_b(bb0, k1, k_hi, col0, tid);
            if (NT < NB) { vb1 = fast_load_b(bb1, k1, k_hi, col0, tid + NT); }
            if (2u * NT < NB) { vb2 = fast_load_b(bb2, k1, k_hi, col0, tid + 2u * NT); }
            if (3u * NT < NB) { vb3 = fast_load_b(bb3, k1, k_hi, col0, tid + 3u * NT); }
        }
        for (var k = 0u; k < BK; k += 8u) {   // eight K steps written out (BK % 8 == 0)
            block_fma(&acc, As4[k][ty], As4[k][TY + ty], Bs4[k][tx], Bs4[k][TX + tx]);
            block_fma(&acc, As4[k + 1u][ty], As4[k + 1u][TY + ty], Bs4[k + 1u][tx], Bs4[k + 1u][TX + tx]);
            block_fma(&acc, As4[k + 2u][ty], As4[k + 2u][TY + ty], Bs4[k + 2u][tx], Bs4[k + 2u][TX + tx]);
            block_fma(&acc, As4[k + 3u][ty], As4[k + 3u][TY + ty], Bs4[k + 3u][tx], Bs4[k + 3u][TX + tx]);
            block_fma(&acc, As4[k + 4u][ty], As4[k + 4u][TY + ty], Bs4[k + 4u][tx], Bs4[k + 4u][TX + tx]);
            block_fma(&acc, As4[k + 5u][ty], As4[k + 5u][TY + ty], Bs4[k + 5u][tx], Bs4[k + 5u][TX + tx]);
            block_fma(&acc, As4[k + 6u][ty], As4[k + 6u][TY + ty], Bs4[k + 6u][tx], Bs4[k + 6u][TX + tx]);
            block_fma(&acc, As4[k + 7u][ty], As4[k + 7u][TY + ty], Bs4[k + 7u][tx], Bs4[k + 7u][TX + tx]);
        }
        workgroupBarrier();
    }

    block_store(c_base, row0 + ty * 4u, row0 + BM / 2u + ty * 4u, col0 + tx * 4u, col0 + (TX + tx) * 4u, acc);
}

// C[M, N] (+)= sum over the ksplit slices of A (the partial products, [S, M, N]) (+ bias).
// Here F.K holds the slice count S and F.a_off the partials' offset.
@compute @workgroup_size(256)
fn matmul_splitk_reduce(@builtin(global_invocation_id) gid: vec3<u32>,
                        @builtin(num_workgroups) nwg: vec3<u32>) {
    let n4 = F.N / 4u;
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= F.M * n4) { return; }
    let r = i / n4;
    let c = (i % n4) * 4u;
    var v = vec4<f32>(0.0);
    let slice = F.M * F.N / 4u;
    for (var z = 0u; z < F.K; z++) {
        v += A4[F.a_off / 4u + z * slice + i];
    }
    if ((F.flags & 2u) != 0u) {
        v += vec4<f32>(bias1[F.bias_off + c], bias1[F.bias_off + c + 1u],
                       bias1[F.bias_off + c + 2u], bias1[F.bias_off + c + 3u]);
    }
    let idx = (F.c_off + r * F.ldc + c) / 4u;
    if ((F.flags & 1u) != 0u) { v += C4[idx]; }
    C4[idx] = v;
}

// ---------------------------------------------------------------------------------------
// matmul_lanes: matmul_fast's product (the same parameters, bindings, flags and alignment
// requirements; no split-K) for CPU adapters such as lavapipe, where a workgroup runs as
// SIMD vectors of 8 lanes and every load whose address differs between the lanes is a
// gather costing tens of cycles, from workgroup memory as much as from a buffer.  A 32x32
// tile of C per workgroup of one 8-lane subgroup: lane l loads rows 4l..4l+3 of the A tile
// and columns 4l..4l+3 of the B tile, four steps of K at a time (eight vec4 loads), then
// takes every row's four K values from its owner by subgroup shuffle: 512 multiply-adds
// per lane for eight loads.  engine/ops/matmul.py uses it only where the subgroup is these
// 8 lanes (engine/ops/lanes.py).  Inside a loop lavapipe reads every uniform-buffer field
// as a gather over the lanes (outside control flow as one load), so the parameters are
// copied once before the loop and passed down (15-25% faster).

// The layouts are pipeline constants, so each pipeline keeps only its own loads.
override TA: bool = false;   // A stored [K, lda] (M contiguous); else [M, lda] (K contiguous)
override TB: bool = false;   // B stored [N, ldb] (K contiguous); else [K, ldb] (N contiguous)
// So are the epilogue's flags: lavapipe runs the body of every `if` it cannot prove uniform,
// masked, so flags read at run time cost the bias and accumulate loads on every store.
override ACC: bool = false;   // C += the product (flags bit 0)
override BIAS: bool = false;  // + bias (flags bit 1)

// rows (or columns) r0..r0+3 as loaded; those at or past `lim` read as zeros (the load itself
// stays inside the binding or is clamped by the runtime)
fn lanes_rows(v0: vec4<f32>, v1: vec4<f32>, v2: vec4<f32>, v3: vec4<f32>, r0: u32, lim: u32) -> mat4x4<f32> {
    let z = vec4<f32>(0.0);
    return mat4x4<f32>(select(z, v0, r0 < lim), select(z, v1, r0 + 1u < lim),
                       select(z, v2, r0 + 2u < lim), select(z, v3, r0 + 3u < lim));
}

// column j: the K values k..k+3 of row r0 + j (r0 = the lane's first row of the tile)
fn lanes_a(F: FastParams, r0: u32, k: u32) -> mat4x4<f32> {
    if (TA) {   // four K rows of four consecutive rows, transposed
        if (r0 >= F.M) { return mat4x4<f32>(); }
        let i = (F.a_off + k * F.lda + r0) / 4u;
        let q = F.lda / 4u;
        return transpose(mat4x4<f32>(A4[i], A4[i + q], A4[i + 2u * q], A4[i + 3u * q]));
    }
    let i = (F.a_off + r0 * F.lda + k) / 4u;
    let q = F.lda / 4u;
    return lanes_rows(A4[i], A4[i + q], A4[i + 2u * q], A4[i + 3u * q], r0, F.M);
}

// column q: the K values k..k+3 of column c0 + q of op(B)
fn lanes_b(F: FastParams, c0: u32, k: u32) -> mat4x4<f32> {
    if (!TB) {
        if (c0 >= F.N) { return mat4x4<f32>(); }
        let i = (F.b_off + k * F.ldb + c0) / 4u;
        let q = F.ldb / 4u;
        return transpose(mat4x4<f32>(B4[i], B4[i + q], B4[i + 2u * q], B4[i + 3u * q]));
    }
    let i = (F.b_off + c0 * F.ldb + k) / 4u;
    let q = F.ldb / 4u;
    return lanes_rows(B4[i], B4[i + q], B4[i + 2u * q], B4[i + 3u * q], c0, F.N);
}

// C[r, c..c+3] = acc (+ bias) (+ C): store_fast without split-K, the flags as constants
fn lanes_store(f: FastParams, r: u32, c: u32, acc: vec4<f32>) {
    if (r >= f.M || c >= f.N) { return; }
    var v = acc;
    if (BIAS) {
        v += vec4<f32>(bias1[f.bias_off + c], bias1[f.bias_off + c + 1u], bias1[f.bias_off + c + 2u], bias1[f.bias_off + c + 3u]);
    }
    let idx = (f.c_off + r * f.ldc + c) / 4u;
    if (ACC) { v += C4[idx]; }
    C4[idx] = v;
}

@compute @workgroup_size(8)
fn matmul_lanes(@builtin(local_invocation_index) l: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let f = F;   // read once, before the loop (see the note above)
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
    for (var k = 0u; k < f.K; k += 4u) {
        let am = lanes_a(f, row0 + 4u * l, k);
        let bm = lanes_b(f, c, k);
        c00 += sg_shuffle4(am[0], 0u) * bm; c01 += sg_shuffle4(am[1], 0u) * bm; c02 += sg_shuffle4(am[2], 0u) * bm; c03 += sg_shuffle4(am[3], 0u) * bm;
        c10 += sg_shuffle4(am[0], 1u) * bm; c11 += sg_shuffle4(am[1], 1u) * bm; c12 += sg_shuffle4(am[2], 1u) * bm; c13 += sg_shuffle4(am[3], 1u) * bm;
        c20 += sg_shuffle4(am[0], 2u) * bm; c21 += sg_shuffle4(am[1], 2u) * bm; c22 += sg_shuffle4(am[2], 2u) * bm; c23 += sg_shuffle4(am[3], 2u) * bm;
        c30 += sg_shuffle4(am[0], 3u) * bm; c31 += sg_shuffle4(am[1], 3u) * bm; c32 += sg_shuffle4(am[2], 3u) * bm; c33 += sg_shuffle4(am[3], 3u) * bm;
        c40 += sg_shuffle4(am[0], 4u) * bm; c41 += sg_shuffle4(am[1], 4u) * bm; c42 += sg_shuffle4(am[2], 4u) * bm; c43 += sg_shuffle4(am[3], 4u) * bm;
        c50 += sg_shuffle4(am[0], 5u) * bm; c51 += sg_shuffle4(am[1], 5u) * bm; c52 += sg_shuffle4(am[2], 5u) * bm; c53 += sg_shuffle4(am[3], 5u) * bm;
        c60 += sg_shuffle4(am[0], 6u) * bm; c61 += sg_shuffle4(am[1], 6u) * bm; c62 += sg_shuffle4(am[2], 6u) * bm; c63 += sg_shuffle4(am[3], 6u) * bm;
        c70 += sg_shuffle4(am[0], 7u) * bm; c71 += sg_shuffle4(am[1], 7u) * bm; c72 += sg_shuffle4(am[2], 7u) * bm; c73 += sg_shuffle4(am[3], 7u) * bm;
    }
    lanes_store(f, row0 + 0u, c, c00); lanes_store(f, row0 + 1u, c, c01); lanes_store(f, row0 + 2u, c, c02); lanes_store(f, row0 + 3u, c, c03);
    lanes_store(f, row0 + 4u, c, c10); lanes_store(f, row0 + 5u, c, c11); lanes_store(f, row0 + 6u, c, c12); lanes_store(f, row0 + 7u, c, c13);
    lanes_store(f, row0 + 8u, c, c20); lanes_store(f, row0 + 9u, c, c21); lanes_store(f, row0 + 10u, c, c22); lanes_store(f, row0 + 11u, c, c23);
    lanes_store(f, row0 + 12u, c, c30); lanes_store(f, row0 + 13u, c, c31); lanes_store(f, row0 + 14u, c, c32); lanes_store(f, row0 + 15u, c, c33);
    lanes_store(f, row0 + 16u, c, c40); lanes_store(f, row0 + 17u, c, c41); lanes_store(f, row0 + 18u, c, c42); lanes_store(f, row0 + 19u, c, c43);
    lanes_store(f, row0 + 20u, c, c50); lanes_store(f, row0 + 21u, c, c51); lanes_store(f, row0 + 22u, c, c52); lanes_store(f, row0 + 23u, c, c53);
    lanes_store(f, row0 + 24u, c, c60); lanes_store(f, row0 + 25u, c, c61); lanes_store(f, row0 + 26u, c, c62); lanes_store(f, row0 + 27u, c, c63);
    lanes_store(f, row0 + 28u, c, c70); lanes_store(f, row0 + 29u, c, c71); lanes_store(f, row0 + 30u, c, c72); lanes_store(f, row0 + 31u, c, c73);
}


// matmul_lanes_any: matmul_lanes for the shapes it does not take (K, N, a stride or an offset
// no multiple of 4: x_proj and dt_proj of a time_step_rank such as 3), which otherwise went
// to the plain 64x64 kernel, 4x slower per multiply-add on lavapipe.  The same 32x32 tile per
// 8-lane workgroup and subgroup broadcasts; its operands are read as scalars through the
// plain kernel's parameters (any strides; rows, columns and K past the ends read as zeros)
// and its results stored as scalars.
fn any_a1(p: Params, r: u32, k: u32) -> f32 {
    let v = A[p.a_off + min(r, p.M - 1u) * p.a_rs + min(k, p.K - 1u) * p.a_cs];
    return select(0.0, v, r < p.M && k < p.K);
}
fn any_b1(p: Params, k: u32, c: u32) -> f32 {
    let v = Bmat[p.b_off + min(k, p.K - 1u) * p.b_rs + min(c, p.N - 1u) * p.b_cs];
    return select(0.0, v, k < p.K && c < p.N);
}
// column j: the K values k..k+3 of row r0 + j
fn any_a(p: Params, r0: u32, k: u32) -> mat4x4<f32> {
    return mat4x4<f32>(
        vec4<f32>(any_a1(p, r0, k), any_a1(p, r0, k + 1u), any_a1(p, r0, k + 2u), any_a1(p, r0, k + 3u)),
        vec4<f32>(any_a1(p, r0 + 1u, k), any_a1(p, r0 + 1u, k + 1u), any_a1(p, r0 + 1u, k + 2u), any_a1(p, r0 + 1u, k + 3u)),
        vec4<f32>(any_a1(p, r0 + 2u, k), any_a1(p, r0 + 2u, k + 1u), any_a1(p, r0 + 2u, k + 2u), any_a1(p, r0 + 2u, k + 3u)),
        vec4<f32>(any_a1(p, r0 + 3u, k), any_a1(p, r0 + 3u, k + 1u), any_a1(p, r0 + 3u, k + 2u), any_a1(p, r0 + 3u, k + 3u)));
}
// column q: the K values k..k+3 of column c0 + q
fn any_b(p: Params, c0: u32, k: u32) -> mat4x4<f32> {
    return mat4x4<f32>(
        vec4<f32>(any_b1(p, k, c0), any_b1(p, k + 1u, c0), any_b1(p, k + 2u, c0), any_b1(p, k + 3u, c0)),
        vec4<f32>(any_b1(p, k, c0 + 1u), any_b1(p, k + 1u, c0 + 1u), any_b1(p, k + 2u, c0 + 1u), any_b1(p, k + 3u, c0 + 1u)),
        vec4<f32>(any_b1(p, k, c0 + 2u), any_b1(p, k + 1u, c0 + 2u), any_b1(p, k + 2u, c0 + 2u), any_b1(p, k + 3u, c0 + 2u)),
        vec4<f32>(any_b1(p, k, c0 + 3u), any_b1(p, k + 1u, c0 + 3u), any_b1(p, k + 2u, c0 + 3u), any_b1(p, k + 3u, c0 + 3u)));
}
fn any_store1(p: Params, r: u32, c: u32, v: f32) {
    if (c >= p.N) { return; }
    var x = v;
    if (BIAS) { x += bias[p.bias_off + c]; }
    let i = p.c_off + r * p.ldc + c;
    if (ACC) { x += C[i]; }
    C[i] = x;
}
fn any_store(p: Params, r: u32, c: u32, v: vec4<f32>) {
    if (r >= p.M) { return; }
    any_store1(p, r, c, v.x); any_store1(p, r, c + 1u, v.y); any_store1(p, r, c + 2u, v.z); any_store1(p, r, c + 3u, v.w);
}

@compute @workgroup_size(8)
fn matmul_lanes_any(@builtin(local_invocation_index) l: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let f = P;   // read once, before the loop
    let row0 = wid.y * 32u;
    let c = wid.x * 32u + 4u * l;
    var c00 = vec4<f32>(0.0); var c01 = vec4<f32>(0.0); var c02 = vec4<f32>(0.0); var c03 = vec4<f32>(0.0);
    var c10 = vec4<f32>(0.0); var c11 = vec4<f32>(0.0); var c12 = vec4<f32>(0.0); var c13 = vec4<f32>(0.0);
    var c20 = vec4<f32>(0.0); var c21 = vec4<f32>(0.0); var c22 = vec4<f32>(0.0); var c23 = vec4<f32>(0.0);
    var c30 = vec4<f32>(0.0); var c31 = vec4<f32>(0.0); var c32 = vec4<f32>(0.0); var c33 = vec4<f32>(0.0);
    var c40 = vec4<f32>(0.0); var c41 = vec4<f32>(0.0); var c42 = vec4<f32>(0.0); var c43 = vec4<f32>(0.0);
    var c50 = vec4<f32>(0.0); var c51 = vec4<f32>(0.0); var c52 = vec4<f32>(0.0); var c53 = vec4<f32>(0.0);
    var c60 = vec4<f32>(0.0); var c61 = vec4<f32>(0.0); var c62 = vec4<f32>(0.0); var c63 = vec4<f32>(0.0);
    var c70 = vec4<f32>(0.0); var c71 = vec4<f32>(0.0); var c72 = vec4<f32>(0.0); var c73 = vec4<f32>(0.0);
    for (var k = 0u; k < f.K; k += 4u) {
        let am = any_a(f, row0 + 4u * l, k);
        let bm = any_b(f, c, k);
        c00 += sg_shuffle4(am[0], 0u) * bm; c01 += sg_shuffle4(am[1], 0u) * bm; c02 += sg_shuffle4(am[2], 0u) * bm; c03 += sg_shuffle4(am[3], 0u) * bm;
        c10 += sg_shuffle4(am[0], 1u) * bm; c11 += sg_shuffle4(am[1], 1u) * bm; c12 += sg_shuffle4(am[2], 1u) * bm; c13 += sg_shuffle4(am[3], 1u) * bm;
        c20 += sg_shuffle4(am[0], 2u) * bm; c21 += sg_shuffle4(am[1], 2u) * bm; c22 += sg_shuffle4(am[2], 2u) * bm; c23 += sg_shuffle4(am[3], 2u) * bm;
        c30 += sg_shuffle4(am[0], 3u) * bm; c31 += sg_shuffle4(am[1], 3u) * bm; c32 += sg_shuffle4(am[2], 3u) * bm; c33 += sg_shuffle4(am[3], 3u) * bm;
        c40 += sg_shuffle4(am[0], 4u) * bm; c41 += sg_shuffle4(am[1], 4u) * bm; c42 += sg_shuffle4(am[2], 4u) * bm; c43 += sg_shuffle4(am[3], 4u) * bm;
        c50 += sg_shuffle4(am[0], 5u) * bm; c51 += sg_shuffle4(am[1], 5u) * bm; c52 += sg_shuffle4(am[2], 5u) * bm; c53 += sg_shuffle4(am[3], 5u) * bm;
        c60 += sg_shuffle4(am[0], 6u) * bm; c61 += sg_shuffle4(am[1], 6u) * bm; c62 += sg_shuffle4(am[2], 6u) * bm; c63 += sg_shuffle4(am[3], 6u) * bm;
        c70 += sg_shuffle4(am[0], 7u) * bm; c71 += sg_shuffle4(am[1], 7u) * bm; c72 += sg_shuffle4(am[2], 7u) * bm; c73 += sg_shuffle4(am[3], 7u) * bm;
    }
    any_store(f, row0 + 0u, c, c00); any_store(f, row0 + 1u, c, c01); any_store(f, row0 + 2u, c, c02); any_store(f, row0 + 3u, c, c03);
    any_store(f, row0 + 4u, c, c10); any_store(f, row0 + 5u, c, c11); any_store(f, row0 + 6u, c, c12); any_store(f, row0 + 7u, c, c13);
    any_store(f, row0 + 8u, c, c20); any_store(f, row0 + 9u, c, c21); any_store(f, row0 + 10u, c, c22); any_store(f, row0 + 11u, c, c23);
    any_store(f, row0 + 12u, c, c30); any_store(f, row0 + 13u, c, c31); any_store(f, row0 + 14u, c, c32); any_store(f, row0 + 15u, c, c33);
    any_store(f, row0 + 16u, c, c40); any_store(f, row0 + 17u, c, c41); any_store(f, row0 + 18u, c, c42); any_store(f, row0 + 19u, c, c43);
    any_store(f, row0 + 20u, c, c50); any_store(f, row0 + 21u, c, c51); any_store(f, row0 + 22u, c, c52); any_store(f, row0 + 23u, c, c53);
    any_store(f, row0 + 24u, c, c60); any_store(f, row0 + 25u, c, c61); any_store(f, row0 + 26u, c, c62); any_store(f, row0 + 27u, c, c63);
    any_store(f, row0 + 28u, c, c70); any_store(f, row0 + 29u, c, c71); any_store(f, row0 + 30u, c, c72); any_store(f, row0 + 31u, c, c73);
}
