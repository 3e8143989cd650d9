// requires: subgroups
// Mamba-2's SSD scan on CPU adapters (lavapipe): the recurrence walked step by step, the
// same results and saved states as shaders/ssd_scan.wgsl's chunked form (engine/kernels/ssd.py
// takes these kernels where `ssd_lanes` says so).  Per head h (A = -exp(A_log_h), one scalar),
// channel d = h*P + p and state n:
//   s_t[n] = exp(dt_t A) s_{t-1}[n] + dt_t x_t B_t[n] ;  y_t = sum_n s_t[n] C_t[n] + D_h x_t
// A workgroup is one 8-lane subgroup (one SIMD vector): lane l owns channel blk*8 + l of
// sequence b (P % 8 == 0, so the 8 lanes share a head, its dt and its group's B and C) and
// keeps the states of a pass in KG quads of NQ vec4s (a quad: 16 states, or all of N <= 16;
// a pass: up to 4 quads, 64 states, the most one dispatch walks: `ssd.lane_split`).  B_t|C_t
// of a quad are loaded as one vec4 a lane (lanes 0..3 B, 4..7 C) and shared by subgroup
// broadcast.  N past 64 runs in passes, one dispatch each (PASS, a pipeline constant): the
// states are independent, only y, dx and the ddt terms add up over passes.  Every load
// costs lavapipe a loop over the lanes, and a pass loads dt, x and dy again: the quads'
// states spill to the stack, yet one pass of 64 states ran the forward 1.8-2.1x faster than
// four of 16 (mamba2-small).
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
// (ssd_scan.wgsl's ssd_dt_chunk sums the same terms), started from g . S at each chunk's end
// (its saved state S), so that no sum runs longer than a chunk:
//   ddt terms  A R_t + x_t (g_t . B_t)        -> part [passes, M, Di] (summed over p and passes)
//   dA_log terms A sum_t dt_t R_t, dD terms sum_t dy_t x_t -> part
// pbc is [passes, M, nblk, 2, KG NQ] vec4s (dB | dC); ssd_lanes_finish sums it over a
// group's blocks (dB, dC) and part over a head (ddt).

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
@group(0) @binding(9) var<storage, read_write> l_pbc: array<vec4<f32>>;   // [passes, M, nblk, 2, KG NQ]
@group(0) @binding(10) var<storage, read_write> l_part: array<f32>;  // [passes, M, Di] | dA_log | dD terms
@group(0) @binding(11) var<storage, read_write> l_ddt: array<f32>;   // ddt [M, H]

override H: u32 = 1u;
override P: u32 = 8u;
override N: u32 = 4u;
override G: u32 = 1u;
override Q: u32 = 64u;
override NQ: u32 = 1u;     // vec4s of states per quad: min(N, 16) / 4
override KG: u32 = 1u;     // quads per pass (1..4)
override PASS: u32 = 0u;   // states 4*NV*PASS .. 4*NV*PASS + 4*NV - 1
override Di: u32 = H * P;
override C: u32 = H * P + 2u * G * N;
override NV: u32 = NQ * KG;   // vec4s of states per pass

struct Lane { b: u32, blk: u32, d: u32, h: u32, a: f32, D: f32, bc: u32 }

// lane l's sequence, block, channel, head, A, D, and the vec4 of a row's xbc it loads for
// quad 0 (B's 4q..4q+3 for l = q < 4, C's for l = 4 + q; lanes past NQ load a valid one;
// quad k's is 4k further)
fn lane_of(u: SL, wg: u32, l: u32) -> Lane {
    let blk = wg % u.nblk;
    let d = blk * 8u + l;
    let h = d / P;
    let g = h / (H / G);
    let q = min(l % 4u, NQ - 1u);
    let col = Di + select(g, G + g, l >= 4u) * N + 4u * NV * PASS + 4u * q;
    return Lane(wg / u.nblk, blk, d, h, -exp(l_A[u.o_A + h]), l_D[u.o_D + h], col / 4u);
}

