// requires: subgroups
// selective_scan: Mamba-1 selective scan (SPEC section 2), forward and backward.
//
// Rows m = b*L + t.  dt = softplus(delta + dt_bias), A = -exp(A_log),
// Bm/Cm = columns R.. / R+N.. of xdbl (row stride ldx = R+2N), z = columns Di.. of xz (ld 2Di).
//   s_t = exp(dt*A) s_{t-1} + dt*Bm*u ;  y = (sum_n s_t*Cm + D*u) * silu(z)
//
// Parameters (A_log [Di*N], dt_bias [Di], D [Di]) are copied by the wrapper into the `work`
// scratch buffer at offsets 0, Di*N, Di*N+Di, so each entry point binds one buffer for them.
//
// Design (the one that makes mamba-ssm's CUDA kernel fast, laid out for our [M, Di] rows):
// a workgroup of WG = P*DB threads per (b, block of DB channels); thread (j, dl) owns channel
// dl of time segment j.  The sequence is walked in chunks of T = P*K steps; inside a chunk
// segment j is steps j*K .. j*K+K-1, its inputs in registers.  Per chunk and state n:
//   A  every thread scans its K steps from a zero state: the segment's end state X and (the
//      decay being exp(A*dt)) the segment's total decay exp(A * sum dt);
//   B  the pairs (sum dt, X) are combined across the P segments (an associative scan,
//      carried in from the previous chunk), giving every segment its true start state;
//   C  every thread re-walks its K steps from that state and produces its outputs.
// The state dimension lives in registers (a loop over n, NG states per pass over shared
// memory).  The forward saves the state before each chunk (states [B, nchk, Di, N]); the
// backward walks the chunks in reverse, recomputes states from those, and runs the adjoint
//   g_t = Cm_t*dy'_t + exp(dt_{t+1}A) g_{t+1}      (dy' = dy*silu(z))
// as the mirror image of the same scan (its segment totals come out of phase A's forward
// walk: h = sum_k exp(A * sum_{k'<=k} dt_k') Cm_k dy'_k).  The sums over channels (dBm, dCm)
// are a butterfly across the DB channel lanes of a segment: subgroup shuffles where the
// adapter has subgroups laid out as expected, workgroup memory otherwise.

struct Params {
    B: u32, L: u32, Di: u32, N: u32,
    R: u32, ldx: u32, nchk: u32, nblk: u32,
    o_y: u32, o_u: u32, o_delta: u32, o_xdbl: u32,
    o_xz: u32, o_states: u32, o_dy: u32, o_du: u32,
    o_ddelta: u32, o_dxz: u32, o_dxdbl: u32, off_st: u32,
    off_hc: u32, off_pa: u32, off_pb: u32, off_pd: u32,
    pbc_half: u32, _p0: u32, _p1: u32, _p2: u32,
}

// scale_a != 0: the sum is multiplied by A = -exp(A_log[i]) (A_log at work[0..]), for dA_log
struct AccParams { n: u32, K: u32, base: u32, stride: u32, o_out: u32, scale_a: u32, _p1: u32, _p2: u32 }

@group(0) @binding(0) var<storage, read_write> y: array<f32>;
@group(0) @binding(1) var<storage, read_write> states: array<f32>;
@group(0) @binding(2) var<storage, read> u: array<f32>;
@group(0) @binding(3) var<storage, read> delta: array<f32>;
@group(0) @binding(4) var<storage, read> xdbl: array<f32>;
@group(0) @binding(5) var<storage, read> xz: array<f32>;
@group(0) @binding(6) var<storage, read_write> work: array<f32>;
@group(0) @binding(7) var<storage, read> dy: array<f32>;
@group(0) @binding(8) var<storage, read_write> du: array<f32>;
@group(0) @binding(9) var<storage, read_write> ddelta: array<f32>;
@group(0) @binding(10) var<storage, read_write> dxz: array<f32>;
@group(0) @binding(11) var<storage, read_write> pbc: array<f32>;
@group(0) @binding(12) var<storage, read_write> dxdbl: array<f32>;
@group(0) @binding(13) var<storage, read_write> acc_out: array<f32>;
@group(0) @binding(14) var<uniform> P: Params;
@group(0) @binding(15) var<uniform> Q: AccParams;

