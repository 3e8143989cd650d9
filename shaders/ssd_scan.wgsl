// Mamba-2's SSD scan in its chunked form (the state-space dual): forward and backward.
// engine/kernels/ssd.py says what each entry point writes and in which order they run.
//
// Letters: H heads, P head_dim, Di = H*P, G groups (head h reads group g = h / HG, HG = H/G),
// N state, C = Di + 2GN (xbc's columns: x | B | C), Q steps per chunk, NC = ceil(L/Q).
// Within a sequence b, chunk c holds steps t = c*Q + i (i < Q; a step with t >= L is padding:
// it reads zeros).  Rows m = b*L + t.  a[b,c,h,i] = A_h * sum_{k<=i} dt (the chunk's decay
// logs, `acs`; padding repeats the last), A = -exp(A_log), last = a[.., Q-1].
//
//   S[c+1]    = exp(last) S[c] + sum_j exp(last - a_j) dt_j x_j B_j^T        (state, [P, N])
//   y_i       = sum_{j<=i} (C_i . B_j) exp(a_i - a_j) dt_j x_j + exp(a_i) S[c] C_i + D x_i
//
// The matrix work is one tiled kernel, `ssd_product`: out[r, s] = sum_k a(r, k) b(k, s) for
// each item z of a batch (a chunk of a head or of a group), 64 x 64 outputs per workgroup of
// 256 threads (4 x 4 each), K in steps of 16 or 32 (`wide()`, chosen per mode) staged through
// workgroup memory, an invocation's 4 x 4 read as one vec4 of each operand a k (on CPU
// adapters, STAGED = 0, loaded straight: their barriers cost more than the loads they save).
// MODE (a pipeline constant) says what a, b and the store are:
//   1 chunk state   z=(b,c,h)  [P x N]  K=Q      a = exp(last-a_j) dt_j x_j[p], b = B_j[n] -> states[b,c+1]
//   2 CB            z=(b,c,g)  [Q x Q]  K=N      a = C_i[n], b = B_j[n]                   -> cb
//   3 output y      z=(b,c,h)  [Q x P]  K=Q+N    a = cb_ij exp(a_i-a_j) dt_j (j<=i), b = x_j[p];
//                                                then a = exp(a_i) C_i[n], b = S[c][p,n] -> y (+ D x)
//   4 dS local      z=(b,c,h)  [P x N]  K=Q      a = dy_i[p] exp(a_i), b = C_i[n]          -> dstates[b,c]
//   5 dx            z=(b,c,h)  [Q x P]  K=Q+N    a = cb_ij exp(a_i-a_j) (i>=j), b = dy_i[p];
//                                                then a = exp(last-a_j) B_j[n], b = dS[c+1][p,n]
//                                                -> dx = dt_j acc + D dy, part = x_j[p] acc
//   6 dCB           z=(b,c,g)  [Q x Q]  K=HG P   a = dy_i[h,p], b = x_j[h,p], a head at a time
//                                                (k = (h, p)): dcb = sum_h exp(a_hi-a_hj) dt_hj acc_h (j<=i)
//   7 dC            z=(b,c,g)  [Q x N]  K=Q+HG P a = dcb[i,j], b = B_j[n];
//                                                then a = exp(a_hi) dy_i[h,p], b = S_h[c][p,n] -> dC
//   8 dB            z=(b,c,g)  [Q x N]  K=Q+HG P a = dcb[i,j] (r = j), b = C_i[n];
//                                                then a = exp(last_h-a_hj) dt_hj x_j[h,p], b = dS_h[c+1][p,n] -> dB
// dcb is the group's: its heads share B and C, so dC and dB take the heads' sum of the gradient
// of C_i . B_j once (K = Q) rather than each head's (K = HG Q); mode 6 multiplies each head's
// K = P separately and adds it scaled by that head's decay (the factor of (i, j) cannot be
// split into a row's and a column's: exp(-a_hj) overflows f32).
// The rest is small: ssd_cumsum (a and its exps), ssd_state_pass / ssd_dstate_pass (the chunks in order,
// one invocation per (b, h, p, n)), ssd_dlast (<dS[c+1], S[c+1]>, the gradient of `last`)
// and ssd_dt_chunk (ddt, and the chunks' terms of dA_log and dD).
//
// `small` holds A_log [H] | D [H] | a [nb, NC, H, Q] | dlast, dA_log and dD terms [nb, NC, H] |
// exp(a) and exp(last - a) [nb, NC, H, Q] each (the operands' row and column factors).
// states and dstates are [nb, NC + 1, H, P, N] (dstates[c]: the gradient of S[c]; entry NC 0).

