// decode: recurrent (one token at a time) Mamba-1 inference, the O(1)-per-token step of
// SPEC section 2 for batch 1, plus the kernels that turn a prompt's sequence pass into the
// recurrent state and the sampler that picks the next token on the GPU.
//
// Per layer and token (x, z = the two halves of in_proj's output xz [2Di]):
//   decode_conv_step   pre = bias + sum_{k<K-1} w[d,k] conv[k,d] + w[d,K-1] x[d];  xc = silu(pre)
//                      conv <- (conv[1..K-1], x)       conv [K-1, Di]: the last K-1 inputs x
//   decode_ssm_step    dt = softplus(dt_proj.weight[d] . xdbl[0:R] + dt_proj.bias[d])
//                      s[d,n] = exp(dt A[d,n]) s[d,n] + dt Bm[n] xc[d];   A = -exp(A_log)
//                      y[d] = (sum_n s[d,n] Cm[n] + D[d] xc[d]) * silu(z[d])
//   decode_matvec      out (+)= W x + b: in_proj, x_proj, out_proj (accumulating onto h) and
//                      the LM head, with the same arithmetic as the sequence kernels but one row
//
// After the prompt's sequence pass (the sequence kernels, rows t = 0..L-1 of batch row 0):
//   decode_conv_prefill   conv[k, d] = x[L-(K-1)+k, d]   (0 before the sequence start)
//   decode_ssm_prefill    s stepped through rows of the prompt with the same math as the scan:
//                         from the scan's saved state at the start of the last chunk (see
//                         engine/ops/decode.py for that contract) to the state after L-1.
//
// Per-layer constants (A_log [Di*N], dt_proj.bias [Di], D [Di]) are packed once into one
// buffer `pk` (offsets 0, Di*N, Di*N+Di) so the step kernel stays within 8 storage buffers.
// The arithmetic (order of the conv sum, the softplus form, the state update) is the one
// of shaders/conv1d.wgsl and shaders/selective_scan.wgsl, so that the step reproduces the
// sequence pass up to f32 rounding of the dt_proj dot product.

struct DP {
    Di: u32, N: u32, R: u32, K: u32,
    L: u32, ldx: u32, T: u32, has_bias: u32,
    o_a: u32, o_b: u32, o_c: u32, o_d: u32,
    o_e: u32, o_f: u32, o_g: u32, o_h: u32,
}

@group(0) @binding(0) var<storage, read_write> out: array<f32>;
@group(0) @binding(1) var<storage, read_write> st: array<f32>;
@group(0) @binding(2) var<storage, read> xin: array<f32>;
@group(0) @binding(3) var<storage, read> xdbl: array<f32>;
@group(0) @binding(4) var<storage, read> xz: array<f32>;
@group(0) @binding(5) var<storage, read> wt: array<f32>;
@group(0) @binding(6) var<storage, read> pk: array<f32>;
@group(0) @binding(7) var<uniform> P: DP;
@group(0) @binding(9) var<storage, read> delta: array<f32>;
@group(0) @binding(10) var<storage, read> bias: array<f32>;



// ---------------------------------------------------------------- conv step
// out = xc [Di] (o_a); st = conv state [K-1, Di] (o_b); xz (o_c: x at +0); wt = conv1d.weight
// [Di, K] (o_d); bias = conv1d.bias (o_e, when has_bias).
// The kernel width is a pipeline constant (CONV_K = K): on lavapipe a loop bounded by a
// uniform that reads and writes the state measured 25x slower per pass (0.7 vs 0.03 ms).
override CONV_K: u32 = 4u;

@compute @workgroup_size(256)
fn decode_conv_step(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) lid: u32) {
    let d = lin(wid, nwg, lid);
    if (d >= P.Di) { return; }
    var acc = 0.0;
    if (P.has_bias != 0u) { acc = bias[P.o_e + d]; }
    let x = xz[P.o_c + d];
    for (var k = 0u; k + 1u < CONV_K; k++) {
        acc = acc + wt[P.o_d + d * CONV_K + k] * st[P.o_b + k * P.Di + d];
    }
    acc = acc + wt[P.o_d + d * CONV_K + CONV_K - 1u] * x;
    for (var k = 0u; k + 2u < CONV_K; k++) {
        st[P.o_b + k * P.Di + d] = st[P.o_b + (k + 1u) * P.Di + d];
    }
    if (CONV_K > 1u) { st[P.o_b + (CONV_K - 2u) * P.Di + d] = x; }
    out[P.o_a + d] = acc * sigmoid(acc);
}

