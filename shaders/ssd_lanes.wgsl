// requires: subgroups
// Mamba-2's SSD scan on CPU adapters (lavapipe): the recurrence walked step by step, the
// same results and saved states as shaders/ssd_scan.wgsl's chunked form (engine/kernels/ssd.py
// takes these kernels where `ssd_lanes` says so).  Per head h (A = -exp(A_log_h), one scalar),
// channel d = h*P + p and state n:
//   s_t[n] = exp(dt_t A) s_{t-1}[n] + dt_t x_t B_t[n] ;  y_t = sum_n s_t[n] C_t[n] + D_h x_t
// A workgroup is one 8-lane subgroup (one SIMD vector): lane l owns channel blk*8 + l of
// sequence b (P % 8 == 0, so the 8 lanes share a head, its dt and its group's B and C) and
// keeps NQ*4 states (a pass: 16 states, or all of N <= 16) in four vec4 variables.  B_t|C_t
// of the pass are loaded as one vec4 a lane (lanes 0..3 B, 4..7 C) and shared by subgroup
// broadcast.  N > 16 runs in passes of 16 states, one dispatch each (PASS, a pipeline
// constant): the states are independent, only y, dx and the ddt terms add up over passes.
// Saved states as ssd_scan.wgsl's: states[b, c] (the state before step c*Q), states[b, NC]
// the final one, [nb, NC + 1, H, P, N].
//
// Backward, per pass, two walks and no state history.  Walk 1 runs the recurrence again from
// zero and takes what needs the states:
//   dC_t += dy_t s_t                            summed over the 8 lanes -> pbc
//   dy_t (s_t . C_t)   (the pass's share of dy_t (y_t - D x_t))  -> part, for walk 2
// Walk 2 runs back from the end with the adjoint g_t = C_t dy_t + exp(dt_{t+1} A) g_{t+1}:
//   dx_t += dt_t (g_t . B_t) (+ D dy_t)        -> dxbc[:, d]
//   dB_t += dt_t x_t g_t                        summed over the 8 lanes -> pbc
// and the decay's gradient R_t = exp(dt_t A) (g_t . s_{t-1}) as a sum of later terms,
//   R_t = sum_{k>=t} r_k,  r_k = dy_k (s_k . C_k) - dt_k x_k (g_k . B_k)
// (ssd_scan.wgsl's ssd_dt_chunk sums the same terms), started from g . S at each chunk's end (its
// saved state S), so that no sum runs longer than a chunk:
//   ddt terms  A R_t + x_t (g_t . B_t)        -> part [passes, M, Di] (summed over p and passes)
//   dA_log terms A sum_t dt_t R_t, dD terms sum_t dy_t x_t -> part
// pbc is [passes, M, nblk, 2, 4 NQ] (dB | dC); ssd_lanes_finish sums it over a group's
// blocks (dB, dC) and part over a head (ddt).

struct SL { nb: u32, L: u32, NC: u32, nblk: u32,
            o_y: u32, o_st: u32, o_x: u32, o_dt: u32, o_A: u32, o_D: u32, o_dy: u32, o_dx: u32,
            o_ddt: u32, o_pa: u32, o_pd: u32, total: u32 }

@group(0) @binding(0) var<storage, read_write> l_y: array<f32>;
@group(0) @binding(1) var<storage, read_write> l_st: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> l_sr: array<vec4<f32>>;     // the backward's view
@group(0) @binding(2) var<storage, read> l_x: array<vec4<f32>>;      // xbc [M, C]
@group(0) @binding(3) var<storage, read> l_dt: array<f32>;           // dt [M, H]
@group(0) @binding(4) var<storage, read> l_A: array<f32>;            // A_log [H]
@group(0) @binding(5) var<storage, read> l_D: array<f32>;            // D [H]
@group(0) @binding(6) var<uniform> U: SL;
@group(0) @binding(7) var<storage, read> l_dy: array<f32>;           // dy [M, Di]
@group(0) @binding(8) var<storage, read_write> l_dx: array<f32>;     // dxbc [M, C]
@group(0) @binding(9) var<storage, read_write> l_pbc: array<vec4<f32>>;   // [passes, M, nblk, 2, 4 NQ]
@group(0) @binding(10) var<storage, read_write> l_part: array<f32>;  // [M, Di] | dA_log | dD terms
@group(0) @binding(11) var<storage, read_write> l_ddt: array<f32>;   // ddt [M, H]

