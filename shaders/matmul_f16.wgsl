// requires: matmul_params, matmul_block
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
// Its epilogue (store_fast) multiplies by 2^-(ea + eb), the operands' scales undone (UNSCALE).
//
// cast_f16: dst[i] = f16(src[i] * s) for n elements, written a vec4 at a time (dst offset a
// multiple of 4; a last partial vec4 gets zeros past n), s = 2^e a per-tensor scale from a
// scale table (below; e = 0 where none is given), recording the tensor's amax (of src).
// Values beyond the f16 range (and NaN) become +-inf: loss scaling detects them downstream.
// f16_rescale: the next scales from the recorded amax (below).

// (FastParams and k_slice: shaders/matmul_params.wgsl; the register block and store_fast:
// shaders/matmul_block.wgsl)

@group(0) @binding(0) var<storage, read_write> C4: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> A4: array<vec4<f16>>;
@group(0) @binding(2) var<storage, read> B4: array<vec4<f16>>;
@group(0) @binding(3) var<storage, read> bias1: array<f32>;
@group(0) @binding(4) var<uniform> F: FastParams;
// the operands' scale table (F16Scales): exponents first, A's at F.sa, B's at F.sb
@group(0) @binding(5) var<storage, read> f16_exps: array<i32>;

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
    UNSCALE = f16_unscale(f16_exps[F.sa], f16_exps[F.sb]);   // undone in store_fast
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
// cast_f16 takes its scale from a scale table (F16Scales in engine/kernels/matmul.py: n slots;
// words [0, n) the scales' exponents e (i32, s = 2^e), [n, 2n) the amax of each slot's casts
// since its last rescale (u32: the bits of |x|, which order as the non-negative floats do,
// NaN above inf), then the history f16_rescale keeps: [2n, 3n) changes, [3n, 4n) least and
// [4n, 5n) greatest exponent, [5n, 6n) the amax of the last rescale, [6n, 7n) the exponent
// the last step's rescale committed).
// mode bit 0: add this cast's amax into the slot's (one atomicMax per workgroup); bit 1: only
// that (the first step's calibration: no store).
// per: vec4 an invocation (1 to CAST_V: engine/kernels/matmul.py _cast_per)
struct CastParams { n: u32, n4: u32, src_off: u32, dst_off4: u32, slot: u32, amax_at: u32, mode: u32, per: u32 }

@group(0) @binding(0) var<storage, read> cast_src: array<f32>;
@group(0) @binding(1) var<storage, read_write> cast_dst: array<vec4<f16>>;
@group(0) @binding(2) var<uniform> CP: CastParams;
@group(0) @binding(3) var<storage, read_write> cast_tab: array<atomic<u32>>;

var<workgroup> cast_max: array<u32, 256>;

// vec4 an invocation: a workgroup casts CP.per * 256 vec4 (rows of 256, each read and written
// contiguously), so that its amax's tree and atomic are shared by up to CAST_V vec4 an invocation
const CAST_V: u32 = 8u;