// ---------------------------------------------------------------- selective state update
// out = y [Di] (o_a); st = SSM state [Di, N] (o_b); xin = xc [Di] (o_c); xdbl [R+2N] (o_d);
// xz (o_e: z at +Di); wt = dt_proj.weight [Di, R] (o_f); pk (o_g).
@compute @workgroup_size(256)
fn decode_ssm_step(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) lid: u32) {
    let d = lin(wid, nwg, lid);
    if (d >= P.Di) { return; }
    var lo = 0.0;
    for (var r = 0u; r < P.R; r++) { lo = lo + wt[P.o_f + d * P.R + r] * xdbl[P.o_d + r]; }
    let dt = softplus(lo + pk[P.o_g + P.Di * P.N + d]);
    let u = xin[P.o_c + d];
    var acc = 0.0;
    for (var n = 0u; n < P.N; n++) {
        let a = -exp(pk[P.o_g + d * P.N + n]);
        let i = P.o_b + d * P.N + n;
        let s = exp(dt * a) * st[i] + dt * xdbl[P.o_d + P.R + n] * u;
        st[i] = s;
        acc += s * xdbl[P.o_d + P.R + P.N + n];
    }
    let z = xz[P.o_e + P.Di + d];
    out[P.o_a + d] = (acc + pk[P.o_g + P.Di * P.N + P.Di + d] * u) * silu(z);
}

// ---------------------------------------------------------------- state after a prompt
// st = conv state [K-1, Di] (o_b); xz = the last P.L rows of the prompt's xz [., 2Di] (o_c):
// all of it, or its last K-1 rows.
@compute @workgroup_size(256)
fn decode_conv_prefill(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                       @builtin(local_invocation_index) lid: u32) {
    let i = lin(wid, nwg, lid);
    if (i >= (P.K - 1u) * P.Di) { return; }
    let k = i / P.Di;
    let d = i % P.Di;
    var v = 0.0;
    let back = P.K - 1u - k;            // input row L - back
    if (P.L >= back) { v = xz[P.o_c + (P.L - back) * 2u * P.Di + d]; }
    st[P.o_b + i] = v;
}

// st = SSM state [Di, N] (o_b), read and written; xin = P.L rows of the prompt's xc [., Di]
// (o_c); xdbl [., ldx] (o_d) and delta [., Di] (o_e), the same rows; pk (o_g).  One thread
// per (d, n) steps the state through those rows.  The host first copies the scan's saved
// state at the start of the last chunk into st, then calls this over the chunk's remaining
// rows (in several ranges when they exceed one storage binding).
@compute @workgroup_size(256)
fn decode_ssm_prefill(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_index) lid: u32) {
    let i = lin(wid, nwg, lid);
    if (i >= P.Di * P.N) { return; }
    let d = i / P.N;
    let n = i % P.N;
    var s = st[P.o_b + i];
    let a = -exp(pk[P.o_g + i]);
    let b = pk[P.o_g + P.Di * P.N + d];
    for (var t = 0u; t < P.L; t++) {
        let dt = softplus(delta[P.o_e + t * P.Di + d] + b);
        s = exp(dt * a) * s + dt * xdbl[P.o_d + t * P.ldx + P.R + n] * xin[P.o_c + t * P.Di + d];
    }
    st[P.o_b + i] = s;
}

// ---------------------------------------------------------------- matrix-vector product
// out[r] (+)= sum_k W[r, k] x[k] (+ b[r]) for r < rows.  LANES threads per row (256 / LANES
// rows per workgroup) stride over k, then a tree sum in workgroup memory.  The host picks
// LANES per adapter (engine/ops/decode.py).  decode_matvec4 loads vec4s and needs K, the
// weight's and x's offsets to be multiples of 4 (every real model); decode_matvec is the
// same with scalar loads, for other shapes.
struct MV { rows: u32, K: u32, flags: u32, o_out: u32, o_w: u32, o_x: u32, o_b: u32, _p: u32 }

@group(0) @binding(0) var<storage, read_write> mv_out: array<f32>;
@group(0) @binding(1) var<storage, read> mv_w: array<f32>;
@group(0) @binding(2) var<storage, read> mv_x: array<f32>;
@group(0) @binding(3) var<storage, read> mv_b: array<f32>;
@group(0) @binding(4) var<uniform> Q: MV;
@group(0) @binding(1) var<storage, read> mv_w4: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> mv_x4: array<vec4<f32>>;

override LANES: u32 = 32u;   // a power of two <= 256

var<workgroup> red: array<f32, 256>;

fn mv_row(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.x + wid.y * nwg.x) * (256u / LANES) + lid / LANES;
}

fn mv_finish(r: u32, lid: u32, acc: f32) {
    let j = lid % LANES;
    red[lid] = acc;
    workgroupBarrier();
    for (var s = LANES / 2u; s > 0u; s = s >> 1u) {
        if (j < s) { red[lid] = red[lid] + red[lid + s]; }
        workgroupBarrier();
    }
    if (j == 0u && r < Q.rows) {
        var v = red[lid];
        if ((Q.flags & 2u) != 0u) { v += mv_b[Q.o_b + r]; }
        let o = Q.o_out + r;
        if ((Q.flags & 1u) != 0u) { v += mv_out[o]; }
        mv_out[o] = v;
    }
}