override H: u32 = 1u;
override P: u32 = 8u;
override N: u32 = 4u;
override G: u32 = 1u;
override Q: u32 = 64u;
override NQ: u32 = 1u;     // vec4 groups of states per pass: min(N, 16) / 4
override PASS: u32 = 0u;   // states 16*PASS .. 16*PASS + 4*NQ - 1
override Di: u32 = H * P;
override C: u32 = H * P + 2u * G * N;

struct Lane { b: u32, blk: u32, d: u32, h: u32, a: f32, D: f32, bc: u32 }

// lane l's sequence, block, channel, head, A, D, and the vec4 of a row's xbc it loads
// (B's 4q..4q+3 for l = q < 4, C's for l = 4 + q; lanes past NQ load a valid one)
fn lane_of(u: SL, wg: u32, l: u32) -> Lane {
    let blk = wg % u.nblk;
    let d = blk * 8u + l;
    let h = d / P;
    let g = h / (H / G);
    let q = min(l % 4u, NQ - 1u);
    let col = Di + select(g, G + g, l >= 4u) * N + 16u * PASS + 4u * q;
    return Lane(wg / u.nblk, blk, d, h, -exp(l_A[u.o_A + h]), l_D[u.o_D + h], col / 4u);
}

// x_t of the lane's channel (row m of xbc)
fn x_of(u: SL, m: u32, d: u32) -> f32 {
    let i = u.o_x + m * C + d;
    return l_x[i / 4u][i % 4u];
}
fn bc_of(u: SL, m: u32, ln: Lane) -> vec4<f32> { return l_x[(u.o_x + m * C) / 4u + ln.bc]; }
// B's entries 4q..4q+3 of the pass (lane q's vec4), C's (lane 4 + q's)
fn b4(v: vec4<f32>, q: u32) -> vec4<f32> { return sg_shuffle4(v, q); }
fn c4(v: vec4<f32>, q: u32) -> vec4<f32> { return sg_shuffle4(v, 4u + q); }
// the vec4 index of states[b, c] entry (d, 16*PASS + 4q)
fn st4(u: SL, b: u32, c: u32, d: u32, q: u32) -> u32 {
    return (u.o_st + ((b * (u.NC + 1u) + c) * Di + d) * N + 16u * PASS) / 4u + q;
}

@compute @workgroup_size(8)
fn ssd_lanes_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) l: u32) {
    let u = U;   // read once, before any loop (a uniform read in a loop is a gather on lavapipe)
    let wg = wid.x + wid.y * nwg.x;
    if (wg >= u.nb * u.nblk) { return; }
    let ln = lane_of(u, wg, l);
    var s0 = vec4<f32>(0.0); var s1 = vec4<f32>(0.0); var s2 = vec4<f32>(0.0); var s3 = vec4<f32>(0.0);
    for (var c = 0u; c < u.NC; c++) {
        // the chunk states are stored outside the step loop (an `if` in it runs masked on every pass)
        let sb = st4(u, ln.b, c, ln.d, 0u);
        l_st[sb] = s0;
        if (NQ > 1u) { l_st[sb + 1u] = s1; }
        if (NQ > 2u) { l_st[sb + 2u] = s2; }
        if (NQ > 3u) { l_st[sb + 3u] = s3; }
        for (var t = c * Q; t < min(u.L, c * Q + Q); t++) {
            let m = ln.b * u.L + t;
            let dt = l_dt[u.o_dt + m * H + ln.h];
            let x = x_of(u, m, ln.d);
            let bc = bc_of(u, m, ln);
            let e = vec4<f32>(exp(dt * ln.a));
            let dx = vec4<f32>(dt * x);
            s0 = fma(e, s0, dx * b4(bc, 0u));
            var yp = dot(s0, c4(bc, 0u));
            if (NQ > 1u) { s1 = fma(e, s1, dx * b4(bc, 1u)); yp += dot(s1, c4(bc, 1u)); }
            if (NQ > 2u) { s2 = fma(e, s2, dx * b4(bc, 2u)); yp += dot(s2, c4(bc, 2u)); }
            if (NQ > 3u) { s3 = fma(e, s3, dx * b4(bc, 3u)); yp += dot(s3, c4(bc, 3u)); }
            let o = u.o_y + m * Di + ln.d;
            if (PASS == 0u) { l_y[o] = fma(ln.D, x, yp); } else { l_y[o] = l_y[o] + yp; }
        }
    }
    let sb = st4(u, ln.b, u.NC, ln.d, 0u);
    l_st[sb] = s0;
    if (NQ > 1u) { l_st[sb + 1u] = s1; }
    if (NQ > 2u) { l_st[sb + 2u] = s2; }
    if (NQ > 3u) { l_st[sb + 3u] = s3; }
}

