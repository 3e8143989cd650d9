// Causal depthwise conv1d + SiLU, per sequence of length L (rows m = b*L + t):
//   pre[m, c] = bias[c] + sum_{k<K} w[c, k] * x[b, t - (K-1) + k, c]   (x = 0 for t' < 0)
//   out[m, c] = silu(pre[m, c])
// x is read from columns 0..Di of xz (row stride ld = 2*Di); w is [Di, K] row-major.
// Backward, with dpre = dout * silu'(pre) (recomputed, no scratch):
//   dx[b, t, c]  = sum_k w[c, k] * dpre[b, t + (K-1) - k, c]   (t' < L)  -> dxz[:, 0:Di] WRITE
//   dw[c, k]    += sum_{b,t} dpre[b, t, c] * x[b, t - (K-1) + k, c]        (ACC)
//   dbias[c]    += sum_{b,t} dpre[b, t, c]                                 (ACC)
// dw/dbias go through a two-stage reduction (a partial row per (sequence, SEQ_T steps) into
// scratch, then an ordered sum), so every output element has one writer. K <= 7.
// Activations larger than one storage binding are processed in ranges of whole sequences
// (batch rows), each a call of its own; a range's partials go to rows pbase .. .
struct Params { M: u32, L: u32, Di: u32, K: u32, ld: u32, has_bias: u32, _p0: u32, nchunks: u32,
                o_a: u32, o_b: u32, o_c: u32, o_d: u32, o_e: u32, pbase: u32, _p1: u32, _p2: u32 }

fn dsilu(p: f32) -> f32 { let s = sigmoid(p); return s * (1.0 + p * (1.0 - s)); }

// ---------------------------------------------------------------- forward
@group(0) @binding(0) var<storage, read_write> out: array<f32>;
@group(0) @binding(1) var<storage, read_write> pre: array<f32>;
@group(0) @binding(2) var<storage, read> xz: array<f32>;
@group(0) @binding(3) var<storage, read> weight: array<f32>;
@group(0) @binding(4) var<storage, read> bias: array<f32>;
@group(0) @binding(5) var<uniform> P: Params;

// ---------------------------------------------------------------- backward
@group(0) @binding(0) var<storage, read_write> dxz: array<f32>;
@group(0) @binding(1) var<storage, read> dout: array<f32>;
@group(0) @binding(2) var<storage, read> preb: array<f32>;
// (binding 3, the taps: the forward's `weight`)
@group(0) @binding(4) var<uniform> PB: Params;

// ---------------------------------------------------------------- kernels
// A workgroup of WG lanes over WG consecutive channels (engine/ops/conv1d.py: 8, one SIMD
// vector, on CPU adapters; 128 on GPUs), each lane walking SEQ_T steps of one sequence with
// its K taps and the window in vec4 registers, so an output costs one load of x (two of dout
// and pre, one more of x for the weight gradient) instead of 2K: on the H200 a step's conv1d
// took 12.6 ms as a thread per output and a separate weight-gradient pass, 9.4 this way (8.1
// with the backward's loads a step ahead; benchmarks/README.md).  The sums run in the order
// of a loop over k (the terms a sequence's start lacks are zeros here).  The kernels copy
// their uniforms once at the top: on lavapipe a uniform read inside a loop or after a branch
// is a gather over the lanes.
const SEQ_T: u32 = 64u;
override WG: u32 = 8u;   // lanes (consecutive channels) per workgroup

struct SeqLane { b: u32, c: u32, t0: u32, t1: u32, ok: bool }

fn seq_lane(wid: vec3<u32>, nwg: vec3<u32>, l: u32, M: u32, L: u32, Di: u32) -> SeqLane {
    let nc = (Di + WG - 1u) / WG;
    let nt = (L + SEQ_T - 1u) / SEQ_T;
    let g = wid.x + wid.y * nwg.x;
    let c = (g % nc) * WG + l;
    let t0 = ((g / nc) % nt) * SEQ_T;
    let b = g / (nc * nt);
    return SeqLane(b, c, t0, min(L, t0 + SEQ_T), b * L < M && c < Di);
}

// the K (<= 8) taps of channel c as two vec4s, zeros from K on
fn taps(wt: u32, K: u32) -> array<vec4<f32>, 2> {
    var w = array<vec4<f32>, 2>(vec4<f32>(0.0), vec4<f32>(0.0));
    for (var k = 0u; k < K; k = k + 1u) { w[k / 4u][k % 4u] = weight[wt + k]; }
    return w;
}