@compute @workgroup_size(256)
fn decode_matvec(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let r = mv_row(wid, nwg, lid);
    var acc = 0.0;
    if (r < Q.rows) {
        let base = Q.o_w + r * Q.K;
        for (var k = lid % LANES; k < Q.K; k += LANES) { acc += mv_w[base + k] * mv_x[Q.o_x + k]; }
    }
    mv_finish(r, lid, acc);
}

@compute @workgroup_size(256)
fn decode_matvec4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let r = mv_row(wid, nwg, lid);
    var acc = vec4<f32>(0.0);
    if (r < Q.rows) {
        let base = (Q.o_w + r * Q.K) / 4u;
        let xb = Q.o_x / 4u;
        for (var k = lid % LANES; k < Q.K / 4u; k += LANES) { acc += mv_w4[base + k] * mv_x4[xb + k]; }
    }
    mv_finish(r, lid, (acc.x + acc.y) + (acc.z + acc.w));
}

// ---------------------------------------------------------------- sampler
// One workgroup. io (i32): io[0] = tokens sampled so far t, io[1] = the current token (what the
// next step embeds), io[2 + t % cap] = token t (a ring the host reads back from).  Greedy: the
// lowest index of the largest logit (torch.argmax).  Sampling (HF's order: temperature, then
// top-k, then top-p on what top-k kept): a token is kept when its logit is >= the k-th largest
// (ties kept, as transformers' TopKLogitsWarper) and when the probability mass of the kept
// tokens strictly more probable than it is < top_p (so the most probable token always stays).
// Both sets are {key >= d} for a threshold d on the logits' order-preserving u32 keys, found
// by a radix select 3 bits at a time (11 passes over the logits each); decisions are made on
// the keys, never on a recomputed probability (two computations of one exp may differ in the
// last bit).  Then one token is drawn with the Gumbel-max trick, argmax(v + g),
// g = -log(-log(u)), u from a counter-based hash of (seed, t, token id): reproducible for a
// seed on one adapter.
struct SP { V: u32, mode: u32, top_k: u32, cap: u32, seed_lo: u32, seed_hi: u32, inv_temp: f32, top_p: f32,
            o_logits: u32, _p0: u32, _p1: u32, _p2: u32 }

@group(0) @binding(0) var<storage, read_write> io: array<i32>;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<uniform> S: SP;

var<workgroup> rv: array<f32, 256>;
var<workgroup> ri: array<u32, 256>;
var<workgroup> hw: array<f32, 2304>;   // 9 rows x 256 threads: 8 radix bins and "above"
var<workgroup> part: array<f32, 160>;
var<workgroup> parti: array<u32, 16>;

fn pcg(v: u32) -> u32 {
    let s = v * 747796405u + 2891336453u;
    let w = ((s >> ((s >> 28u) + 4u)) ^ s) * 277803737u;
    return (w >> 22u) ^ w;
}

// logit as an order-preserving u32 (NaN treated as the lowest value)
fn okey(v: f32) -> u32 {
    if (v != v) { return 0u; }
    let b = bitcast<u32>(v);
    if ((b & 0x80000000u) != 0u) { return ~b; }
    return b | 0x80000000u;
}

fn logit(i: u32) -> f32 {
    let v = logits[S.o_logits + i];
    if (v != v) { return -3.0e38; }
    return max(v, -3.0e38);           // above the empty slots' -3.4e38 of the reductions
}

// Sums of rows 0..nrows-1 (nrows <= 10) of hw ([row][256]) into hw[row * 256], in two
// levels (16 partial sums of 16 per row, then the 16 partials): three barriers instead of a
// tree's eight (barriers dominate a small vocabulary's sampling on a software adapter).
fn wg_rows_sum(nrows: u32, lid: u32) {
    workgroupBarrier();
    if (lid < nrows * 16u) {
        let base = (lid / 16u) * 256u + (lid % 16u) * 16u;
        var s = 0.0;
        for (var j = 0u; j < 16u; j++) { s += hw[base + j]; }
        part[lid] = s;
    }
    workgroupBarrier();
    if (lid < nrows) {
        var s = 0.0;
        for (var j = 0u; j < 16u; j++) { s += part[lid * 16u + j]; }
        hw[lid * 256u] = s;
    }
    workgroupBarrier();
}

fn wg_sum_f(v: f32, lid: u32) -> f32 {
    hw[lid] = v;
    wg_rows_sum(1u, lid);
    let r = hw[0];
    workgroupBarrier();
    return r;
}

fn better(v: f32, i: u32, bv: f32, bi: u32) -> bool {
    return v > bv || (v == bv && i < bi);
}