struct SS { B: u32, L: u32, NC: u32, Z: u32, ntile: u32,
            o_out: u32, o_x: u32, o_dt: u32, o_a1: u32, o_a2: u32, o_a3: u32, o_out2: u32,
            o_acs: u32, o_dl: u32, o_pa: u32, o_pd: u32, o_ei: u32, o_eo: u32, pad2: u32 }

@group(0) @binding(0) var<storage, read_write> s_out: array<f32>;
@group(0) @binding(1) var<storage, read> s_x: array<f32>;       // xbc [M, C]
@group(0) @binding(2) var<storage, read> s_dt: array<f32>;      // dt [M, H]
@group(0) @binding(3) var<storage, read_write> s_small: array<f32>;
@group(0) @binding(4) var<storage, read> s_a1: array<f32>;
@group(0) @binding(5) var<storage, read> s_a2: array<f32>;
@group(0) @binding(6) var<storage, read> s_a3: array<f32>;
@group(0) @binding(7) var<storage, read_write> s_out2: array<f32>;
@group(0) @binding(8) var<uniform> US: SS;

// the shape as pipeline constants (index arithmetic by constants)
override H: u32 = 1u;
override P: u32 = 1u;
override N: u32 = 1u;
override G: u32 = 1u;
override Q: u32 = 64u;
override Di: u32 = H * P;
override C: u32 = H * P + 2u * G * N;
override MODE: u32 = 1u;
override STAGED: u32 = 1u;   // 1: tiles through workgroup memory (GPUs); 0: straight loads (CPU adapters)

// ---------------------------------------------------------------- indexing
struct Item { b: u32, c: u32, h: u32, g: u32 }

// z = (b * NC + c) * H + h: a head of a chunk
fn head_item(u: SS, z: u32) -> Item {
    var it: Item;
    it.h = z % H;
    it.g = it.h / (H / G);
    it.b = z / (H * u.NC);
    it.c = (z / H) % u.NC;
    return it;
}

fn item(u: SS, z: u32) -> Item {
    // heads (modes 1 3 4 5) or groups (2 6 7 8, z = (b * NC + c) * G + g; h its first head)
    if (!(MODE == 2u || MODE == 6u || MODE == 7u || MODE == 8u)) { return head_item(u, z); }
    var it: Item;
    it.g = z % G;
    it.h = it.g * (H / G);
    it.b = z / (G * u.NC);
    it.c = (z / G) % u.NC;
    return it;
}

fn valid(u: SS, it: Item, i: u32) -> bool { return it.c * Q + i < u.L; }
fn row(u: SS, it: Item, i: u32) -> u32 { return it.b * u.L + it.c * Q + i; }
fn xv(u: SS, m: u32, h: u32, p: u32) -> f32 { return s_x[u.o_x + m * C + h * P + p]; }
fn bv(u: SS, m: u32, g: u32, n: u32) -> f32 { return s_x[u.o_x + m * C + Di + g * N + n]; }
fn cv(u: SS, m: u32, g: u32, n: u32) -> f32 { return s_x[u.o_x + m * C + Di + (G + g) * N + n]; }
fn dtv(u: SS, m: u32, h: u32) -> f32 { return s_dt[u.o_dt + m * H + h]; }
fn chunk_head(u: SS, it: Item, h: u32) -> u32 { return (it.b * u.NC + it.c) * H + h; }
fn acs(u: SS, it: Item, h: u32, i: u32) -> f32 { return s_small[u.o_acs + chunk_head(u, it, h) * Q + i]; }
fn last(u: SS, it: Item, h: u32) -> f32 { return acs(u, it, h, Q - 1u); }
// exp(a_i) and exp(last - a_i), once per step (ssd_cumsum)
fn ein(u: SS, it: Item, h: u32, i: u32) -> f32 { return s_small[u.o_ei + chunk_head(u, it, h) * Q + i]; }
fn eout(u: SS, it: Item, h: u32, i: u32) -> f32 { return s_small[u.o_eo + chunk_head(u, it, h) * Q + i]; }
// states / dstates [nb, NC + 1, H, P, N]: entry c of head h, (p, n)
fn st(u: SS, it: Item, c: u32, h: u32, p: u32, n: u32) -> u32 {
    return (((it.b * (u.NC + 1u) + c) * H + h) * P + p) * N + n;
}
fn cbi(u: SS, it: Item, i: u32, j: u32) -> u32 { return (((it.b * u.NC + it.c) * G + it.g) * Q + i) * Q + j; }