// sum over the 8 slots, slot 0 first: the order of a loop over k
fn sum8(a: vec4<f32>, b: vec4<f32>, init: f32) -> f32 {
    return init + a.x + a.y + a.z + a.w + b.x + b.y + b.z + b.w;
}

// the window moves one step: every slot takes the next one's value and x goes into slot K-1
// (at0 / at1: which slot of x0 / x1 that is)
fn shift_in(x0: ptr<function, vec4<f32>>, x1: ptr<function, vec4<f32>>, x: f32, at0: vec4<bool>, at1: vec4<bool>) {
    let sh0 = vec4<f32>((*x0).y, (*x0).z, (*x0).w, (*x1).x);
    *x1 = select(vec4<f32>((*x1).y, (*x1).z, (*x1).w, 0.0), vec4<f32>(x), at1);
    *x0 = select(sh0, vec4<f32>(x), at0);
}

// The windows of both kernels shift along in two vec4 registers (no per-step array indexing):
// slot k of the forward's window holds x at step t - (K-1) + k (zeros before the sequence and
// from slot K on), slot k of the backward's holds step t + (K-1) - k.
@compute @workgroup_size(WG)
fn conv1d_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_id) lid: vec3<u32>) {
    let p = P;   // read once (see the note above seq_lane)
    let q = seq_lane(wid, nwg, lid.x, p.M, p.L, p.Di);
    if (!q.ok) { return; }
    let row0 = q.b * p.L;
    let w = taps(p.o_d + q.c * p.K, p.K);
    let kq = vec4<u32>(0u, 1u, 2u, 3u);
    let at0 = kq == vec4<u32>(p.K - 1u);
    let at1 = kq + 4u == vec4<u32>(p.K - 1u);
    var x0 = vec4<f32>(0.0);
    var x1 = vec4<f32>(0.0);
    var bv = 0.0;
    if (p.has_bias != 0u) { bv = bias[p.o_e + q.c]; }
    for (var t = q.t0 - min(q.t0, p.K - 1u); t < q.t1; t = t + 1u) {
        let m = row0 + t;
        shift_in(&x0, &x1, xz[p.o_c + m * p.ld + q.c], at0, at1);
        if (t >= q.t0) {
            let acc = sum8(w[0] * x0, w[1] * x1, bv);
            pre[p.o_b + m * p.Di + q.c] = acc;
            out[p.o_a + m * p.Di + q.c] = acc * sigmoid(acc);
        }
    }
}

// With SEQ_DW (the weight or bias gradient wanted) the lane also sums its segment's
// weight-gradient terms, dpre_t * x[t-(K-1)+k] and dpre_t, from the dout and pre it loads
// anyway (one more load, of x, per step) into partial row pbase + b * (segments per
// sequence) + segment, which conv1d_dweight_reduce sums.
override SEQ_DW: bool = false;
@group(0) @binding(5) var<storage, read> xs: array<f32>;
@group(0) @binding(6) var<storage, read_write> partials: array<f32>;