// of four vectors per lane, the sum over the 8 lanes of the one of lane l % 4 (lanes l and
// l + 4 get the same): a reduce-scatter of subgroup shuffles (4 instead of 4 butterflies' 12)
fn lsum_q(v0: vec4<f32>, v1: vec4<f32>, v2: vec4<f32>, v3: vec4<f32>, l: u32) -> vec4<f32> {
    let o = (l & 1u) != 0u;
    let a = select(v0, v1, o) + sg_xor4(select(v1, v0, o), 1u);
    let b = select(v2, v3, o) + sg_xor4(select(v3, v2, o), 1u);
    let t = (l & 2u) != 0u;
    let c = select(a, b, t) + sg_xor4(select(b, a, t), 2u);
    return c + sg_xor4(c, 4u);
}

@compute @workgroup_size(8)
fn ssd_lanes_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_index) l: u32) {
    let u = U;
    let wg = wid.x + wid.y * nwg.x;
    if (wg >= u.nb * u.nblk) { return; }
    let ln = lane_of(u, wg, l);
    let lq = l % 4u;
    let z = vec4<f32>(0.0);
    // the pbc entry of lane l at row m: dB's 4lq.. (part 0, lanes 0..3) or dC's (part 1, lanes 4..7)
    let pb = ((PASS * u.nb * u.L + ln.b * u.L) * u.nblk + ln.blk) * 2u * NQ + select(0u, NQ, l >= 4u) + lq;
    let pstride = u.nblk * 2u * NQ;
    let pp = PASS * u.nb * u.L * Di + ln.d;   // the lane's column of the pass's part [M, Di]
    // 1. forward: the states again from zero
    var s0 = z; var s1 = z; var s2 = z; var s3 = z;
    var sd = 0.0;   // sum of dy x: the lane's dD term
    for (var t = 0u; t < u.L; t++) {
        let m = ln.b * u.L + t;
        let dt = l_dt[u.o_dt + m * H + ln.h];
        let x = x_of(u, m, ln.d);
        let bc = bc_of(u, m, ln);
        let dy = l_dy[u.o_dy + m * Di + ln.d];
        let e = vec4<f32>(exp(dt * ln.a));
        let dx = vec4<f32>(dt * x);
        let vy = vec4<f32>(dy);
        s0 = fma(e, s0, dx * b4(bc, 0u));
        if (NQ > 1u) { s1 = fma(e, s1, dx * b4(bc, 1u)); }
        if (NQ > 2u) { s2 = fma(e, s2, dx * b4(bc, 2u)); }
        if (NQ > 3u) { s3 = fma(e, s3, dx * b4(bc, 3u)); }
        var yp = dot(s0, c4(bc, 0u));
        if (NQ > 1u) { yp += dot(s1, c4(bc, 1u)); }
        if (NQ > 2u) { yp += dot(s2, c4(bc, 2u)); }
        if (NQ > 3u) { yp += dot(s3, c4(bc, 3u)); }
        l_part[pp + m * Di] = dy * yp;   // the pass's share of dy (y - D x), for walk 2
        let rc = lsum_q(s0 * vy, s1 * vy, s2 * vy, s3 * vy, l);
        if (l >= 4u && lq < NQ) { l_pbc[pb + t * pstride] = rc; }
        if (PASS == 0u) { sd = fma(dy, x, sd); }
    }
    // 2. back from the end: the adjoint g, and R from g . S at each chunk's end
    var g0 = z; var g1 = z; var g2 = z; var g3 = z;
    var sa = 0.0;   // sum of dt R: the lane's dA term (times A at the end)
    for (var cc = 0u; cc < u.NC; cc++) {
        let c = u.NC - 1u - cc;
        let t0 = c * Q;
        let nt = min(Q, u.L - t0);
        let sb = st4(u, ln.b, c + 1u, ln.d, 0u);
        var R = dot(g0, l_sr[sb]);
        if (NQ > 1u) { R += dot(g1, l_sr[sb + 1u]); }
        if (NQ > 2u) { R += dot(g2, l_sr[sb + 2u]); }
        if (NQ > 3u) { R += dot(g3, l_sr[sb + 3u]); }
        for (var kk = 0u; kk < nt; kk++) {
            let t = t0 + nt - 1u - kk;
            let m = ln.b * u.L + t;
            let dt = l_dt[u.o_dt + m * H + ln.h];
            let x = x_of(u, m, ln.d);
            let bc = bc_of(u, m, ln);
            let dy = l_dy[u.o_dy + m * Di + ln.d];
            let ee = exp(dt * ln.a);
            let vy = vec4<f32>(dy);
            g0 = fma(c4(bc, 0u), vy, g0);
            var gb = dot(g0, b4(bc, 0u));
            if (NQ > 1u) { g1 = fma(c4(bc, 1u), vy, g1); gb += dot(g1, b4(bc, 1u)); }
            if (NQ > 2u) { g2 = fma(c4(bc, 2u), vy, g2); gb += dot(g2, b4(bc, 2u)); }
            if (NQ > 3u) { g3 = fma(c4(bc, 3u), vy, g3); gb += dot(g3, b4(bc, 3u)); }
            let dtx = dt * x;
            let op = pp + m * Di;
            R += fma(-dtx, gb, l_part[op]);
            sa = fma(dt, R, sa);
            let ddt = fma(ln.a, R, x * gb);
            let od = u.o_dx + m * C + ln.d;
            if (PASS == 0u) { l_dx[od] = fma(dt, gb, ln.D * dy); } else { l_dx[od] = fma(dt, gb, l_dx[od]); }
            l_part[op] = ddt;
            let vd = vec4<f32>(dtx);
            let rb = lsum_q(g0 * vd, g1 * vd, g2 * vd, g3 * vd, l);
            if (l < 4u && lq < NQ) { l_pbc[pb + t * pstride] = rb; }
            let e = vec4<f32>(ee);
            g0 *= e; g1 *= e; g2 *= e; g3 *= e;
        }
    }
    l_part[u.o_pa + (PASS * u.nb + ln.b) * Di + ln.d] = ln.a * sa;
    if (PASS == 0u) { l_part[u.o_pd + ln.b * Di + ln.d] = sd; }
}