const WG: u32 = 128u;   // threads per workgroup = SEG * DB
const DB: u32 = 16u;    // channels per workgroup
const SEG: u32 = 8u;    // time segments per chunk
const K: u32 = 8u;      // steps per segment (the register tile)
const T: u32 = 64u;     // steps per chunk = SEG * K = CHUNK in engine/ops/scan.py
const NG: u32 = 16u;    // states per pass over shared memory
const XS: u32 = 144u;   // row stride of xs/hs (= 16 mod 32: phase B reads without bank conflicts)
const BS: u32 = 33u;    // row stride of bct (odd: the two segments of a 32-wide subgroup hit other banks)

override SUBGROUPS: bool = true;   // false: the workgroup-memory butterfly even where subgroups exist

var<workgroup> bct: array<f32, 2112>;  // [T][BS]: Bm (0..NG) and Cm (NG..2NG) of the chunk's steps
var<workgroup> xs: array<f32, 2304>;   // [NG][XS]: segment end state -> start state (-> dA partial)
var<workgroup> hs: array<f32, 2304>;   // [NG][XS]: segment adjoint total -> adjoint entering from the right
var<workgroup> ssum: array<f32, 128>;  // [WG]: sum of dt over each thread's segment
var<workgroup> ash: array<f32, 256>;   // [NG][DB]: A = -exp(A_log) of the block's channels
var<workgroup> red: array<f32, 1024>;  // [8][WG]: butterfly exchange without subgroups
var<workgroup> qs_w: atomic<u32>;

// log1p(exp(x)), torch's threshold 20; Kahan's log1p for accuracy at small exp(x).
fn softplus(x: f32) -> f32 {
    if (x > 20.0) { return x; }
    let e = exp(x);
    let w = 1.0 + e;
    if (w == 1.0) { return e; }
    return log(w) * e / (w - 1.0);
}

fn sigmoid(x: f32) -> f32 { return 1.0 / (1.0 + exp(-x)); }
fn silu(x: f32) -> f32 { return x * sigmoid(x); }

fn off_bias() -> u32 { return P.Di * P.N; }
fn off_D() -> u32 { return P.Di * P.N + P.Di; }

// The chunk's Bm/Cm rows of states n0 .. n0+NG into bct, A of the block's channels into ash.
fn load_group(b: u32, c: u32, blk: u32, n0: u32, ng: u32, tid: u32) {
    for (var i = tid; i < T * 2u * NG; i += WG) {
        let r = i / (2u * NG);
        let q = i % (2u * NG);
        let nn = q % NG;
        let t = c * T + r;
        var v = 0.0;
        if (nn < ng && t < P.L) {
            v = xdbl[P.o_xdbl + (b * P.L + t) * P.ldx + P.R + (q / NG) * P.N + n0 + nn];
        }
        bct[r * BS + q] = v;
    }
    for (var i = tid; i < NG * DB; i += WG) {
        let nn = i / DB;
        let d = blk * DB + i % DB;
        var a = 0.0;
        if (nn < ng && d < P.Di) { a = -exp(work[d * P.N + n0 + nn]); }
        ash[i] = a;
    }
}

