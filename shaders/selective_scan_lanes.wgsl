// requires: subgroups
// selective_scan_lanes: the selective scan of shaders/selective_scan.wgsl (the same
// parameters, bindings, saved states and partial sums; its dbc and accumulate entry points
// finish the backward) for CPU adapters such as lavapipe, where a workgroup runs as one SIMD
// vector of 8 lanes, a barrier switches coroutines and every load whose address differs
// between lanes is a gather.  A workgroup is one 8-lane subgroup, lane l owns channel
// blk*8 + l of batch row b and walks the sequence step by step with its NS states in
// registers (the loops over states are unrolled: NS is a pipeline constant, the state size):
//   s_t = exp(dt_t*A) s_{t-1} + dt_t*Bm_t*u_t ;  y_t = (sum_n s_t*Cm_t + D*u_t) * silu(z_t)
// Bm_t and Cm_t are the same for every lane: each lane loads 2NS/8 of them and takes the rest
// by subgroup shuffle.  The forward saves the state before every chunk of T steps; the
// backward walks the chunks in reverse, recomputes the chunk's states into `hist` and runs
// the adjoint h_t = Cm_t*dy'_t + exp(dt_{t+1}A) h_{t+1} backwards through them.
// engine/ops/scan.py uses it where the subgroup is these 8 lanes and NS <= 16, NS % 4 == 0.

struct Params {
    B: u32, L: u32, Di: u32, N: u32,
    R: u32, ldx: u32, nchk: u32, nblk: u32,
    o_y: u32, o_u: u32, o_delta: u32, o_xdbl: u32,
    o_xz: u32, o_states: u32, o_dy: u32, o_du: u32,
    o_ddelta: u32, o_dxz: u32, o_dxdbl: u32, off_st: u32,
    off_hc: u32, off_pa: u32, off_pb: u32, off_pd: u32,
    pbc_half: u32, _p0: u32, _p1: u32, _p2: u32,
}

@group(0) @binding(0) var<storage, read_write> y: array<f32>;
@group(0) @binding(1) var<storage, read_write> states: array<f32>;
@group(0) @binding(2) var<storage, read> u: array<f32>;
@group(0) @binding(3) var<storage, read> delta: array<f32>;
@group(0) @binding(4) var<storage, read> xdbl: array<f32>;
@group(0) @binding(5) var<storage, read> xz: array<f32>;
@group(0) @binding(6) var<storage, read_write> work: array<f32>;
@group(0) @binding(8) var<storage, read_write> du: array<f32>;
@group(0) @binding(9) var<storage, read_write> ddelta: array<f32>;
@group(0) @binding(10) var<storage, read_write> dxz: array<f32>;
@group(0) @binding(11) var<storage, read_write> pbc: array<f32>;
@group(0) @binding(14) var<uniform> P: Params;

override NS: u32 = 16u;   // the state size N
const T: u32 = 64u;       // steps per chunk = CHUNK in engine/ops/scan.py
const SMAX: u32 = 16u;

struct Lane { b: u32, blk: u32, d: u32, dc: u32, live: bool }

fn lane_of(wid: vec3<u32>, nwg: vec3<u32>, l: u32) -> Lane {
    let wg = wid.x + wid.y * nwg.x;
    let blk = wg % P.nblk;
    let d = blk * 8u + l;
    return Lane(wg / P.nblk, blk, d, min(d, P.Di - 1u), d < P.Di && wg < P.B * P.nblk);
}

// Bm (q = 0) or Cm (q = 1) of row m, state n: lane l holds entries 8i + l of the row's 2NS
fn bc_load(m: u32, l: u32) -> vec4<f32> {
    let row = P.o_xdbl + m * P.ldx + P.R + l;
    return vec4<f32>(xdbl[row], xdbl[row + 8u], xdbl[row + 16u], xdbl[row + 24u]);
}
fn bc_get(v: vec4<f32>, i: u32) -> f32 {   // entry i (0 <= i < 2NS) of the row, from its owner
    return subgroupShuffle(v[i / 8u], i % 8u);
}

@compute @workgroup_size(8)
fn scan_lanes_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_index) l: u32) {
    let ln = lane_of(wid, nwg, l);
    if (wid.x + wid.y * nwg.x >= P.B * P.nblk) { return; }
    let bias = work[P.Di * P.N + ln.dc];
    let Dd = work[P.Di * P.N + P.Di + ln.dc];
    var a: array<f32, SMAX>;
    var s: array<f32, SMAX>;
    for (var n = 0u; n < NS; n++) { a[n] = -exp(work[ln.dc * NS + n]); s[n] = 0.0; }
    for (var t = 0u; t < P.L; t++) {
        let m = ln.b * P.L + t;
        if (t % T == 0u && ln.live) {
            let base = P.o_states + ((ln.b * P.nchk + t / T) * P.Di + ln.d) * NS;
            for (var n = 0u; n < NS; n++) { states[base + n] = s[n]; }
        }
        let e = m * P.Di + ln.dc;
        let dt = softplus(delta[P.o_delta + e] + bias);
        let uu = u[P.o_u + e];
        let bc = bc_load(m, l);
        var yp = 0.0;
        for (var n = 0u; n < NS; n++) {
            s[n] = fma(exp(dt * a[n]), s[n], dt * uu * bc_get(bc, n));
            yp = fma(s[n], bc_get(bc, NS + n), yp);
        }
        if (ln.live) {
            y[P.o_y + m * P.Di + ln.d] = fma(Dd, uu, yp) * silu(xz[P.o_xz + m * 2u * P.Di + P.Di + ln.d]);
        }
    }
}

