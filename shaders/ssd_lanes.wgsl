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
// Backward, per pass: the chunks in reverse, each one's states recomputed into `hist` from
// its saved state, then the adjoint g_t = C_t dy_t + exp(dt_{t+1} A) g_{t+1}:
//   dx_t += dt_t (g_t . B_t) (+ D dy_t)        -> dxbc[:, d]
//   ddt terms  exp(dt A) A (g_t . s_{t-1}) + x_t (g_t . B_t)   -> part [M, Di] (summed over p)
//   dB_t += dt_t x_t g_t, dC_t += dy_t s_t      summed over the 8 lanes -> pbc [passes, M, nblk, 2, 4 NQ]
//   dA_log terms A sum_t dt_t exp(dt_t A) (g_t . s_{t-1}), dD terms sum_t dy_t x_t -> part
// and ssd_lanes_finish sums pbc over a group's blocks (dB, dC) and part over a head (ddt).

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

// the sum over the 8 lanes, in every lane (a butterfly of subgroup shuffles)
fn lsum4(v: vec4<f32>) -> vec4<f32> {
    let a = v + sg_xor4(v, 1u);
    let b = a + sg_xor4(a, 2u);
    return b + sg_xor4(b, 4u);
}
// of four uniform vectors, the one of lane l % 4
fn quad(v0: vec4<f32>, v1: vec4<f32>, v2: vec4<f32>, v3: vec4<f32>, l: u32) -> vec4<f32> {
    let q = l % 4u;
    return select(select(v3, v2, q == 2u), select(v1, v0, q == 0u), q < 2u);
}

// one step of the adjoint for states 4q..4q+3: g the adjoint entering from the right
// (already times the next step's decay), sn / sp the state after / before the step
struct Adj { g: vec4<f32>, rb: vec4<f32>, rc: vec4<f32>, sums: vec3<f32> }
fn adj4(bn: vec4<f32>, cn: vec4<f32>, sn: vec4<f32>, sp: vec4<f32>, g: vec4<f32>, dy: f32, dtx: f32) -> Adj {
    let gn = fma(cn, vec4<f32>(dy), g);
    return Adj(gn, lsum4(gn * dtx), lsum4(sn * dy), vec3<f32>(dot(gn, sp), dot(gn, bn), 0.0));
}

@compute @workgroup_size(8)
fn ssd_lanes_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_index) l: u32) {
    let u = U;
    let wg = wid.x + wid.y * nwg.x;
    if (wg >= u.nb * u.nblk) { return; }
    let ln = lane_of(u, wg, l);
    var g0 = vec4<f32>(0.0); var g1 = vec4<f32>(0.0); var g2 = vec4<f32>(0.0); var g3 = vec4<f32>(0.0);
    var hist: array<vec4<f32>, 260>;   // [Q + 1][4]: the chunk's states, row 0 the one before it
    // the chunk's dt, x, decay and B|C vec4, kept from the recompute for the adjoint
    var c_dt: array<f32, 64>;
    var c_x: array<f32, 64>;
    var c_e: array<f32, 64>;
    var c_bc: array<vec4<f32>, 64>;
    var sa = 0.0;   // sum of dt e (g . s_prev): the lane's dA term (times A at the end)
    var sd = 0.0;   // sum of dy x: its dD term
    let z = Adj(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec3<f32>(0.0));
    let isc = l >= 4u;
    let lq = l % 4u;
    for (var cc = 0u; cc < u.NC; cc++) {
        let c = u.NC - 1u - cc;
        let t0 = c * Q;
        let nt = min(Q, u.L - t0);
        let sb = st4(u, ln.b, c, ln.d, 0u);
        var s0 = l_sr[sb]; var s1 = vec4<f32>(0.0); var s2 = vec4<f32>(0.0); var s3 = vec4<f32>(0.0);
        if (NQ > 1u) { s1 = l_sr[sb + 1u]; }
        if (NQ > 2u) { s2 = l_sr[sb + 2u]; }
        if (NQ > 3u) { s3 = l_sr[sb + 3u]; }
        hist[0] = s0; hist[1] = s1; hist[2] = s2; hist[3] = s3;
        for (var k = 0u; k < nt; k++) {
            let m = ln.b * u.L + t0 + k;
            let dt = l_dt[u.o_dt + m * H + ln.h];
            let x = x_of(u, m, ln.d);
            let bc = bc_of(u, m, ln);
            let ee = exp(dt * ln.a);
            c_dt[k] = dt; c_x[k] = x; c_e[k] = ee; c_bc[k] = bc;
            let e = vec4<f32>(ee);
            let dx = vec4<f32>(dt * x);
            let r = (k + 1u) * 4u;
            s0 = fma(e, s0, dx * b4(bc, 0u)); hist[r] = s0;
            if (NQ > 1u) { s1 = fma(e, s1, dx * b4(bc, 1u)); hist[r + 1u] = s1; }
            if (NQ > 2u) { s2 = fma(e, s2, dx * b4(bc, 2u)); hist[r + 2u] = s2; }
            if (NQ > 3u) { s3 = fma(e, s3, dx * b4(bc, 3u)); hist[r + 3u] = s3; }
        }
        for (var kk = 0u; kk < nt; kk++) {
            let k = nt - 1u - kk;
            let m = ln.b * u.L + t0 + k;
            let dt = c_dt[k];
            let x = c_x[k];
            let ee = c_e[k];
            let bc = c_bc[k];
            let dy = l_dy[u.o_dy + m * Di + ln.d];
            let r = k * 4u;
            let dtx = dt * x;
            let j0 = adj4(b4(bc, 0u), c4(bc, 0u), hist[r + 4u], hist[r], g0, dy, dtx);
            var j1 = z; var j2 = z; var j3 = z;
            if (NQ > 1u) { j1 = adj4(b4(bc, 1u), c4(bc, 1u), hist[r + 5u], hist[r + 1u], g1, dy, dtx); }
            if (NQ > 2u) { j2 = adj4(b4(bc, 2u), c4(bc, 2u), hist[r + 6u], hist[r + 2u], g2, dy, dtx); }
            if (NQ > 3u) { j3 = adj4(b4(bc, 3u), c4(bc, 3u), hist[r + 7u], hist[r + 3u], g3, dy, dtx); }
            g0 = j0.g * ee; g1 = j1.g * ee; g2 = j2.g * ee; g3 = j3.g * ee;
            let sums = j0.sums + j1.sums + j2.sums + j3.sums;   // g . s_prev, g . B
            let sdA = dt * ee * sums.x;
            sa += sdA;
            let ddt = fma(ln.a * ee, sums.x, x * sums.y);
            let od = u.o_dx + m * C + ln.d;
            let op = m * Di + ln.d;
            if (PASS == 0u) {
                l_dx[od] = fma(dt, sums.y, ln.D * dy);
                l_part[op] = ddt;
                sd += dy * x;
            } else {
                l_dx[od] = fma(dt, sums.y, l_dx[od]);
                l_part[op] = l_part[op] + ddt;
            }
            // the 8 lanes' sums of dB and dC (the same in every lane): lane q < NQ stores dB's
            // 4q..4q+3, lane 4 + q dC's
            if (lq < NQ) {
                l_pbc[(((PASS * u.nb * u.L + m) * u.nblk + ln.blk) * 2u + select(0u, 1u, isc)) * NQ + lq] = select(
                    quad(j0.rb, j1.rb, j2.rb, j3.rb, l), quad(j0.rc, j1.rc, j2.rc, j3.rc, l), isc);
            }
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
        for (var p = 0u; p < P / 4u; p++) { s += l_part4[(m * Di + h * P) / 4u + p]; }
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