// ---------------------------------------------------------------- forward
// grid: B * nblk workgroups.  y WRITE; states[b, c] = the state before chunk c WRITE.
@compute @workgroup_size(128)
fn selective_scan_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                          @builtin(local_invocation_index) tid: u32) {
    let wg = wid.x + wid.y * nwg.x;
    if (wg >= P.B * P.nblk) { return; }
    let b = wg / P.nblk;
    let blk = wg % P.nblk;
    let dl = tid % DB;
    let j = tid / DB;
    let d = blk * DB + dl;
    let live = d < P.Di;
    let dc = min(d, P.Di - 1u);
    let bias = work[off_bias() + dc];
    let Dd = work[off_D() + dc];
    let ngrp = (P.N + NG - 1u) / NG;
    for (var c = 0u; c < P.nchk; c++) {
        let t0 = c * T + j * K;
        var dt: array<f32, 8>;
        var dtu: array<f32, 8>;
        var uu: array<f32, 8>;
        var yk: array<f32, 8>;
        var sdt = 0.0;
        for (var k = 0u; k < K; k++) {
            var dv = 0.0;
            var uv = 0.0;
            if (live && t0 + k < P.L) {
                let e = (b * P.L + t0 + k) * P.Di + d;
                dv = softplus(delta[P.o_delta + e] + bias);
                uv = u[P.o_u + e];
            }
            dt[k] = dv;
            uu[k] = uv;
            dtu[k] = dv * uv;
            yk[k] = 0.0;
            sdt += dv;
        }
        for (var g = 0u; g < ngrp; g++) {
            let n0 = g * NG;
            let ng = min(NG, P.N - n0);
            load_group(b, c, blk, n0, ng, tid);
            workgroupBarrier();
            // A: the segment's end state from a zero start
            for (var n = 0u; n < ng; n++) {
                let a = ash[n * DB + dl];
                var x = 0.0;
                for (var k = 0u; k < K; k++) {
                    x = exp(dt[k] * a) * x + dtu[k] * bct[(j * K + k) * BS + n];
                }
                xs[n * XS + tid] = x;
            }
            ssum[tid] = sdt;
            workgroupBarrier();
            // B: owner threads (channel dl2, state n) carry the state across the segments
            for (var q = 0u; q < 2u; q++) {
                let p = tid + q * WG;
                let n = p / DB;
                let dl2 = p % DB;
                let d2 = blk * DB + dl2;
                if (n < ng) {
                    let a = ash[n * DB + dl2];
                    let si = P.o_states + ((b * P.nchk + c) * P.Di + d2) * P.N + n0 + n;
                    var s = 0.0;
                    if (d2 < P.Di) {
                        if (c == 0u) { states[si] = 0.0; } else { s = states[si]; }   // written by this thread
                    }
                    for (var jj = 0u; jj < SEG; jj++) {
                        let i = jj * DB + dl2;
                        let xv = xs[n * XS + i];
                        xs[n * XS + i] = s;
                        s = exp(a * ssum[i]) * s + xv;
                    }
                    if (d2 < P.Di && c + 1u < P.nchk) { states[si + P.Di * P.N] = s; }
                }
            }
            workgroupBarrier();
            // C: every segment again, from its true start state
            for (var n = 0u; n < ng; n++) {
                let a = ash[n * DB + dl];
                var s = xs[n * XS + tid];
                for (var k = 0u; k < K; k++) {
                    let r = (j * K + k) * BS;
                    s = exp(dt[k] * a) * s + dtu[k] * bct[r + n];
                    yk[k] += s * bct[r + NG + n];
                }
            }
            workgroupBarrier();
        }
        for (var k = 0u; k < K; k++) {
            if (live && t0 + k < P.L) {
                let m = b * P.L + t0 + k;
                let z = xz[P.o_xz + m * 2u * P.Di + P.Di + d];
                y[P.o_y + m * P.Di + d] = (yk[k] + Dd * uu[k]) * silu(z);
            }
        }
    }
}

// ---------------------------------------------------------------- backward
// prep (m, d): du <- dy' = dy*silu(z);  dxz[:, Di+d] <- dy*silu'(z)   (finished by the scan)
@compute @workgroup_size(256)
fn selective_scan_backward_prep(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                                @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (i >= P.B * P.L * P.Di) { return; }
    let m = i / P.Di;
    let zi = m * 2u * P.Di + P.Di + i % P.Di;
    let z = xz[P.o_xz + zi];
    let sz = sigmoid(z);
    let g = dy[P.o_dy + i];
    du[P.o_du + i] = g * z * sz;
    dxz[P.o_dxz + zi] = g * sz * (1.0 + z * (1.0 - sz));
}