// ---------------------------------------------------------------- the product's shape
// (R, S, K, the first K of the second phase)
fn dims(u: SS) -> vec4<u32> {
    let hg = H / G;
    switch MODE {
        case 1u, 4u: { return vec4<u32>(P, N, Q, Q); }
        case 2u: { return vec4<u32>(Q, Q, N, N); }
        case 3u, 5u: { return vec4<u32>(Q, P, Q + N, Q); }
        case 6u: { return vec4<u32>(Q, Q, hg * P, hg * P); }
        default: { return vec4<u32>(Q, N, Q + hg * P, Q); }
    }
}

// whether a tile of the operand is loaded with k fastest (k is contiguous in memory)
fn a_kfast(ph: u32) -> bool {
    switch MODE {
        case 2u, 3u, 6u, 7u: { return true; }
        case 5u: { return ph == 1u; }
        case 8u: { return ph == 1u; }
        default: { return false; }
    }
}
fn b_kfast(ph: u32) -> bool {
    switch MODE {
        case 2u, 6u: { return true; }
        case 3u, 5u: { return ph == 1u; }
        default: { return false; }
    }
}

fn a_at(u: SS, it: Item, r: u32, k: u32, ph: u32, k2: u32) -> f32 {
    let h = it.h;
    switch MODE {
        case 1u: {      // r = p, k = j
            if (!valid(u, it, k)) { return 0.0; }
            let m = row(u, it, k);
            return eout(u, it, h, k) * dtv(u, m, h) * xv(u, m, h, r);
        }
        case 2u: {      // r = i, k = n
            if (!valid(u, it, r)) { return 0.0; }
            return cv(u, row(u, it, r), it.g, k);
        }
        case 3u: {      // r = i; k = j, then n
            if (ph == 0u) {
                if (k > r || !valid(u, it, k)) { return 0.0; }
                return s_a1[u.o_a1 + cbi(u, it, r, k)] * exp(acs(u, it, h, r) - acs(u, it, h, k))
                       * dtv(u, row(u, it, k), h);
            }
            if (!valid(u, it, r)) { return 0.0; }
            return ein(u, it, h, r) * cv(u, row(u, it, r), it.g, k - k2);
        }
        case 4u: {      // r = p, k = i
            if (!valid(u, it, k)) { return 0.0; }
            return s_a2[u.o_a2 + row(u, it, k) * Di + h * P + r] * ein(u, it, h, k);
        }
        case 5u: {      // r = j; k = i, then n
            if (ph == 0u) {
                if (k < r || !valid(u, it, k)) { return 0.0; }
                return s_a1[u.o_a1 + cbi(u, it, k, r)] * exp(acs(u, it, h, k) - acs(u, it, h, r));
            }
            if (!valid(u, it, r)) { return 0.0; }
            return eout(u, it, h, r) * bv(u, row(u, it, r), it.g, k - k2);
        }
        case 6u: {      // r = i, k = (h, p)
            if (!valid(u, it, r)) { return 0.0; }
            return s_a2[u.o_a2 + row(u, it, r) * Di + h * P + k];
        }
        case 7u: {      // r = i; k = j, then (h, p)
            if (ph == 0u) {
                return s_a1[u.o_a1 + cbi(u, it, r, k)];
            }
            let kk = k - k2;
            let hh = it.h + kk / P;
            if (!valid(u, it, r)) { return 0.0; }
            return ein(u, it, hh, r) * s_a2[u.o_a2 + row(u, it, r) * Di + hh * P + kk % P];
        }
        default: {      // 8: r = j; k = i, then (h, p)
            if (ph == 0u) {
                return s_a1[u.o_a1 + cbi(u, it, k, r)];
            }
            let kk = k - k2;
            let hh = it.h + kk / P;
            if (!valid(u, it, r)) { return 0.0; }
            let m = row(u, it, r);
            return eout(u, it, hh, r) * dtv(u, m, hh) * xv(u, m, hh, kk % P);
        }
    }
}