// x_t of the lane's channel (row m of xbc)
fn x_of(u: SL, m: u32, d: u32) -> f32 {
    let i = u.o_x + m * C + d;
    return l_x[i / 4u][i % 4u];
}
// the lane's B|C vec4 of quad k at row m
fn bc_of(u: SL, m: u32, ln: Lane, k: u32) -> vec4<f32> { return l_x[(u.o_x + m * C) / 4u + ln.bc + 4u * k]; }
// B's entries 4q..4q+3 of the quad (lane q's vec4), C's (lane 4 + q's)
fn b4(v: vec4<f32>, q: u32) -> vec4<f32> { return sg_shuffle4(v, q); }
fn c4(v: vec4<f32>, q: u32) -> vec4<f32> { return sg_shuffle4(v, 4u + q); }
// the vec4 index of states[b, c] entry (d, first state of the pass)
fn st4(u: SL, b: u32, c: u32, d: u32) -> u32 {
    return (u.o_st + ((b * (u.NC + 1u) + c) * Di + d) * N + 4u * NV * PASS) / 4u;
}

// 16 states (NQ vec4s used) of one lane; functions take the quads by pointer (inlined)
struct Quad { a: vec4<f32>, b: vec4<f32>, c: vec4<f32>, d: vec4<f32> }

// s = e s + dx B (bc: the quad's B|C vec4 of this lane); returns s . C
fn q_step(s: ptr<function, Quad>, bc: vec4<f32>, e: vec4<f32>, dx: vec4<f32>) -> f32 {
    (*s).a = fma(e, (*s).a, dx * b4(bc, 0u));
    var yp = dot((*s).a, c4(bc, 0u));
    if (NQ > 1u) { (*s).b = fma(e, (*s).b, dx * b4(bc, 1u)); yp += dot((*s).b, c4(bc, 1u)); }
    if (NQ > 2u) { (*s).c = fma(e, (*s).c, dx * b4(bc, 2u)); yp += dot((*s).c, c4(bc, 2u)); }
    if (NQ > 3u) { (*s).d = fma(e, (*s).d, dx * b4(bc, 3u)); yp += dot((*s).d, c4(bc, 3u)); }
    return yp;
}
// g = g + C dy; returns g . B
fn q_adj(g: ptr<function, Quad>, bc: vec4<f32>, dy: vec4<f32>) -> f32 {
    (*g).a = fma(c4(bc, 0u), dy, (*g).a);
    var gb = dot((*g).a, b4(bc, 0u));
    if (NQ > 1u) { (*g).b = fma(c4(bc, 1u), dy, (*g).b); gb += dot((*g).b, b4(bc, 1u)); }
    if (NQ > 2u) { (*g).c = fma(c4(bc, 2u), dy, (*g).c); gb += dot((*g).c, b4(bc, 2u)); }
    if (NQ > 3u) { (*g).d = fma(c4(bc, 3u), dy, (*g).d); gb += dot((*g).d, b4(bc, 3u)); }
    return gb;
}
fn q_scale(g: ptr<function, Quad>, e: vec4<f32>) {
    (*g).a *= e; (*g).b *= e; (*g).c *= e; (*g).d *= e;
}
fn q_save(i: u32, s: Quad) {
    l_st[i] = s.a;
    if (NQ > 1u) { l_st[i + 1u] = s.b; }
    if (NQ > 2u) { l_st[i + 2u] = s.c; }
    if (NQ > 3u) { l_st[i + 3u] = s.d; }
}
// g . the saved states at vec4 index i
fn q_dot(g: Quad, i: u32) -> f32 {
    var r = dot(g.a, l_sr[i]);
    if (NQ > 1u) { r += dot(g.b, l_sr[i + 1u]); }
    if (NQ > 2u) { r += dot(g.c, l_sr[i + 2u]); }
    if (NQ > 3u) { r += dot(g.d, l_sr[i + 3u]); }
    return r;
}