// Half of a butterfly stage: lanes whose bit `m` is set keep the upper half of v[0..2h),
// the others the lower half, and each adds its partner's copy of the half it keeps.
// Subgroup shuffles when the partner is in the same subgroup (m < qs), else workgroup memory.
fn bfly_stage(vin: array<f32, 16>, m: u32, h: u32, lane: u32, tid: u32, qs: u32) -> array<f32, 16> {
    var v = vin;
    let hi = (lane & m) != 0u;
    if (m < qs) {
        for (var i = 0u; i < h; i++) {
            let keep = select(v[i], v[i + h], hi);
            let send = select(v[i + h], v[i], hi);
            v[i] = keep + sg_xor(send, m);
        }
    } else {
        for (var i = 0u; i < h; i++) { red[i * WG + tid] = select(v[i + h], v[i], hi); }
        workgroupBarrier();
        for (var i = 0u; i < h; i++) { v[i] = select(v[i], v[i + h], hi) + red[i * WG + (tid ^ m)]; }
        workgroupBarrier();
    }
    return v;
}

// scan (b, block): du, ddelta WRITE; dxz[:, Di..] = (dy*silu'(z) from prep) * y_pre WRITE;
// dBm/dCm partial sums of the block -> pbc [2][M][nblk][N]; per-b partials of dA_log (over A),
// of dt_bias and of D into work (summed over b by selective_scan_accumulate).
// `work` holds, besides the parameters: a copy of `states` at off_st and the adjoint carried
// between chunks at off_hc.
@compute @workgroup_size(128)
fn selective_scan_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                           @builtin(local_invocation_index) tid: u32) {
    let wg = wid.x + wid.y * nwg.x;
    if (wg >= P.B * P.nblk) { return; }
    let b = wg / P.nblk;
    let blk = wg % P.nblk;
    let dl = tid % DB;
    let j = tid / DB;
    let d = blk * DB + dl;
    let live = d < P.Di;
    let dc = min(d, P.Di - 1u);
    let bias = work[off_bias() + dc];
    let Dd = work[off_D() + dc];
    let ngrp = (P.N + NG - 1u) / NG;

    // How many channel lanes of a segment share a subgroup laid out as lane = tid % size:
    // the butterfly shuffles across those and goes through workgroup memory beyond them.
    var qs = 1u;
    let sgs = sg_size();
    var okm = true;
    for (var m = 1u; m < DB; m <<= 1u) {
        let other = sg_xor_u(tid, m);
        if (m < sgs && other != (tid ^ m)) { okm = false; }
    }
    if (SUBGROUPS && okm) { qs = min(sgs, DB); }
    atomicMax(&qs_w, DB / qs);
    let QS = DB / workgroupUniformLoad(&qs_w);

    var bsum = 0.0;   // this thread's sum of ddelta (-> dt_bias)
    var dsum = 0.0;   // and of dy'*u (-> D)
    for (var cc = 0u; cc < P.nchk; cc++) {
        let c = P.nchk - 1u - cc;
        let t0 = c * T + j * K;
        var dt: array<f32, 8>;
        var dtu: array<f32, 8>;
        var uu: array<f32, 8>;
        var dyp: array<f32, 8>;
        var gb: array<f32, 8>;   // sum_n g*Bm      (du = dt*gb + D*dy')
        var gd: array<f32, 8>;   // d(dt)
        var yp: array<f32, 8>;   // sum_n s*Cm      (y_pre = yp + D*u)
        var sdt = 0.0;
        for (var k = 0u; k < K; k++) {
            var dv = 0.0;
            var uv = 0.0;
            var gv = 0.0;
            if (live && t0 + k < P.L) {
                let e = (b * P.L + t0 + k) * P.Di + d;
                dv = softplus(delta[P.o_delta + e] + bias);
                uv = u[P.o_u + e];
                gv = du[P.o_du + e];
            }
            dt[k] = dv;
            uu[k] = uv;
            dtu[k] = dv * uv;
            dyp[k] = gv;
            gb[k] = 0.0;
            gd[k] = 0.0;
            yp[k] = 0.0;
            sdt += dv;
        }
        for (var g = 0u; g < ngrp; g++) {
            let n0 = g * NG;
            let ng = min(NG, P.N - n0);
            load_group(b, c, blk, n0, ng, tid);
            workgroupBarrier();
            // A: the segment's end state from a zero start, and its adjoint total
            //    h = sum_k exp(A * (dt_0 + .. + dt_k)) * Cm_k * dy'_k  (what it passes to the left)
            for (var n = 0u; n < ng; n++) {
                let a = ash[n * DB + dl];
                var x = 0.0;
                var w = 1.0;
                var h = 0.0;
                for (var k = 0u; k < K; k++) {
                    let r = (j * K + k) * BS;
                    let e = exp(dt[k] * a);
                    x = e * x + dtu[k] * bct[r + n];
                    w = w * e;
                    h += w * bct[r + NG + n] * dyp[k];
                }
                xs[n * XS + tid] = x;
                hs[n * XS + tid] = h;
            }
            ssum[tid] = sdt;
            workgroupBarrier();
            // B: owners (dl2, n) carry the state rightwards from the saved chunk state and
            //    the adjoint leftwards from the next chunk's
            for (var q = 0u; q < 2u; q++) {
                let p = tid + q * WG;
                let n = p / DB;
                let dl2 = p % DB;
                let d2 = blk * DB + dl2;
                if (n < ng) {
                    let a = ash[n * DB + dl2];
                    let hci = P.off_hc + (b * P.Di + d2) * P.N + n0 + n;
                    var s = 0.0;
                    var hc = 0.0;
                    if (d2 < P.Di) {
                        s = work[P.off_st + ((b * P.nchk + c) * P.Di + d2) * P.N + n0 + n];
                        if (cc > 0u) { hc = work[hci]; }
                    }
                    var ea: array<f32, 8>;
                    for (var jj = 0u; jj < SEG; jj++) {
                        let i = jj * DB + dl2;
                        ea[jj] = exp(a * ssum[i]);
                        let xv = xs[n * XS + i];
                        xs[n * XS + i] = s;
                        s = ea[jj] * s + xv;
                    }
                    for (var jr = 0u; jr < SEG; jr++) {
                        let jj = SEG - 1u - jr;
                        let i = jj * DB + dl2;
                        let hv = hs[n * XS + i];
                        hs[n * XS + i] = hc;
                        hc = ea[jj] * hc + hv;
                    }
                    if (d2 < P.Di) { work[hci] = hc; }
                }
            }
            workgroupBarrier();
            // C: per state, the K steps forward (states) then backward (adjoint, gradients)
            for (var n = 0u; n < ng; n++) {
                let a = ash[n * DB + dl];
                var s = xs[n * XS + tid];
                var h = hs[n * XS + tid];
                var sp: array<f32, 8>;
                var ek: array<f32, 8>;
                for (var k = 0u; k < K; k++) {
                    ek[k] = exp(dt[k] * a);
                    sp[k] = s;
                    s = ek[k] * s + dtu[k] * bct[(j * K + k) * BS + n];
                }
                var v: array<f32, 16>;   // dBm (0..K) and dCm (K..2K) terms of this channel
                var da = 0.0;
                for (var kr = 0u; kr < K; kr++) {
                    let k = K - 1u - kr;
                    let r = (j * K + k) * BS;
                    let Bn = bct[r + n];
                    let Cn = bct[r + NG + n];
                    let gg = Cn * dyp[k] + h;
                    h = ek[k] * gg;
                    let qv = ek[k] * sp[k];
                    let sk = qv + dtu[k] * Bn;
                    gb[k] += gg * Bn;
                    gd[k] += gg * (a * qv + Bn * uu[k]);
                    yp[k] += sk * Cn;
                    v[k] = gg * dtu[k];
                    v[K + k] = sk * dyp[k];
                    da += gg * qv * dt[k];
                }
                xs[n * XS + tid] = da;   // this thread's slot, read above: reduced over segments below
                // sum v over the segment's DB channel lanes: lane dl ends with the total of v[dl]
                v = bfly_stage(v, 8u, 8u, dl, tid, QS);
                v = bfly_stage(v, 4u, 4u, dl, tid, QS);
                v = bfly_stage(v, 2u, 2u, dl, tid, QS);
                v = bfly_stage(v, 1u, 1u, dl, tid, QS);
                let t = c * T + j * K + dl % K;
                if (t < P.L) {
                    pbc[(dl / K) * P.pbc_half + ((b * P.L + t) * P.nblk + blk) * P.N + n0 + n] = v[0];
                }
            }
            workgroupBarrier();
            // dA_log partial of (b, d, n): sum over the segments, times A, over the chunks
            for (var q = 0u; q < 2u; q++) {
                let p = tid + q * WG;
                let n = p / DB;
                let dl2 = p % DB;
                let d2 = blk * DB + dl2;
                if (n < ng && d2 < P.Di) {
                    var sa = 0.0;
                    for (var jj = 0u; jj < SEG; jj++) { sa += xs[n * XS + jj * DB + dl2]; }
                    let pa = P.off_pa + (b * P.Di + d2) * P.N + n0 + n;
                    var prev = 0.0;
                    if (cc > 0u) { prev = work[pa]; }
                    work[pa] = prev + sa;
                }
            }
        }
        for (var k = 0u; k < K; k++) {
            if (live && t0 + k < P.L) {
                let m = b * P.L + t0 + k;
                let e = m * P.Di + d;
                du[P.o_du + e] = dt[k] * gb[k] + Dd * dyp[k];
                let dd = gd[k] * sigmoid(delta[P.o_delta + e] + bias);
                ddelta[P.o_ddelta + e] = dd;
                let zi = P.o_dxz + m * 2u * P.Di + P.Di + d;
                dxz[zi] = dxz[zi] * (yp[k] + Dd * uu[k]);
                bsum += dd;
                dsum += dyp[k] * uu[k];
            }
        }
    }
    // dt_bias and D partials of (b, d): sum over the segments
    workgroupBarrier();
    xs[tid] = bsum;
    hs[tid] = dsum;
    workgroupBarrier();
    if (tid < DB && live) {
        var sb = 0.0;
        var sd = 0.0;
        for (var jj = 0u; jj < SEG; jj++) {
            sb += xs[jj * DB + tid];
            sd += hs[jj * DB + tid];
        }
        work[P.off_pb + b * P.Di + d] = sb;
        work[P.off_pd + b * P.Di + d] = sd;
    }
}