fn b_at(u: SS, it: Item, k: u32, s: u32, ph: u32, k2: u32) -> f32 {
    let h = it.h;
    switch MODE {
        case 1u: {      // k = j, s = n
            if (!valid(u, it, k)) { return 0.0; }
            return bv(u, row(u, it, k), it.g, s);
        }
        case 2u: {      // k = n, s = j
            if (!valid(u, it, s)) { return 0.0; }
            return bv(u, row(u, it, s), it.g, k);
        }
        case 3u: {      // k = j, then n; s = p
            if (ph == 0u) {
                if (!valid(u, it, k)) { return 0.0; }
                return xv(u, row(u, it, k), h, s);
            }
            return s_a3[u.o_a3 + st(u, it, it.c, h, s, k - k2)];
        }
        case 4u: {      // k = i, s = n
            if (!valid(u, it, k)) { return 0.0; }
            return cv(u, row(u, it, k), it.g, s);
        }
        case 5u: {      // k = i, then n; s = p
            if (ph == 0u) {
                if (!valid(u, it, k)) { return 0.0; }
                return s_a2[u.o_a2 + row(u, it, k) * Di + h * P + s];
            }
            return s_a3[u.o_a3 + st(u, it, it.c + 1u, h, s, k - k2)];
        }
        case 6u: {      // k = (h, p), s = j
            if (!valid(u, it, s)) { return 0.0; }
            return xv(u, row(u, it, s), h, k);
        }
        case 7u: {      // k = j, then (h, p); s = n
            if (ph == 0u) {
                if (!valid(u, it, k)) { return 0.0; }
                return bv(u, row(u, it, k), it.g, s);
            }
            let kk = k - k2;
            return s_a3[u.o_a3 + st(u, it, it.c, it.h + kk / P, kk % P, s)];
        }
        default: {      // 8: k = i, then (h, p); s = n
            if (ph == 0u) {
                if (!valid(u, it, k)) { return 0.0; }
                return cv(u, row(u, it, k), it.g, s);
            }
            let kk = k - k2;
            return s_a3[u.o_a3 + st(u, it, it.c + 1u, it.h + kk / P, kk % P, s)];
        }
    }
}

fn store(u: SS, it: Item, r: u32, s: u32, acc: f32) {
    let h = it.h;
    switch MODE {
        case 1u: { s_out[u.o_out + st(u, it, it.c + 1u, h, r, s)] = acc; }
        case 2u: { s_out[u.o_out + cbi(u, it, r, s)] = acc; }
        case 3u: {
            if (!valid(u, it, r)) { return; }
            let m = row(u, it, r);
            s_out[u.o_out + m * Di + h * P + s] = acc + s_small[H + h] * xv(u, m, h, s);
        }
        case 4u: { s_out[u.o_out + st(u, it, it.c, h, r, s)] = acc; }
        case 5u: {
            if (!valid(u, it, r)) { return; }
            let m = row(u, it, r);
            let dy = s_a2[u.o_a2 + m * Di + h * P + s];
            s_out[u.o_out + m * C + h * P + s] = dtv(u, m, h) * acc + s_small[H + h] * dy;
            s_out2[u.o_out2 + m * Di + h * P + s] = xv(u, m, h, s) * acc;
        }
        case 6u: { s_out[u.o_out + cbi(u, it, r, s)] = acc; }
        case 7u: {
            if (!valid(u, it, r)) { return; }
            s_out[u.o_out + row(u, it, r) * C + Di + (G + it.g) * N + s] = acc;
        }
        default: {
            if (!valid(u, it, r)) { return; }
            s_out[u.o_out + row(u, it, r) * C + Di + it.g * N + s] = acc;
        }
    }
}

// ---------------------------------------------------------------- the tiled product
const T: u32 = 64u;      // outputs per tile side
const TV: u32 = 17u;     // a tile row in workgroup memory: T / 4 vec4 and one of padding

// How a mode stages its K steps, as measured per mode (benchmarks/results/h100/ssd_staging/):
// wide (2 CB, 6 dCB, 7 dC, 8 dB; 0.40 ms less a layer at the mamba2-130m shape) K in steps of
// 32, an invocation's operands four adjacent elements a vec4 (`fetch`), the next step's loaded
// into registers while this one's are multiplied; the others (1, 3, 4, 5: the wide form tied at
// 1 and 4 and lost 0.17-0.18 ms at 3 and 5) K in steps of 16, each element computed and stored
// as it is staged.
// Both are pipeline constants (not functions of MODE in the body): each mode's pipeline then
// holds only its form, and its workgroup arrays only its K rows (with 32 rows and both forms
// in the body, modes 1, 3, 4 and 5 took 1.9x their time on the H100).
const WIDE_MODES: u32 = 0x1C4u;   // bit m: mode m is wide
override KT: u32 = select(16u, 32u, ((WIDE_MODES >> MODE) & 1u) != 0u);   // K a step stages
override KTV: u32 = KT * TV;
var<workgroup> tA: array<vec4<f32>, KTV>;   // [KT][TV]: r at tA[k * TV + r / 4][r % 4]
var<workgroup> tB: array<vec4<f32>, KTV>;   // [KT][TV]: s likewise
fn wide() -> bool { return KT == 32u; }

// the tile rows (r0 + orow(tr, a)) and columns (s0 + orow(ts, b)) of an invocation's 4 x 4
// outputs, a, b < 4: on GPUs four adjacent ones (one vec4 of a staged row each), on CPU
// adapters four 16 apart (adjacent invocations, which a CPU runs as SIMD lanes, on adjacent
// elements)
fn orow(t: u32, a: u32) -> u32 {
    if (STAGED != 0u) { return 4u * t + a; }
    return t + 16u * a;
}

