// requires: subgroups, wg_reduce
// Mamba-2's SSD layer pieces around the scan (shaders/ssd_scan.wgsl): the dt transform, sums
// of partials, the gated RMS norm per group and the recurrent decode step
// (engine/kernels/ssd.py says what each writes).
// Letters: H heads, P head_dim, Di = H*P, G groups (heads h use group g = h / (H/G)), N state,
// C = Di + 2GN (xBC's columns: x | B | C), W in_proj's columns (z | xBC | dt).  Rows m = b*L + t.
// The decode step is the scan's recurrence, per head h, per (p, n):
//     h_t = exp(dt_t*A) * h_{t-1} + dt_t * x_t[p] * B_t[n],   y_t[p] = h_t[p, :] . C_t + D * x_t[p]

struct SP { B: u32, L: u32, H: u32, P: u32, N: u32, G: u32, Q: u32, NC: u32,
            C: u32, Di: u32, W: u32, nrows: u32,
            o0: u32, o1: u32, o2: u32, o3: u32, o4: u32, o5: u32, o6: u32, o7: u32,
            lo: f32, hi: f32, eps: f32, acc: u32 }

// invocations per (row, group) of the gated norm (engine/kernels/ssd.py: fewer on CPU
// adapters, as the row kernels of rmsnorm); SG8: those are one subgroup of 8 (shuffles)
override WG: u32 = 256u;
override SG8: bool = false;

fn dsilu(p: f32) -> f32 { let s = sigmoid(p); return s * (1.0 + p * (1.0 - s)); }
fn dsoftplus(x: f32) -> f32 { if (x > 20.0) { return 1.0; } return sigmoid(x); }

// ---------------------------------------------------------------- dt
// dt[m, h] = clamp(softplus(zxbcdt[m, W - H + h] + dt_bias[h]), lo, hi)
@group(0) @binding(0) var<storage, read_write> dt_out: array<f32>;
@group(0) @binding(1) var<storage, read> dt_in: array<f32>;
@group(0) @binding(2) var<storage, read> dt_bias: array<f32>;
@group(0) @binding(3) var<uniform> U: SP;

@compute @workgroup_size(256)
fn ssd_dt_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let u = U;
    let i = lin(wid, nwg, lid);
    if (i >= u.nrows * u.H) { return; }
    let m = i / u.H;
    let h = i % u.H;
    let v = softplus(dt_in[u.o1 + m * u.W + u.W - u.H + h] + dt_bias[u.o2 + h]);
    dt_out[u.o0 + i] = clamp(v, u.lo, u.hi);
}

// ddt[m, h] (in place) = ddt * softplus'(raw) * (lo <= softplus(raw) <= hi), also written to
// dzxbcdt[m, W - H + h]
@group(0) @binding(0) var<storage, read_write> ddt_io: array<f32>;
@group(0) @binding(1) var<storage, read> dtb_in: array<f32>;
@group(0) @binding(2) var<storage, read> dtb_bias: array<f32>;
@group(0) @binding(3) var<uniform> UB: SP;
@group(0) @binding(4) var<storage, read_write> dzx: array<f32>;

@compute @workgroup_size(256)
fn ssd_dt_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) lid: u32) {
    let u = UB;
    let i = lin(wid, nwg, lid);
    if (i >= u.nrows * u.H) { return; }
    let m = i / u.H;
    let h = i % u.H;
    let raw = dtb_in[u.o1 + m * u.W + u.W - u.H + h] + dtb_bias[u.o2 + h];
    let v = softplus(raw);
    var g = ddt_io[u.o0 + i] * dsoftplus(raw);
    if (v < u.lo || v > u.hi) { g = 0.0; }
    ddt_io[u.o0 + i] = g;
    dzx[u.o3 + m * u.W + u.W - u.H + h] = g;
}

// ---------------------------------------------------------------- sums of partials
// out[b * C + j] (+)= sum_{r in block b of G rows, r < nrows} sum_{q < P} in[o1 + r * W + j * P + q],
// j < C, blocks b < N (acc: add); one invocation per (b, j)
@group(0) @binding(0) var<storage, read_write> r_out: array<f32>;
@group(0) @binding(1) var<storage, read> r_in: array<f32>;
@group(0) @binding(2) var<uniform> UR: SP;