// argmax of (value, lowest index) across the workgroup; returns the index
fn wg_argmax(v: f32, i: u32, lid: u32) -> u32 {
    rv[lid] = v;
    ri[lid] = i;
    workgroupBarrier();
    if (lid < 16u) {
        var bv = rv[lid * 16u];
        var bi = ri[lid * 16u];
        for (var j = 1u; j < 16u; j++) {
            if (better(rv[lid * 16u + j], ri[lid * 16u + j], bv, bi)) { bv = rv[lid * 16u + j]; bi = ri[lid * 16u + j]; }
        }
        part[lid] = bv;
        parti[lid] = bi;
    }
    workgroupBarrier();
    if (lid == 0u) {
        var bv = part[0];
        var bi = parti[0];
        for (var j = 1u; j < 16u; j++) {
            if (better(part[j], parti[j], bv, bi)) { bv = part[j]; bi = parti[j]; }
        }
        ri[0] = bi;
    }
    workgroupBarrier();
    let r = ri[0];
    workgroupBarrier();
    return r;
}

// The largest key d with  sum of weight over tokens with key >= d (and key >= floor)  >= goal;
// weight 1 (mass = false: a count) or exp((l - m) / T).  Bits 31..30, then 3 at a time.
fn select_key(goal: f32, mass: bool, floor: u32, m: f32, lid: u32) -> u32 {
    var d = 0u;
    for (var step = 0u; step < 11u; step++) {
        var shift = 30u;
        var g = 2u;
        if (step > 0u) { shift = 30u - 3u * step; g = 3u; }
        let top = shift + g;                 // bits above the pass: fixed in d already
        var hist: array<f32, 8>;
        for (var b = 0u; b < 8u; b++) { hist[b] = 0.0; }
        var above = 0.0;
        for (var i = lid; i < S.V; i += 256u) {
            let l = logit(i);
            let k = okey(l);
            if (k < floor) { continue; }
            var w = 1.0;
            if (mass) { w = exp((l - m) * S.inv_temp); }
            var kh = 0u;
            var dh = 0u;
            if (top < 32u) { kh = k >> top; dh = d >> top; }
            if (kh > dh) { above += w; } else if (kh == dh) { hist[(k >> shift) & ((1u << g) - 1u)] += w; }
        }
        for (var b = 0u; b < 8u; b++) { hw[b * 256u + lid] = hist[b]; }
        hw[2048u + lid] = above;
        wg_rows_sum(9u, lid);
        // the largest bin j whose suffix (bins >= j, plus everything above) reaches the goal
        var acc = hw[2048u];
        var pick = 0u;
        for (var j = 1u << g; j > 0u; j--) {
            acc += hw[(j - 1u) * 256u];
            if (acc >= goal) { pick = j - 1u; break; }
        }
        d = d | (pick << shift);
        workgroupBarrier();
    }
    return d;
}

@compute @workgroup_size(256)
fn decode_sample(@builtin(local_invocation_index) lid: u32) {
    let t = u32(io[0]);
    // largest logit (and the greedy token)
    var bv = -3.4e38;
    var bi = 0xffffffffu;
    for (var i = lid; i < S.V; i += 256u) {
        let v = logit(i);
        if (v > bv || bi == 0xffffffffu) { bv = v; bi = i; }
    }
    var tok = wg_argmax(bv, bi, lid);
    if (S.mode != 0u) {
        let m = logit(tok);
        var kmin = 0u;
        if (S.top_k > 0u && S.top_k < S.V) {
            kmin = select_key(f32(S.top_k), false, 0u, m, lid);
        }
        var pmin = 0u;
        if (S.top_p < 1.0) {
            var z = 0.0;
            for (var i = lid; i < S.V; i += 256u) {
                let l = logit(i);
                if (okey(l) >= kmin) { z += exp((l - m) * S.inv_temp); }
            }
            pmin = select_key(S.top_p * wg_sum_f(z, lid), true, kmin, m, lid);
        }
        let keep = max(kmin, pmin);
        let key = pcg(S.seed_hi ^ pcg(S.seed_lo ^ pcg(t)));
        var gv = -3.4e38;
        var gi = 0xffffffffu;
        for (var i = lid; i < S.V; i += 256u) {
            let l = logit(i);
            if (okey(l) < keep) { continue; }
            let h = pcg(key ^ pcg(i));
            let u = (f32(h >> 8u) + 0.5) * (1.0 / 16777216.0);
            let g = (l - m) * S.inv_temp - log(-log(u));
            if (g > gv || gi == 0xffffffffu) { gv = g; gi = i; }
        }
        tok = wg_argmax(gv, gi, lid);
    }
    if (lid == 0u) {
        io[1] = i32(tok);
        io[2u + t % S.cap] = i32(tok);
        io[0] = i32(t + 1u);
    }
}