// element e of a staged K step's tile: (k, r), k fastest where the operand has k contiguous
fn tile_at(e: u32, kfast: bool) -> vec2<u32> {
    if (kfast) { return vec2<u32>(e % KT, e / KT); }
    return vec2<u32>(e / T, e % T);
}

// an operand's element, zero past the tile's rows (columns) and past kend
fn a_el(u: SS, it: Item, d: vec4<u32>, r: u32, k: u32, kend: u32) -> f32 {
    if (r >= d.x || k >= kend) { return 0.0; }
    return a_at(u, it, r, k, select(0u, 1u, k >= d.w), d.w);
}
fn b_el(u: SS, it: Item, d: vec4<u32>, k: u32, s: u32, kend: u32) -> f32 {
    if (s >= d.y || k >= kend) { return 0.0; }
    return b_at(u, it, k, s, select(0u, 1u, k >= d.w), d.w);
}

// an invocation's elements of each operand's K step k0, four adjacent ones (along k where the
// operand has k contiguous, else along r or s) a vec4: KT / 16 of them (wide modes: 2). The four
// share their address arithmetic and factors (the compiler's to see once they are side by side).
fn fetch(u: SS, it: Item, d: vec4<u32>, r0: u32, s0: u32, k0: u32, kend: u32, lid: u32,
         va: ptr<function, array<vec4<f32>, 2>>, vb: ptr<function, array<vec4<f32>, 2>>) {
    let ph = select(0u, 1u, k0 >= d.w);
    let akf = a_kfast(ph);
    let bkf = b_kfast(ph);
    for (var q = 0u; q < KT / 16u; q++) {
        let e = 4u * (lid + q * 256u);
        let pa = tile_at(e, akf);
        let r = r0 + pa.y;
        let k = k0 + pa.x;
        if (akf) {
            (*va)[q] = vec4<f32>(a_el(u, it, d, r, k, kend), a_el(u, it, d, r, k + 1u, kend),
                                 a_el(u, it, d, r, k + 2u, kend), a_el(u, it, d, r, k + 3u, kend));
        } else {
            (*va)[q] = vec4<f32>(a_el(u, it, d, r, k, kend), a_el(u, it, d, r + 1u, k, kend),
                                 a_el(u, it, d, r + 2u, k, kend), a_el(u, it, d, r + 3u, k, kend));
        }
        let pb = tile_at(e, bkf);
        let s = s0 + pb.y;
        let kb = k0 + pb.x;
        if (bkf) {
            (*vb)[q] = vec4<f32>(b_el(u, it, d, kb, s, kend), b_el(u, it, d, kb + 1u, s, kend),
                                 b_el(u, it, d, kb + 2u, s, kend), b_el(u, it, d, kb + 3u, s, kend));
        } else {
            (*vb)[q] = vec4<f32>(b_el(u, it, d, kb, s, kend), b_el(u, it, d, kb, s + 1u, kend),
                                 b_el(u, it, d, kb, s + 2u, kend), b_el(u, it, d, kb, s + 3u, kend));
        }
    }
}