@compute @workgroup_size(256)
fn ssd_reduce(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let u = UR;
    let i = lin(wid, nwg, lid);
    if (i >= u.C * u.N) { return; }
    let j = i % u.C;
    let blk = i / u.C;
    var s = 0.0;
    let r1 = min(u.nrows, (blk + 1u) * u.G);
    for (var r = blk * u.G; r < r1; r++) {
        let base = u.o1 + r * u.W + j * u.P;
        for (var q = 0u; q < u.P; q++) { s += r_in[base + q]; }
    }
    if (u.acc != 0u) { s += r_out[u.o0 + i]; }
    r_out[u.o0 + i] = s;
}

// ---------------------------------------------------------------- gated RMS norm per group
// v = y * silu(z) (z = zxbcdt[:, 0:Di]); per (m, group of S = Di/G channels):
// rstd = 1/sqrt(mean(v^2) + eps); out = w * (v * rstd)
// One workgroup of WG invocations per (m, g) = workgroup index i = m*G + g; invocation l
// takes channels l, l + WG, ... of the group (coalesced), the sums by wg_reduce.
@group(0) @binding(0) var<storage, read_write> n_out: array<f32>;
@group(0) @binding(1) var<storage, read_write> n_rstd: array<f32>;
@group(0) @binding(2) var<storage, read> n_y: array<f32>;
@group(0) @binding(3) var<storage, read> n_zx: array<f32>;
@group(0) @binding(4) var<storage, read> n_w: array<f32>;
@group(0) @binding(5) var<uniform> UN: SP;

@compute @workgroup_size(WG)
fn gnorm_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) l: u32) {
    let u = UN;
    let i = wid.x + wid.y * nwg.x;
    if (i >= u.nrows * u.G) { return; }
    let m = i / u.G;
    let S = u.Di / u.G;
    let yb = u.o2 + m * u.Di + (i % u.G) * S;
    let zb = u.o3 + m * u.W + (i % u.G) * S;
    var ss = 0.0;
    for (var j = l; j < S; j += WG) {
        let v = n_y[yb + j] * silu(n_zx[zb + j]);
        ss += v * v;
    }
    let r = inverseSqrt(wg_sum(ss, l) / f32(S) + u.eps);
    if (l == 0u) { n_rstd[u.o1 + i] = r; }
    let ob = u.o0 + m * u.Di + (i % u.G) * S;
    let wb = u.o4 + (i % u.G) * S;
    for (var j = l; j < S; j += WG) {
        let v = n_y[yb + j] * silu(n_zx[zb + j]);
        n_out[ob + j] = n_w[wb + j] * (v * r);
    }
}

// dy[m, c] (WRITE), dz -> dzxbcdt[m, c] (WRITE), part[m * Di + c] = dout * v * rstd (the
// weight gradient's terms, summed by ssd_reduce); a workgroup per (m, g) as the forward's
@group(0) @binding(0) var<storage, read> nb_dout: array<f32>;
@group(0) @binding(1) var<storage, read> nb_y: array<f32>;
@group(0) @binding(2) var<storage, read> nb_zx: array<f32>;
@group(0) @binding(3) var<storage, read> nb_w: array<f32>;
@group(0) @binding(4) var<storage, read> nb_rstd: array<f32>;
@group(0) @binding(5) var<storage, read_write> nb_dy: array<f32>;
@group(0) @binding(6) var<storage, read_write> nb_dzx: array<f32>;
@group(0) @binding(7) var<storage, read_write> nb_part: array<f32>;
@group(0) @binding(8) var<uniform> UNB: SP;