// dxbc's B and C columns (the sums of pbc over the group's channel blocks) and ddt [M, H]
// (the sums of part over the head's P channels): a workgroup of 8 lanes per row m, lane l
// summing vec4s 4l.. of the row's 2GN B|C columns (strided by 8 vec4s) and heads l, l + 8, ..
// (an invocation per column, summing scalars strided over blocks, took 0.39 ms a layer at
// mamba2-tiny, B 1, L 256)
@group(0) @binding(8) var<storage, read_write> l_dx4: array<vec4<f32>>;
@group(0) @binding(10) var<storage, read_write> l_part4: array<vec4<f32>>;

@compute @workgroup_size(8)
fn ssd_lanes_finish(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) l: u32) {
    let u = U;
    let m = wid.x + wid.y * nwg.x;
    if (m >= u.total) { return; }
    let nbg = Di / G / 8u;
    let NV = N / 4u;            // vec4s of one group's B (or C)
    for (var j = l; j < 2u * G * NV; j += 8u) {   // j: vec4 j of the row's B|C columns
        let part = j / (G * NV);
        let g = (j % (G * NV)) / NV;
        let q = j % NV;
        let ps = q / NQ;   // the pass of these states
        var s = vec4<f32>(0.0);
        for (var k = 0u; k < nbg; k++) {
            s += l_pbc[(((ps * u.nb * u.L + m) * u.nblk + g * nbg + k) * 2u + part) * NQ + q % NQ];
        }
        l_dx4[(u.o_dx + m * C + Di) / 4u + j] = s;
    }
    for (var h = l; h < H; h += 8u) {
        var s = vec4<f32>(0.0);
        for (var ps = 0u; ps < max(1u, N / 16u); ps++) {
            for (var p = 0u; p < P / 4u; p++) { s += l_part4[((ps * u.total + m) * Di + h * P) / 4u + p]; }
        }
        l_ddt[u.o_ddt + m * H + h] = (s.x + s.y) + (s.z + s.w);
    }
}