// the lane sums of v times a quad, or of two (lanes 0..3 the first, 4..7 the second): lane l
// gets vec4 l % 4 of its quad summed over the 8 lanes, by a reduce-scatter of subgroup
// shuffles (7 for two quads; 4 butterflies would take 12 for one)
fn rs2(x: vec4<f32>, y: vec4<f32>, hi: bool, m: u32) -> vec4<f32> {
    return select(x, y, hi) + sg_xor4(select(y, x, hi), m);
}
fn rs4(v0: vec4<f32>, v1: vec4<f32>, v2: vec4<f32>, v3: vec4<f32>, l: u32) -> vec4<f32> {
    let o = (l & 1u) != 0u;
    let t = (l & 2u) != 0u;
    return rs2(rs2(v0, v1, o, 1u), rs2(v2, v3, o, 1u), t, 2u);   // summed over lanes l ^ 0..3
}
fn q_sum(s: Quad, v: vec4<f32>, l: u32) -> vec4<f32> {
    let r = rs4(s.a * v, s.b * v, s.c * v, s.d * v, l);
    return r + sg_xor4(r, 4u);
}
fn q_sum2(s: Quad, t: Quad, v: vec4<f32>, l: u32) -> vec4<f32> {
    let hi = l >= 4u;
    return rs4(rs2(s.a * v, t.a * v, hi, 4u), rs2(s.b * v, t.b * v, hi, 4u), rs2(s.c * v, t.c * v, hi, 4u),
               rs2(s.d * v, t.d * v, hi, 4u), l);
}
// the lane sums of v times the pass's quads into pbc at vec4 index i (the (m, blk, part) row)
fn pbc_store(i: u32, l: u32, v: vec4<f32>, q0: Quad, q1: Quad, q2: Quad, q3: Quad) {
    let lq = l % 4u;
    if (KG == 1u) {
        let r = q_sum(q0, v, l);
        if (l < NQ) { l_pbc[i + l] = r; }
    } else if (KG == 3u) {
        l_pbc[i + l] = q_sum2(q0, q1, v, l);
        let r = q_sum(q2, v, l);
        if (l < 4u) { l_pbc[i + 8u + l] = r; }
    } else {
        l_pbc[i + l] = q_sum2(q0, q1, v, l);
        if (KG == 4u) { l_pbc[i + 8u + l] = q_sum2(q2, q3, v, l); }
    }
}

@compute @workgroup_size(8)
fn ssd_lanes_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) l: u32) {
    let u = U;   // read once, before any loop (a uniform read in a loop is a gather on lavapipe)
    let wg = wid.x + wid.y * nwg.x;
    if (wg >= u.nb * u.nblk) { return; }
    let ln = lane_of(u, wg, l);
    let z = vec4<f32>(0.0);
    var q0 = Quad(z, z, z, z); var q1 = q0; var q2 = q0; var q3 = q0;
    for (var c = 0u; c <= u.NC; c++) {
        // the chunk states are stored outside the step loop (an `if` in it runs masked on every pass)
        let sb = st4(u, ln.b, c, ln.d);
        q_save(sb, q0);
        if (KG > 1u) { q_save(sb + 4u, q1); }
        if (KG > 2u) { q_save(sb + 8u, q2); }
        if (KG > 3u) { q_save(sb + 12u, q3); }
        for (var t = c * Q; t < min(u.L, c * Q + Q); t++) {
            let m = ln.b * u.L + t;
            let dt = l_dt[u.o_dt + m * H + ln.h];
            let x = x_of(u, m, ln.d);
            let e = vec4<f32>(exp(dt * ln.a));
            let dx = vec4<f32>(dt * x);
            var yp = q_step(&q0, bc_of(u, m, ln, 0u), e, dx);
            if (KG > 1u) { yp += q_step(&q1, bc_of(u, m, ln, 1u), e, dx); }
            if (KG > 2u) { yp += q_step(&q2, bc_of(u, m, ln, 2u), e, dx); }
            if (KG > 3u) { yp += q_step(&q3, bc_of(u, m, ln, 3u), e, dx); }
            let o = u.o_y + m * Di + ln.d;
            if (PASS == 0u) { l_y[o] = fma(ln.D, x, yp); } else { l_y[o] = l_y[o] + yp; }
        }
    }
}