// After selective_scan_backward_prep (du = dy', dxz[:, Di..] = dy*silu'(z)), with the saved
// states copied into work at off_st: du, ddelta WRITE; dxz[:, Di..] WRITE; dBm/dCm partial
// sums of the 8 channels -> pbc [2][M][nblk][N]; dA_log (over A), dt_bias and D partials of
// (b, d) into work.
@compute @workgroup_size(8)
fn scan_lanes_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                       @builtin(local_invocation_index) l: u32) {
    let ln = lane_of(wid, nwg, l);
    if (wid.x + wid.y * nwg.x >= P.B * P.nblk) { return; }
    let bias = work[P.Di * P.N + ln.dc];
    let Dd = work[P.Di * P.N + P.Di + ln.dc];
    var a: array<f32, SMAX>;
    var s: array<f32, SMAX>;
    var h: array<f32, SMAX>;    // adjoint of the state, entering from the right
    var da: array<f32, SMAX>;   // sum of h * dt * exp(dt*A) * s_prev   (-> dA_log)
    var hist: array<f32, 1040>; // [T + 1][SMAX]: the chunk's states, row 0 the one before it
    for (var n = 0u; n < NS; n++) { a[n] = -exp(work[ln.dc * NS + n]); h[n] = 0.0; da[n] = 0.0; }
    var sumb = 0.0;   // sum of ddelta (-> dt_bias)
    var sumd = 0.0;   // sum of dy'*u (-> D)
    for (var cc = 0u; cc < P.nchk; cc++) {
        let c = P.nchk - 1u - cc;
        let t0 = c * T;
        let nt = min(T, P.L - t0);
        let base = P.off_st + ((ln.b * P.nchk + c) * P.Di + ln.dc) * NS;   // the states' copy
        for (var n = 0u; n < NS; n++) { s[n] = work[base + n]; hist[n] = s[n]; }
        for (var k = 0u; k < nt; k++) {
            let m = ln.b * P.L + t0 + k;
            let e = m * P.Di + ln.dc;
            let dt = softplus(delta[P.o_delta + e] + bias);
            let uu = u[P.o_u + e];
            let bc = bc_load(m, l);
            for (var n = 0u; n < NS; n++) {
                s[n] = fma(exp(dt * a[n]), s[n], dt * uu * bc_get(bc, n));
                hist[(k + 1u) * SMAX + n] = s[n];
            }
        }
        for (var kk = 0u; kk < nt; kk++) {
            let k = nt - 1u - kk;
            let m = ln.b * P.L + t0 + k;
            let e = m * P.Di + ln.dc;
            let draw = delta[P.o_delta + e] + bias;
            let dt = softplus(draw);
            let uu = select(0.0, u[P.o_u + e], ln.live);
            let g = select(0.0, du[P.o_du + e], ln.live);   // dy' = dy * silu(z), from the prep pass
            let bc = bc_load(m, l);
            var ddt = 0.0;
            var dus = 0.0;
            var yp = 0.0;
            var wb = vec2<f32>(0.0);   // this lane's share of the channel sums: dBm, dCm entries l, 8 + l
            var wc = vec2<f32>(0.0);
            for (var n = 0u; n < NS; n++) {
                let bn = bc_get(bc, n);
                let cn = bc_get(bc, NS + n);
                let sn = hist[(k + 1u) * SMAX + n];
                let sp = hist[k * SMAX + n];
                let hn = fma(cn, g, h[n]);
                let ex = exp(dt * a[n]);
                let q = ex * sp;
                ddt = fma(hn, fma(a[n], q, bn * uu), ddt);
                dus = fma(hn, bn, dus);
                da[n] = fma(hn * dt, q, da[n]);
                yp = fma(sn, cn, yp);
                let rb = subgroupAdd(hn * dt * uu);
                let rc = subgroupAdd(sn * g);
                if (n % 8u == l) {
                    wb[n / 8u] = rb;
                    wc[n / 8u] = rc;
                }
                h[n] = hn * ex;
            }
            if (ln.live) {
                du[P.o_du + e] = fma(dt, dus, Dd * g);
                let dd = ddt * sigmoid(draw);
                ddelta[P.o_ddelta + e] = dd;
                let zi = P.o_dxz + m * 2u * P.Di + P.Di + ln.d;
                dxz[zi] = dxz[zi] * fma(Dd, uu, yp);   // (dy * silu'(z) from the prep pass) * y_pre
                sumb += dd;
                sumd += g * uu;
            }
            let pb = (m * P.nblk + ln.blk) * NS;
            for (var i = 0u; i < 2u; i++) {
                if (i * 8u + l < NS) {
                    pbc[pb + i * 8u + l] = wb[i];
                    pbc[P.pbc_half + pb + i * 8u + l] = wc[i];
                }
            }
        }
    }
    if (ln.live) {
        let pa = P.off_pa + (ln.b * P.Di + ln.d) * NS;
        for (var n = 0u; n < NS; n++) { work[pa + n] = da[n]; }
        work[P.off_pb + ln.b * P.Di + ln.d] = sumb;
        work[P.off_pd + ln.b * P.Di + ln.d] = sumd;
    }
}