@compute @workgroup_size(256)
fn ssd_product(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let u = US;
    let w = wid.x + wid.y * nwg.x;
    let z = w / u.ntile;
    if (z >= u.Z) { return; }
    let it = item(u, z);
    let d = dims(u);
    let ns = (d.y + T - 1u) / T;
    let r0 = ((w % u.ntile) / ns) * T;
    let s0 = ((w % u.ntile) % ns) * T;
    let tr = lid / 16u;
    let ts = lid % 16u;
    // K in nh runs of kd: mode 6 a head's P at a time (its sum scaled by the head's decay into
    // tot), the others all of K at once
    var nh = 1u;
    var kd = d.z;
    if (MODE == 6u) { nh = H / G; kd = P; }
    var tot: array<vec4<f32>, 4>;
    var acc: array<vec4<f32>, 4>;
    for (var hl = 0u; hl < nh; hl++) {
        let kb = hl * kd;   // the run's first k
        acc = array<vec4<f32>, 4>();   // (assigned: a declaration in a loop body is not
                                       // zeroed each time by every compiler)
        if (STAGED == 0u) {     // CPU adapters: operands straight from memory, no barriers
            let ra = vec4<bool>(r0 + orow(tr, 0u) < d.x, r0 + orow(tr, 1u) < d.x, r0 + orow(tr, 2u) < d.x, r0 + orow(tr, 3u) < d.x);
            let sb = vec4<bool>(s0 + orow(ts, 0u) < d.y, s0 + orow(ts, 1u) < d.y, s0 + orow(ts, 2u) < d.y, s0 + orow(ts, 3u) < d.y);
            for (var k = kb; k < kb + kd; k++) {
                let ph = select(0u, 1u, k >= d.w);
                var av = vec4<f32>(0.0);
                var bq = vec4<f32>(0.0);
                if (ra.x) { av.x = a_at(u, it, r0 + orow(tr, 0u), k, ph, d.w); }
                if (ra.y) { av.y = a_at(u, it, r0 + orow(tr, 1u), k, ph, d.w); }
                if (ra.z) { av.z = a_at(u, it, r0 + orow(tr, 2u), k, ph, d.w); }
                if (ra.w) { av.w = a_at(u, it, r0 + orow(tr, 3u), k, ph, d.w); }
                if (sb.x) { bq.x = b_at(u, it, k, s0 + orow(ts, 0u), ph, d.w); }
                if (sb.y) { bq.y = b_at(u, it, k, s0 + orow(ts, 1u), ph, d.w); }
                if (sb.z) { bq.z = b_at(u, it, k, s0 + orow(ts, 2u), ph, d.w); }
                if (sb.w) { bq.w = b_at(u, it, k, s0 + orow(ts, 3u), ph, d.w); }
                acc[0] += av.x * bq;
                acc[1] += av.y * bq;
                acc[2] += av.z * bq;
                acc[3] += av.w * bq;
            }
        }
        // GPUs: K steps staged through workgroup memory
        let kend = kb + kd;
        var va: array<vec4<f32>, 2>;
        var vb: array<vec4<f32>, 2>;
        if (STAGED != 0u && wide()) { fetch(u, it, d, r0, s0, kb, kend, lid, &va, &vb); }
        for (var k0 = kb; k0 < kend * STAGED; k0 += KT) {
            let ph = select(0u, 1u, k0 >= d.w);
            let akf = a_kfast(ph);
            let bkf = b_kfast(ph);
            if (wide()) {       // the step's operands, fetched before: stored
                for (var q = 0u; q < KT / 16u; q++) {
                    let e = 4u * (lid + q * 256u);
                    let pa = tile_at(e, akf);
                    if (akf) {      // four k of one r
                        for (var l = 0u; l < 4u; l++) { tA[(pa.x + l) * TV + pa.y / 4u][pa.y % 4u] = va[q][l]; }
                    } else {        // four r of one k: one vec4 of the tile's row
                        tA[pa.x * TV + pa.y / 4u] = va[q];
                    }
                    let pb = tile_at(e, bkf);
                    if (bkf) {
                        for (var l = 0u; l < 4u; l++) { tB[(pb.x + l) * TV + pb.y / 4u][pb.y % 4u] = vb[q][l]; }
                    } else {
                        tB[pb.x * TV + pb.y / 4u] = vb[q];
                    }
                }
            } else {            // each element computed and stored (the step's phase)
                for (var q = 0u; q < 4u; q++) {
                    let e = lid + q * 256u;
                    let pa = tile_at(e, akf);
                    var v = 0.0;
                    if (r0 + pa.y < d.x && k0 + pa.x < kend) { v = a_at(u, it, r0 + pa.y, k0 + pa.x, ph, d.w); }
                    tA[pa.x * TV + pa.y / 4u][pa.y % 4u] = v;
                    let pb = tile_at(e, bkf);
                    var w = 0.0;
                    if (s0 + pb.y < d.y && k0 + pb.x < kend) { w = b_at(u, it, k0 + pb.x, s0 + pb.y, ph, d.w); }
                    tB[pb.x * TV + pb.y / 4u][pb.y % 4u] = w;
                }
            }
            workgroupBarrier();
            if (wide() && k0 + KT < kend) { fetch(u, it, d, r0, s0, k0 + KT, kend, lid, &va, &vb); }
            for (var kk = 0u; kk < KT; kk++) {
                let av = tA[kk * TV + tr];
                let bq = tB[kk * TV + ts];
                acc[0] += av.x * bq;
                acc[1] += av.y * bq;
                acc[2] += av.z * bq;
                acc[3] += av.w * bq;
            }
            workgroupBarrier();
        }
        if (MODE != 6u) {
            tot = acc;
            break;
        }
        // dcb += exp(a_hi - a_hj) dt_hj acc (j <= i; the exponent <= 0 there)
        let hh = it.h + hl;
        for (var a = 0u; a < 4u; a++) {
            let r = r0 + orow(tr, a);
            for (var b = 0u; b < 4u; b++) {
                let s = s0 + orow(ts, b);
                if (r < Q && s <= r && valid(u, it, s)) {
                    tot[a][b] += exp(acs(u, it, hh, r) - acs(u, it, hh, s)) * dtv(u, row(u, it, s), hh) * acc[a][b];
                }
            }
        }
    }
    for (var a = 0u; a < 4u; a++) {
        let r = r0 + orow(tr, a);
        if (r >= d.x) { continue; }
        for (var b = 0u; b < 4u; b++) {
            let s = s0 + orow(ts, b);
            if (s < d.y) { store(u, it, r, s, tot[a][b]); }
        }
    }
}