@compute @workgroup_size(8)
fn ssd_lanes_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_index) l: u32) {
    let u = U;
    let wg = wid.x + wid.y * nwg.x;
    if (wg >= u.nb * u.nblk) { return; }
    let ln = lane_of(u, wg, l);
    let z = vec4<f32>(0.0);
    // the pbc row (m = b*L, blk, dB) of the lane's workgroup; dC's is NV further, a row per step
    let pb = ((PASS * u.nb * u.L + ln.b * u.L) * u.nblk + ln.blk) * 2u * NV;
    let pstride = u.nblk * 2u * NV;
    let pp = PASS * u.nb * u.L * Di + ln.d;   // the lane's column of the pass's part [M, Di]
    // 1. forward: the states again from zero
    var q0 = Quad(z, z, z, z); var q1 = q0; var q2 = q0; var q3 = q0;
    var sd = 0.0;   // sum of dy x: the lane's dD term
    for (var t = 0u; t < u.L; t++) {
        let m = ln.b * u.L + t;
        let dt = l_dt[u.o_dt + m * H + ln.h];
        let x = x_of(u, m, ln.d);
        let dy = l_dy[u.o_dy + m * Di + ln.d];
        let e = vec4<f32>(exp(dt * ln.a));
        let dx = vec4<f32>(dt * x);
        var yp = q_step(&q0, bc_of(u, m, ln, 0u), e, dx);
        if (KG > 1u) { yp += q_step(&q1, bc_of(u, m, ln, 1u), e, dx); }
        if (KG > 2u) { yp += q_step(&q2, bc_of(u, m, ln, 2u), e, dx); }
        if (KG > 3u) { yp += q_step(&q3, bc_of(u, m, ln, 3u), e, dx); }
        l_part[pp + m * Di] = dy * yp;   // the pass's share of dy (y - D x), for walk 2
        pbc_store(pb + t * pstride + NV, l, vec4<f32>(dy), q0, q1, q2, q3);
        if (PASS == 0u) { sd = fma(dy, x, sd); }
    }
    // 2. back from the end: the adjoint g, and R from g . S at each chunk's end
    var g0 = Quad(z, z, z, z); var g1 = g0; var g2 = g0; var g3 = g0;
    var sa = 0.0;   // sum of dt R: the lane's dA term (times A at the end)
    for (var cc = 0u; cc < u.NC; cc++) {
        let c = u.NC - 1u - cc;
        let t0 = c * Q;
        let nt = min(Q, u.L - t0);
        let sb = st4(u, ln.b, c + 1u, ln.d);
        var R = q_dot(g0, sb);
        if (KG > 1u) { R += q_dot(g1, sb + 4u); }
        if (KG > 2u) { R += q_dot(g2, sb + 8u); }
        if (KG > 3u) { R += q_dot(g3, sb + 12u); }
        for (var kk = 0u; kk < nt; kk++) {
            let t = t0 + nt - 1u - kk;
            let m = ln.b * u.L + t;
            let dt = l_dt[u.o_dt + m * H + ln.h];
            let x = x_of(u, m, ln.d);
            let dy = l_dy[u.o_dy + m * Di + ln.d];
            let vy = vec4<f32>(dy);
            var gb = q_adj(&g0, bc_of(u, m, ln, 0u), vy);
            if (KG > 1u) { gb += q_adj(&g1, bc_of(u, m, ln, 1u), vy); }
            if (KG > 2u) { gb += q_adj(&g2, bc_of(u, m, ln, 2u), vy); }
            if (KG > 3u) { gb += q_adj(&g3, bc_of(u, m, ln, 3u), vy); }
            let dtx = dt * x;
            let op = pp + m * Di;
            R += fma(-dtx, gb, l_part[op]);
            sa = fma(dt, R, sa);
            l_part[op] = fma(ln.a, R, x * gb);
            let od = u.o_dx + m * C + ln.d;
            if (PASS == 0u) { l_dx[od] = fma(dt, gb, ln.D * dy); } else { l_dx[od] = fma(dt, gb, l_dx[od]); }
            pbc_store(pb + t * pstride, l, vec4<f32>(dtx), g0, g1, g2, g3);
            let e = vec4<f32>(exp(dt * ln.a));
            q_scale(&g0, e);
            if (KG > 1u) { q_scale(&g1, e); }
            if (KG > 2u) { q_scale(&g2, e); }
            if (KG > 3u) { q_scale(&g3, e); }
        }
    }
    l_part[u.o_pa + (PASS * u.nb + ln.b) * Di + ln.d] = ln.a * sa;
    if (PASS == 0u) { l_part[u.o_pd + ln.b * Di + ln.d] = sd; }
}