@compute @workgroup_size(256)
fn cast_f16(@builtin(workgroup_id) wid: vec3<u32>,
            @builtin(local_invocation_index) lid: u32,
            @builtin(num_workgroups) nwg: vec3<u32>) {
    let per = min(CP.per, CAST_V);
    let i0 = (wid.x + wid.y * nwg.x) * (256u * per) + lid;
    // s = 2^e from its exponent bits: x * s is exact (short of f16's range, handled below)
    let s = bitcast<f32>(u32(bitcast<i32>(atomicLoad(&cast_tab[CP.slot])) + 127) << 23u);
    var m = 0u;
    for (var t = 0u; t < per; t++) {
        let i = i0 + t * 256u;
        if (i >= CP.n4) { break; }
        var v = vec4<f32>(0.0);   // the last vec4 of a range that is not a multiple of 4: zeros
        let e = CP.src_off + 4u * i;
        if (4u * i + 4u <= CP.n) {
            v = vec4<f32>(cast_src[e], cast_src[e + 1u], cast_src[e + 2u], cast_src[e + 3u]);
        } else {
            for (var j = 0u; j < 4u; j++) {
                if (4u * i + j < CP.n) { v[j] = cast_src[e + j]; }
            }
        }
        let b = bitcast<vec4<u32>>(v) & vec4<u32>(0x7fffffffu);
        m = max(m, max(max(b.x, b.y), max(b.z, b.w)));
        if ((CP.mode & 2u) == 0u) {
            let w = v * s;
            // out-of-range (and NaN) values: explicitly +-inf (WGSL leaves such conversions undefined)
            let over = !(abs(w) <= vec4<f32>(65504.0));
            let safe = select(w, vec4<f32>(0.0), over);
            // +-65504 * 2 rounds to +-inf at run time (an inf literal is not allowed in WGSL)
            let sgn = select(vec4<f16>(1.0h), vec4<f16>(-1.0h), w < vec4<f32>(0.0));
            let big = (sgn * 65504.0h) * 2.0h;
            cast_dst[CP.dst_off4 + i] = select(vec4<f16>(safe), big, over);
        }
    }
    if ((CP.mode & 1u) != 0u) {   // the workgroup's amax, then one atomic
        cast_max[lid] = m;
        workgroupBarrier();
        for (var k = 128u; k > 0u; k = k >> 1u) {
            if (lid < k) { cast_max[lid] = max(cast_max[lid], cast_max[lid + k]); }
            workgroupBarrier();
        }
        if (lid == 0u) { atomicMax(&cast_tab[CP.amax_at], cast_max[0]); }
    }
}

// ---------------------------------------------------------------------------------------
// f16_rescale: slots [lo, hi) of a scale table of n slots take their next scale from the amax
// their casts recorded, which it clears: e = min(F16_TARGET_EXP - floor(log2(amax)), 60), so
// that the scaled amax lies in [2^12, 2^13) (8x below f16's largest, 65504, for growth until
// the next rescale); e >= 12 - 127 = -115 for any finite amax (so 2^e is a normal f32).  The
// cap: an amax below 2^-48 is not scaled up all the way.  A zero or non-finite amax keeps e.
const F16_TARGET_EXP: i32 = 12;
const F16_EXP_MAX: i32 = 60;
struct RescaleParams { lo: u32, hi: u32, n: u32, commit: u32 }

@group(0) @binding(0) var<storage, read_write> rs_tab: array<u32>;
@group(0) @binding(1) var<uniform> RP: RescaleParams;

// commit (the end of a step): the new exponent is also the slot's committed one ([6n, 7n)),
// against which its history counts a change; else (a calibrating cast's own rescale) only
// the exponent in use changes, so that the history is the steps' alone (the same on every
// rank of a data-parallel run, whose ranks calibrate on their own rows)
@compute @workgroup_size(64)
fn f16_rescale(@builtin(global_invocation_id) gid: vec3<u32>) {
    let k = RP.lo + gid.x;
    if (k >= RP.hi) { return; }
    let n = RP.n;
    let a = rs_tab[n + k];
    rs_tab[n + k] = 0u;
    let old = bitcast<i32>(rs_tab[6u * n + k]);
    var e = old;
    if (a != 0u && a < 0x7f800000u) {
        // floor(log2(amax)) from its exponent field (a subnormal amax: -127, so the cap)
        e = min(F16_TARGET_EXP - (i32(a >> 23u) - 127), F16_EXP_MAX);
    } else if (RP.commit == 0u) {
        return;
    }
    rs_tab[k] = bitcast<u32>(e);
    if (RP.commit == 0u) { return; }
    if (a != 0u && a < 0x7f800000u) { rs_tab[5u * n + k] = a; }
    if (e != old) {
        rs_tab[6u * n + k] = bitcast<u32>(e);
        rs_tab[2u * n + k] += 1u;
        rs_tab[3u * n + k] = bitcast<u32>(min(bitcast<i32>(rs_tab[3u * n + k]), e));
        rs_tab[4u * n + k] = bitcast<u32>(max(bitcast<i32>(rs_tab[4u * n + k]), e));
    }
}