@compute @workgroup_size(WG)
fn gnorm_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) l: u32) {
    let u = UNB;
    let i = wid.x + wid.y * nwg.x;
    if (i >= u.nrows * u.G) { return; }
    let m = i / u.G;
    let S = u.Di / u.G;
    let r = nb_rstd[u.o4 + i];
    let cb = (i % u.G) * S;          // the group's first channel
    let yb = m * u.Di + cb;          // (row offsets of y, dout, dy and part, before their o*)
    let zb = m * u.W + cb;
    var s1 = 0.0;
    for (var j = l; j < S; j += WG) {
        let v = nb_y[u.o1 + yb + j] * silu(nb_zx[u.o2 + zb + j]);
        s1 += nb_dout[u.o0 + yb + j] * nb_w[u.o3 + cb + j] * v;
    }
    let k = r * r * r * wg_sum(s1, l) / f32(S);
    for (var j = l; j < S; j += WG) {
        let z = nb_zx[u.o2 + zb + j];
        let y = nb_y[u.o1 + yb + j];
        let v = y * silu(z);
        let go = nb_dout[u.o0 + yb + j];
        let dv = r * go * nb_w[u.o3 + cb + j] - v * k;
        nb_dy[u.o5 + yb + j] = dv * silu(z);
        nb_dzx[u.o6 + zb + j] = dv * y * dsilu(z);
        nb_part[u.o7 + yb + j] = go * v * r;
    }
}

// ---------------------------------------------------------------- recurrent decoding (batch 1)
// ssd_conv_prefill: cstate[k, c] = zx[t, Di + c], t = L - (K-1) + k (0 before the prompt)
// ssd_conv_step:    xbc[c] = silu(bias + sum_k w[c, k] * win[k]), win = cstate rows then zx[Di + c];
//                   cstate shifted by one row
// ssd_step:         per (h, p): state[h, p, :] = exp(dt A) state + dt x B; y = state . C + D x
@group(0) @binding(0) var<storage, read_write> d_out: array<f32>;
@group(0) @binding(1) var<storage, read_write> d_state: array<f32>;
@group(0) @binding(2) var<storage, read> d_in: array<f32>;
@group(0) @binding(3) var<storage, read> d_w: array<f32>;
@group(0) @binding(4) var<storage, read> d_b: array<f32>;
@group(0) @binding(5) var<uniform> UD: SP;
@group(0) @binding(6) var<storage, read> d_dt: array<f32>;

@compute @workgroup_size(256)
fn ssd_conv_prefill(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) lid: u32) {
    let u = UD;
    let K = u.Q;      // (the conv kernel width in this call)
    let i = lin(wid, nwg, lid);
    if (i >= (K - 1u) * u.C) { return; }
    let k = i / u.C;
    let c = i % u.C;
    var v = 0.0;
    if (u.L + k >= K - 1u) {
        let t = u.L + k - (K - 1u);
        v = d_in[u.o2 + t * u.W + u.Di + c];
    }
    d_state[u.o1 + i] = v;
}

@compute @workgroup_size(256)
fn ssd_conv_step(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let u = UD;
    let K = u.Q;
    let c = lin(wid, nwg, lid);
    if (c >= u.C) { return; }
    var s = 0.0;
    if (u.acc != 0u) { s = d_b[u.o4 + c]; }
    for (var k = 0u; k + 1u < K; k++) {
        s += d_w[u.o3 + c * K + k] * d_state[u.o1 + k * u.C + c];
    }
    let x = d_in[u.o2 + u.Di + c];
    s += d_w[u.o3 + c * K + K - 1u] * x;
    for (var k = 0u; k + 2u < K; k++) {
        d_state[u.o1 + k * u.C + c] = d_state[u.o1 + (k + 1u) * u.C + c];
    }
    if (K > 1u) { d_state[u.o1 + (K - 2u) * u.C + c] = x; }
    d_out[u.o0 + c] = silu(s);
}

// d_in = xbc [C], d_w = A_log [H], d_b = D [H], d_dt = dt [H]
@compute @workgroup_size(256)
fn ssd_step(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let u = UD;
    let i = lin(wid, nwg, lid);
    if (i >= u.H * u.P) { return; }
    let h = i / u.P;
    let g = h / (u.H / u.G);
    let dt = d_dt[u.o5 + h];
    let a = exp(dt * -exp(d_w[u.o3 + h]));
    let x = d_in[u.o2 + i];
    let cb = u.o2 + u.Di + g * u.N;
    let cc = u.o2 + u.Di + u.G * u.N + g * u.N;
    var acc = 0.0;
    for (var n = 0u; n < u.N; n++) {
        let s = d_state[u.o1 + i * u.N + n] * a + dt * x * d_in[cb + n];
        d_state[u.o1 + i * u.N + n] = s;
        acc += s * d_in[cc + n];
    }
    d_out[u.o0 + i] = acc + d_b[u.o4 + h] * x;
}