// dxbc's B and C columns (the sums of pbc over the group's channel blocks) and ddt [M, H]
// (the sums of part over the head's P channels and the passes): a workgroup of 8 lanes per
// row m, walking each (pass, group)'s block rows in memory order, lane l summing their vec4s
// l, l + 8, .., and heads l, l + 8, .. (an invocation per column, summing scalars strided
// over blocks, took 0.39 ms a layer at mamba2-tiny, B 1, L 256; a lane per B|C vec4 summing
// it over the blocks, rows 2 NV vec4s apart, 2.2x this at mamba2-small)
@group(0) @binding(8) var<storage, read_write> l_dx4: array<vec4<f32>>;
@group(0) @binding(10) var<storage, read_write> l_part4: array<vec4<f32>>;

@compute @workgroup_size(8)
fn ssd_lanes_finish(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) l: u32) {
    let u = U;
    let m = wid.x + wid.y * nwg.x;
    if (m >= u.total) { return; }
    let nbg = Di / G / 8u;
    let NG = N / 4u;            // vec4s of one group's B (or C)
    // a pass's (m, blk) row of pbc is dB | dC, NV vec4s each: the lanes read vec4s l, l + 8, ..
    // of each row, the group's blocks in order (the rows one after the other in memory)
    let z = vec4<f32>(0.0);
    for (var pg = 0u; pg < N / (4u * NV) * G; pg++) {
        let ps = pg / G;
        let g = pg % G;
        var a0 = z; var a1 = z; var a2 = z; var a3 = z;
        let r0 = ((ps * u.nb * u.L + m) * u.nblk + g * nbg) * 2u * NV + l;
        for (var k = 0u; k < nbg; k++) {
            let r = r0 + k * 2u * NV;
            if (l < 2u * NV) { a0 += l_pbc[r]; }
            if (l + 8u < 2u * NV) { a1 += l_pbc[r + 8u]; }
            if (l + 16u < 2u * NV) { a2 += l_pbc[r + 16u]; }
            if (l + 24u < 2u * NV) { a3 += l_pbc[r + 24u]; }
        }
        // vec4 i of the row: part i / NV, states 4 (ps NV + i % NV) ..
        let o = (u.o_dx + m * C + Di) / 4u + g * NG + ps * NV;
        if (l < 2u * NV) { l_dx4[o + (l / NV) * G * NG + l % NV] = a0; }
        if (l + 8u < 2u * NV) { l_dx4[o + ((l + 8u) / NV) * G * NG + (l + 8u) % NV] = a1; }
        if (l + 16u < 2u * NV) { l_dx4[o + ((l + 16u) / NV) * G * NG + (l + 16u) % NV] = a2; }
        if (l + 24u < 2u * NV) { l_dx4[o + ((l + 24u) / NV) * G * NG + (l + 24u) % NV] = a3; }
    }
    for (var h = l; h < H; h += 8u) {
        var s = vec4<f32>(0.0);
        for (var ps = 0u; ps < N / (4u * NV); ps++) {
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