// ---------------------------------------------------------------- the small kernels
// a[b, c, h, i] = A_h * sum_{k <= i} dt (padding repeats the last), and exp(a_i), exp(last - a_i)
// (the products' row and column factors, one exp per step instead of one per operand load);
// a workgroup takes 256 / Q chunk-heads (b, c, h), an invocation a step, the sum over k a scan
// within each chunk-head's Q invocations (log2 Q steps; one invocation's loop over Q was
// 3.9 ms of the mamba2-130m step on an H100, benchmarks/results/h100/u4_loads/)
@compute @workgroup_size(256)
fn ssd_cumsum(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let u = US;
    let z = (wid.x + wid.y * nwg.x) * (256u / Q) + lid / Q;
    let i = lid % Q;
    let live = z < u.Z && lid < (256u / Q) * Q;
    var it: Item;
    var A = 0.0;
    var d = 0.0;
    if (live) {
        it = head_item(u, z);
        A = -exp(s_small[it.h]);
        if (valid(u, it, i)) { d = dtv(u, row(u, it, i), it.h); }
    }
    wdt[lid] = d;
    workgroupBarrier();
    for (var w = 1u; w < Q; w <<= 1u) {
        var f = 0.0;
        if (i >= w) { f = wdt[lid - w]; }
        workgroupBarrier();
        wdt[lid] += f;
        workgroupBarrier();
    }
    if (live) {
        let a = A * wdt[lid];
        let lst = A * wdt[lid - i + Q - 1u];
        s_small[u.o_acs + z * Q + i] = a;
        s_small[u.o_ei + z * Q + i] = exp(a);
        s_small[u.o_eo + z * Q + i] = exp(lst - a);
    }
}

// forward: states[b, c + 1] = exp(last_c) states[b, c] + (the chunk's own state, there already);
// backward (ssd_dstate_pass): dstates[b, c] = (the chunk's own term) + exp(last_c) dstates[b, c + 1]
// One invocation per (b, h, p, n).
fn pass_item(u: SS, i: u32) -> Item {
    var it: Item;
    it.b = i / (H * P * N);
    it.h = (i / (P * N)) % H;
    it.c = 0u;
    return it;
}

// where entry 0 of invocation i's (b, h, p, n) lies; entry c is c * H * P * N further
fn pass_base(u: SS, it: Item, i: u32) -> u32 { return u.o_out + st(u, it, 0u, it.h, 0u, 0u) + i % (P * N); }

@compute @workgroup_size(256)
fn ssd_state_pass(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let u = US;
    let i = lin(wid, nwg, lid);
    if (i >= u.Z) { return; }
    var it = pass_item(u, i);
    let s0 = pass_base(u, it, i);
    let step = H * P * N;
    var s = 0.0;
    s_out[s0] = 0.0;
    for (var c = 0u; c < u.NC; c++) {
        it.c = c;
        s = exp(last(u, it, it.h)) * s + s_out[s0 + (c + 1u) * step];
        s_out[s0 + (c + 1u) * step] = s;
    }
}

@compute @workgroup_size(256)
fn ssd_dstate_pass(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) lid: u32) {
    let u = US;
    let i = lin(wid, nwg, lid);
    if (i >= u.Z) { return; }
    var it = pass_item(u, i);
    let s0 = pass_base(u, it, i);
    let step = H * P * N;
    var g = 0.0;
    s_out[s0 + u.NC * step] = 0.0;
    for (var cr = 0u; cr < u.NC; cr++) {
        let c = u.NC - 1u - cr;
        it.c = c;
        g = s_out[s0 + c * step] + exp(last(u, it, it.h)) * g;
        s_out[s0 + c * step] = g;
    }
}