@compute @workgroup_size(WG)
fn conv1d_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_id) lid: vec3<u32>) {
    let pb = PB;   // read once (see the note above seq_lane)
    let q = seq_lane(wid, nwg, lid.x, pb.M, pb.L, pb.Di);
    if (!q.ok) { return; }
    let row0 = q.b * pb.L;
    let w = taps(pb.o_d + q.c * pb.K, pb.K);
    var g0 = vec4<f32>(0.0);   // dout
    var g1 = vec4<f32>(0.0);
    var s0 = vec4<f32>(0.0);   // silu'(pre)
    var s1 = vec4<f32>(0.0);
    let kq = vec4<u32>(0u, 1u, 2u, 3u);
    let at0 = kq == vec4<u32>(pb.K - 1u);
    let at1 = kq + 4u == vec4<u32>(pb.K - 1u);
    var x0 = vec4<f32>(0.0);   // SEQ_DW: slot k = x at step t - (K-1) + k, as the forward's
    var x1 = vec4<f32>(0.0);
    var a0 = vec4<f32>(0.0);   // SEQ_DW: taps 0..3 and 4..7 of the weight gradient, the bias
    var a1 = vec4<f32>(0.0);
    var ab = 0.0;
    if (SEQ_DW) {   // the K-1 inputs before the segment fill the window
        for (var t = q.t0 - min(q.t0, pb.K - 1u); t < q.t0; t = t + 1u) {
            shift_in(&x0, &x1, xs[pb.o_e + (row0 + t) * pb.ld + q.c], at0, at1);
        }
    }
    // the step's dout, pre and x, loaded a step ahead, so that their latency overlaps a
    // step's work (H200: a step's conv1d backward 5.63 -> 4.45 ms; the same in the forward
    // took it from 2.74 to 2.82 ms, so the forward loads as it goes)
    var gl = 0.0;
    var pl = 0.0;
    var xl = 0.0;
    if (q.t0 < pb.L) {
        gl = dout[pb.o_b + (row0 + q.t0) * pb.Di + q.c];
        pl = preb[pb.o_c + (row0 + q.t0) * pb.Di + q.c];
        if (SEQ_DW) { xl = xs[pb.o_e + (row0 + q.t0) * pb.ld + q.c]; }
    }
    // the window enters at step t + K - 1; the first K - 1 steps only fill it
    for (var ta = q.t0; ta < q.t1 + pb.K - 1u; ta = ta + 1u) {
        var gn = 0.0;
        var sn = 0.0;
        if (ta < pb.L) {
            gn = gl;
            sn = dsilu(pl);
        }
        let xv = xl;
        if (ta + 1u < pb.L && ta + 1u < q.t1 + pb.K - 1u) {
            let j = (row0 + ta + 1u) * pb.Di + q.c;
            gl = dout[pb.o_b + j];
            pl = preb[pb.o_c + j];
            if (SEQ_DW && ta + 1u < q.t1) { xl = xs[pb.o_e + (row0 + ta + 1u) * pb.ld + q.c]; }
        }
        if (SEQ_DW && ta < q.t1) {
            shift_in(&x0, &x1, xv, at0, at1);
            let dp = gn * sn;
            a0 = a0 + dp * x0;
            a1 = a1 + dp * x1;
            ab = ab + dp;
        }
        g1 = vec4<f32>(g0.w, g1.x, g1.y, g1.z);
        g0 = vec4<f32>(gn, g0.x, g0.y, g0.z);
        s1 = vec4<f32>(s0.w, s1.x, s1.y, s1.z);
        s0 = vec4<f32>(sn, s0.x, s0.y, s0.z);
        if (ta + 1u >= q.t0 + pb.K) {
            let t = ta + 1u - pb.K;
            dxz[pb.o_a + (row0 + t) * pb.ld + q.c] = sum8(w[0] * g0 * s0, w[1] * g1 * s1, 0.0);
        }
    }
    if (SEQ_DW) {
        let nt = (pb.L + SEQ_T - 1u) / SEQ_T;
        let base = ((pb.pbase + q.b * nt + q.t0 / SEQ_T) * pb.Di + q.c) * (pb.K + 1u);
        for (var k = 0u; k < pb.K; k = k + 1u) { partials[base + k] = select(a1[k % 4u], a0[k % 4u], k < 4u); }
        partials[base + pb.K] = ab;
    }
}

// ---------------------------------------------------------------- backward: dw, dbias
// partial[(p * Di + c) * (K+1) + k]: k < K weight taps, k = K the bias (written by
// conv1d_backward with SEQ_DW); summed over p in order.
@group(0) @binding(0) var<storage, read_write> dweight: array<f32>;
@group(0) @binding(1) var<storage, read_write> dbias: array<f32>;
@group(0) @binding(2) var<storage, read> partial3: array<f32>;
@group(0) @binding(3) var<uniform> P3: Params;

@compute @workgroup_size(256)
fn conv1d_dweight_reduce(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = lin(wid, nwg, lid.x);                 // i = c * (K+1) + k
    let K1 = P3.K + 1u;
    if (i >= P3.Di * K1) { return; }
    let c = i / K1;
    let k = i - c * K1;
    if (k == P3.K && P3.has_bias == 0u) { return; }
    var acc = 0.0;
    let stride = P3.Di * K1;
    for (var p = 0u; p < P3.nchunks; p = p + 1u) { acc = acc + partial3[p * stride + i]; }
    if (k < P3.K) {
        let o = P3.o_a + c * P3.K + k;
        dweight[o] = dweight[o] + acc;
    } else {
        let o = P3.o_b + c;
        dbias[o] = dbias[o] + acc;
    }
}