// ---------------------------------------------------------------- the gated RMS norm (CPU adapters)
// gnorm_forward / gnorm_backward of shaders/ssd.wgsl (the same parameters and results) as a
// workgroup of 8 lanes per (row m, group g) instead of an invocation: lane l reads channels
// 4l..4l+3 of each 32 as one vec4 (row-major rows make an invocation per row a gather over
// rows) and the lanes sum by shuffles.  ssd.py takes them where Di, W, Di/G and every
// offset are multiples of 4.
struct SP { B: u32, L: u32, H: u32, P: u32, N: u32, G: u32, Q: u32, NC: u32,
            C: u32, Di: u32, W: u32, nrows: u32,
            o0: u32, o1: u32, o2: u32, o3: u32, o4: u32, o5: u32, o6: u32, o7: u32,
            lo: f32, hi: f32, eps: f32, acc: u32 }

@group(0) @binding(0) var<storage, read_write> g_out4: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> g_rstd: array<f32>;
@group(0) @binding(2) var<storage, read> g_y4: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> g_zx4: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> g_w4: array<vec4<f32>>;
@group(0) @binding(5) var<uniform> UG: SP;

fn silu4(x: vec4<f32>) -> vec4<f32> { return x / (1.0 + exp(-x)); }
fn dsilu4(p: vec4<f32>) -> vec4<f32> { let s = 1.0 / (1.0 + exp(-p)); return s * (1.0 + p * (1.0 - s)); }
fn sum4(v: vec4<f32>) -> f32 { return (v.x + v.y) + (v.z + v.w); }

@compute @workgroup_size(8)
fn gnorm_lanes_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                       @builtin(local_invocation_index) l: u32) {
    let u = UG;
    let i = wid.x + wid.y * nwg.x;
    if (i >= u.nrows * u.G) { return; }
    let m = i / u.G;
    let S = u.Di / u.G;
    let c0 = (i % u.G) * S;
    let yb = (u.o2 + m * u.Di + c0) / 4u;
    let zb = (u.o3 + m * u.W + c0) / 4u;
    var acc = vec4<f32>(0.0);
    for (var q = l; q < S / 4u; q += 8u) {
        let v = g_y4[yb + q] * silu4(g_zx4[zb + q]);
        acc = fma(v, v, acc);
    }
    let r = inverseSqrt(lanes_sum8(sum4(acc)) / f32(S) + u.eps);
    if (l == 0u) { g_rstd[u.o1 + i] = r; }
    let ob = (u.o0 + m * u.Di + c0) / 4u;
    let wb = (u.o4 + c0) / 4u;
    for (var q = l; q < S / 4u; q += 8u) {
        let v = g_y4[yb + q] * silu4(g_zx4[zb + q]);
        g_out4[ob + q] = g_w4[wb + q] * (v * r);
    }
}

@group(0) @binding(0) var<storage, read> h_dout4: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> h_y4: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> h_zx4: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> h_w4: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> h_rstd: array<f32>;
@group(0) @binding(5) var<storage, read_write> h_dy4: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read_write> h_dzx4: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read_write> h_part4: array<vec4<f32>>;
@group(0) @binding(8) var<uniform> UH: SP;

@compute @workgroup_size(8)
fn gnorm_lanes_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                        @builtin(local_invocation_index) l: u32) {
    let u = UH;
    let i = wid.x + wid.y * nwg.x;
    if (i >= u.nrows * u.G) { return; }
    let m = i / u.G;
    let S = u.Di / u.G;
    let c0 = (i % u.G) * S;
    let r = h_rstd[u.o4 + i];
    let ob = (u.o0 + m * u.Di + c0) / 4u;
    let yb = (u.o1 + m * u.Di + c0) / 4u;
    let zb = (u.o2 + m * u.W + c0) / 4u;
    let wb = (u.o3 + c0) / 4u;
    var acc = vec4<f32>(0.0);
    for (var q = l; q < S / 4u; q += 8u) {
        let v = h_y4[yb + q] * silu4(h_zx4[zb + q]);
        acc = fma(h_dout4[ob + q] * h_w4[wb + q], v, acc);
    }
    let k = r * r * r * lanes_sum8(sum4(acc)) / f32(S);
    let db = (u.o5 + m * u.Di + c0) / 4u;
    let dzb = (u.o6 + m * u.W + c0) / 4u;
    let pb = (u.o7 + m * u.Di + c0) / 4u;
    for (var q = l; q < S / 4u; q += 8u) {
        let z = h_zx4[zb + q];
        let y = h_y4[yb + q];
        let sz = silu4(z);
        let v = y * sz;
        let go = h_dout4[ob + q];
        let dv = r * go * h_w4[wb + q] - v * k;
        h_dy4[db + q] = dv * sz;
        h_dzx4[dzb + q] = dv * y * dsilu4(z);
        h_part4[pb + q] = go * v * r;
    }
}