// dbc (m, n): dxdbl[m, R+n] = sum over the channel blocks of the dBm partials; dCm likewise
@compute @workgroup_size(256)
fn selective_scan_backward_dbc(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                               @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * 256u + lid;
    let M = P.B * P.L;
    if (i >= M * P.N) { return; }
    let m = i / P.N;
    let n = i % P.N;
    var sb = 0.0;
    var sc = 0.0;
    for (var q = 0u; q < P.nblk; q++) {
        let o = (m * P.nblk + q) * P.N + n;
        sb += pbc[o];
        sc += pbc[P.pbc_half + o];
    }
    let row = P.o_dxdbl + m * P.ldx + P.R;
    dxdbl[row + n] = sb;
    dxdbl[row + P.N + n] = sc;
}

// accumulate: acc_out[o_out + i] += sum_k work[base + k*stride + i] (* A)   (parameter gradients)
@compute @workgroup_size(256)
fn selective_scan_accumulate(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                             @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (i >= Q.n) { return; }
    var acc = 0.0;
    for (var k = 0u; k < Q.K; k++) { acc += work[Q.base + k * Q.stride + i]; }
    if (Q.scale_a != 0u) { acc *= -exp(work[i]); }
    acc_out[Q.o_out + i] = acc_out[Q.o_out + i] + acc;
}