// dlast[b, c, h] = sum_{p, n} dstates[b, c + 1] * states[b, c + 1]; a workgroup per (b, c, h)
var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn ssd_dlast(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let u = US;
    let z = wid.x + wid.y * nwg.x;
    if (z >= u.Z) { return; }
    let it = head_item(u, z);
    let base = st(u, it, it.c + 1u, it.h, 0u, 0u);
    var s = 0.0;
    for (var e = lid; e < P * N; e += 256u) {
        s += s_a1[u.o_a1 + base + e] * s_a3[u.o_a3 + base + e];
    }
    red[lid] = s;
    workgroupBarrier();
    for (var w = 128u; w > 0u; w >>= 1u) {
        if (lid < w) { red[lid] += red[lid + w]; }
        workgroupBarrier();
    }
    if (lid == 0u) { s_small[u.o_dl + z] = red[0]; }
}

// A workgroup per (b, c, h); step i < Q (Q <= 256) has SPS = 256 / Q invocations:
//   r1_i = sum_p part[m, h*P + p] (= x_i . acc_i of the dx product), r2_i = sum_p dy (y - D x);
//   da_i = r2_i - dt_i r1_i (+ dlast at i = Q - 1); ddt_i = r1_i + A sum_{k >= i} da_k (WRITE);
//   the chunk's term of dA_log: A sum_i da_i sum_{k <= i} dt_k; of dD: sum_i sum_p dy x.
// The sums over k run as scans over the workgroup (log2 Q steps), not one invocation's loop.
// aux1 = part [M, Di], aux2 = dy [M, Di], aux3 = y [M, Di]; out = ddt [M, H]
var<workgroup> wda: array<f32, 256>;
var<workgroup> wr1: array<f32, 256>;
var<workgroup> wdd: array<f32, 256>;
var<workgroup> wdt: array<f32, 256>;

@compute @workgroup_size(256)
fn ssd_dt_chunk(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let u = US;
    let z = wid.x + wid.y * nwg.x;
    if (z >= u.Z) { return; }
    let it = head_item(u, z);
    let h = it.h;
    let Dh = s_small[H + h];
    let SPS = max(1u, 256u / Q);
    let i = lid / SPS;
    let j = lid % SPS;
    // this invocation's share of step i's sums over p (p = j, j + SPS, ...)
    var r1 = 0.0;
    var r2 = 0.0;
    var dd = 0.0;
    if (i < Q && valid(u, it, i)) {
        let m = row(u, it, i);
        for (var p = j; p < P; p += SPS) {
            let o = m * Di + h * P + p;
            let dy = s_a2[u.o_a2 + o];
            let x = xv(u, m, h, p);
            r1 += s_a1[u.o_a1 + o];
            r2 += dy * (s_a3[u.o_a3 + o] - Dh * x);
            dd += dy * x;
        }
    }
    wr1[lid] = r1;
    wda[lid] = r2;
    wdd[lid] = dd;
    workgroupBarrier();
    // step i's sums (invocation i < Q), its da and dt
    var dti = 0.0;
    if (lid < Q) {
        r1 = 0.0;
        r2 = 0.0;
        dd = 0.0;
        for (var q = 0u; q < SPS; q++) {
            r1 += wr1[lid * SPS + q];
            r2 += wda[lid * SPS + q];
            dd += wdd[lid * SPS + q];
        }
        if (valid(u, it, lid)) { dti = dtv(u, row(u, it, lid), h); }
    }
    var da = select(0.0, r2 - dti * r1, lid < Q);
    if (lid + 1u == Q) { da += s_small[u.o_dl + z]; }
    workgroupBarrier();
    wr1[lid] = select(0.0, r1, lid < Q);
    wda[lid] = da;                    // becomes sum_{k >= i} da_k
    wdt[lid] = dti;                   // becomes sum_{k <= i} dt_k
    wdd[lid] = select(0.0, dd, lid < Q);
    workgroupBarrier();
    for (var w = 1u; w < Q; w <<= 1u) {
        var fd = 0.0;
        var ft = 0.0;
        if (lid < Q && lid + w < Q) { fd = wda[lid + w]; }
        if (lid < Q && lid >= w) { ft = wdt[lid - w]; }
        workgroupBarrier();
        wda[lid] += fd;
        wdt[lid] += ft;
        workgroupBarrier();
    }
    let A = -exp(s_small[h]);
    if (lid < Q && valid(u, it, lid)) {
        s_out[u.o_out + row(u, it, lid) * H + h] = wr1[lid] + A * wda[lid];
    }
    // dA's terms da_i cum_i (da the step's own, in a register) and dD's, summed as a tree
    workgroupBarrier();
    wr1[lid] = da * wdt[lid];
    workgroupBarrier();
    for (var w = 128u; w > 0u; w >>= 1u) {
        if (lid < w) {
            wr1[lid] += wr1[lid + w];
            wdd[lid] += wdd[lid + w];
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        s_small[u.o_pa + z] = A * wr1[0];
        s_small[u.o_pd + z] = wdd[0];
    }
}
