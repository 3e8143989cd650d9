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
// memory; the backward walks a pass's states in halves of NH, see `hs`).  The forward saves the state before each chunk (states [B, nchk, Di, N]); the
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
    o_xz: u32, o_states: u32, off_pbc: u32, o_du: u32,
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
@group(0) @binding(8) var<storage, read_write> du: array<f32>;
@group(0) @binding(9) var<storage, read_write> ddelta: array<f32>;
@group(0) @binding(10) var<storage, read_write> dxz: array<f32>;
@group(0) @binding(11) var<storage, read_write> pbc: array<f32>;   // `work`, bound again (dbc)
@group(0) @binding(12) var<storage, read_write> dxdbl: array<f32>;
@group(0) @binding(13) var<storage, read_write> acc_out: array<f32>;
@group(0) @binding(14) var<uniform> P: Params;
@group(0) @binding(15) var<uniform> Q: AccParams;

const WG: u32 = 128u;   // threads per workgroup = SEG * DB
const DB: u32 = 16u;    // channels per workgroup
const SEG: u32 = 8u;    // time segments per chunk
const K: u32 = 8u;      // steps per segment (the register tile: two vec4)
const T: u32 = 64u;     // steps per chunk = SEG * K = CHUNK in engine/ops/scan.py
const NG: u32 = 16u;    // states per pass over workgroup memory
const NH: u32 = 8u;     // the backward's states per half of a pass (= SEG: one owner per segment)
const XR: u32 = NH * XS;   // the backward's butterfly exchange slots in xs (4 * WG of them)
const XS: u32 = 144u;   // row stride of xs/hs (= 16 mod 32: phase B reads without bank conflicts)
const BCS: u32 = 17u;   // row stride of bcv in vec4 (odd: the tile's writes spread over banks)

override SUBGROUPS: bool = true;   // false: the workgroup-memory butterfly even where subgroups exist

// Nothing per thread is an array (a private array indexed in a loop can end up in local
// memory): a segment's K = 8 steps are two vec4 registers, and the steps are written out.
var<workgroup> bcv: array<vec4<f32>, 544>;  // [NG][Bm, Cm][BCS]: vec4 q = steps 4q..4q+3 of the chunk
var<workgroup> xs: array<f32, 2304>;   // [NG][XS]: segment end state -> start state (-> dA partial)
// [NH][XS]: segment adjoint total -> adjoint entering from the right.  The backward walks a
// group's states in halves of NH (rows 0..NH of xs and hs; rows NH.. of xs are its butterfly's
// exchange slots without subgroups): its workgroup memory then stays at or under 24 KiB,
// which lets the H200 run two of its workgroups on an SM (30 KiB ran one).
var<workgroup> hs: array<f32, 1152>;
var<workgroup> ssum: array<f32, 128>;  // [WG]: sum of dt over each thread's segment
var<workgroup> ash: array<f32, 256>;   // [NG][DB]: A = -exp(A_log) of the block's channels
var<workgroup> qs_w: atomic<u32>;


fn off_bias() -> u32 { return P.Di * P.N; }
fn off_D() -> u32 { return P.Di * P.N + P.Di; }

// The chunk's Bm/Cm of states n0 .. n0+ng for bcv (zeros past L or N): thread tid moves
// column q = tid % 2NG (Bm 0..NG, Cm NG..2NG: consecutive threads read one row) of the
// chunk's steps r = tid / 2NG + 4k, k = 0..15 (WG = 4 * 2NG threads, T = 64 steps).  Where N
// fits one group the kernels load the next chunk's while this one computes (BcPart).
struct BcPart { v0: vec4<f32>, v1: vec4<f32>, v2: vec4<f32>, v3: vec4<f32> }

fn bc_val(b: u32, c: u32, n0: u32, ng: u32, tid: u32, k: u32) -> f32 {
    let r = tid / (2u * NG) + k * (WG / (2u * NG));
    let q = tid % (2u * NG);
    let t = c * T + r;
    if (q % NG < ng && t < P.L) {
        return xdbl[P.o_xdbl + (b * P.L + t) * P.ldx + P.R + (q / NG) * P.N + n0 + q % NG];
    }
    return 0.0;
}
fn bc_val4(b: u32, c: u32, n0: u32, ng: u32, tid: u32, k: u32) -> vec4<f32> {
    return vec4<f32>(bc_val(b, c, n0, ng, tid, k), bc_val(b, c, n0, ng, tid, k + 1u),
                     bc_val(b, c, n0, ng, tid, k + 2u), bc_val(b, c, n0, ng, tid, k + 3u));
}
fn bc_fetch(b: u32, c: u32, n0: u32, ng: u32, tid: u32) -> BcPart {
    return BcPart(bc_val4(b, c, n0, ng, tid, 0u), bc_val4(b, c, n0, ng, tid, 4u),
                  bc_val4(b, c, n0, ng, tid, 8u), bc_val4(b, c, n0, ng, tid, 12u));
}
fn bc_put4(v: vec4<f32>, tid: u32, k: u32) {
    let q = tid % (2u * NG);
    let col = ((q % NG) * 2u + q / NG) * BCS;
    for (var i = 0u; i < 4u; i++) {
        let r = tid / (2u * NG) + (k + i) * (WG / (2u * NG));
        bcv[col + r / 4u][r % 4u] = v[i];
    }
}
fn bc_store(p: BcPart, tid: u32) {
    bc_put4(p.v0, tid, 0u); bc_put4(p.v1, tid, 4u); bc_put4(p.v2, tid, 8u); bc_put4(p.v3, tid, 12u);
}

// A of the block's channels, states n0 .. n0+ng, into ash
fn load_a(blk: u32, n0: u32, ng: u32, tid: u32) {
    for (var i = tid; i < NG * DB; i += WG) {
        let nn = i / DB;
        let d = blk * DB + i % DB;
        var a = 0.0;
        if (nn < ng && d < P.Di) { a = -exp(work[d * P.N + n0 + nn]); }
        ash[i] = a;
    }
}

// states n0 + j and n0 + j + 8 of channel d's saved state before chunk c (its copy in work)
fn saved_states(b: u32, c: u32, d: u32, live: bool, n0: u32, ng: u32, j: u32) -> vec2<f32> {
    let base = P.off_st + ((b * P.nchk + c) * P.Di + d) * P.N + n0;
    var st = vec2<f32>(0.0);
    if (live && j < ng) { st.x = work[base + j]; }
    if (live && j + 8u < ng) { st.y = work[base + j + 8u]; }
    return st;
}

fn load_group(b: u32, c: u32, blk: u32, n0: u32, ng: u32, tid: u32) {
    bc_store(bc_fetch(b, c, n0, ng, tid), tid);
    load_a(blk, n0, ng, tid);
}

// Bm (bc 0) or Cm (bc 1) of state n at steps 4h..4h+3 of segment j
fn bc4(n: u32, bc: u32, j: u32, h: u32) -> vec4<f32> { return bcv[(n * 2u + bc) * BCS + j * 2u + h]; }

// u of step t of channel d, zero past L and Di
fn in_u(b: u32, t: u32, d: u32, ok: bool) -> f32 {
    if (ok && t < P.L) { return u[P.o_u + (b * P.L + t) * P.Di + d]; }
    return 0.0;
}
// the same for the four steps t .. t+3
fn in_u4(b: u32, t: u32, d: u32, ok: bool) -> vec4<f32> {
    return vec4<f32>(in_u(b, t, d, ok), in_u(b, t + 1u, d, ok), in_u(b, t + 2u, d, ok), in_u(b, t + 3u, d, ok));
}

fn in_raw(b: u32, t: u32, d: u32, ok: bool) -> f32 {   // delta, without the bias or softplus
    if (ok && t < P.L) { return delta[P.o_delta + (b * P.L + t) * P.Di + d]; }
    return 0.0;
}
fn in_raw4(b: u32, t: u32, d: u32, ok: bool) -> vec4<f32> {
    return vec4<f32>(in_raw(b, t, d, ok), in_raw(b, t + 1u, d, ok), in_raw(b, t + 2u, d, ok), in_raw(b, t + 3u, d, ok));
}
// dt = softplus(delta + bias) of steps t..t+3 from their raw delta (0 past L or Di)
fn dt_of4(r: vec4<f32>, t: u32, ok: bool, bias: f32) -> vec4<f32> {
    let v = vec4<bool>(t < P.L, t + 1u < P.L, t + 2u < P.L, t + 3u < P.L) & vec4<bool>(ok);
    let sp = vec4<f32>(softplus(r.x + bias), softplus(r.y + bias), softplus(r.z + bias), softplus(r.w + bias));
    return select(vec4<f32>(0.0), sp, v);
}

// the state after 4 steps from s (decays e, inputs p = dt*u*Bm), and the 4 states after each
fn walk4(s: f32, e: vec4<f32>, p: vec4<f32>) -> vec4<f32> {
    let s0 = fma(e.x, s, p.x);
    let s1 = fma(e.y, s0, p.y);
    let s2 = fma(e.z, s1, p.z);
    let s3 = fma(e.w, s2, p.w);
    return vec4<f32>(s0, s1, s2, s3);
}

// Phase A's walk of state n over a segment's 8 steps from a zero start (both passes): the
// steps' decays exp(dt*A) (e0: steps 0..3, e1: 4..7) and the state at the segment's end.
struct SegWalk { e0: vec4<f32>, e1: vec4<f32>, s: f32 }
fn seg_walk(n: u32, dl: u32, j: u32, dt0: vec4<f32>, dt1: vec4<f32>, du0: vec4<f32>, du1: vec4<f32>) -> SegWalk {
    let a = ash[n * DB + dl];
    let e0 = exp(dt0 * a);
    let e1 = exp(dt1 * a);
    let s0 = walk4(0.0, e0, du0 * bc4(n, 0u, j, 0u));
    return SegWalk(e0, e1, walk4(s0.w, e1, du1 * bc4(n, 0u, j, 1u)).w);
}

// ---------------------------------------------------------------- forward
// grid: B * nblk workgroups.  y WRITE; states[b, c] = the state before chunk c WRITE.

// exp(A * sum of dt) of each of the 8 segments for channel lane dl (segment sums in ssum):
// segments 0..3 and 4..7
fn seg_decay0(dl: u32, a: f32) -> vec4<f32> {
    return exp(a * vec4<f32>(ssum[dl], ssum[DB + dl], ssum[2u * DB + dl], ssum[3u * DB + dl]));
}
fn seg_decay1(dl: u32, a: f32) -> vec4<f32> {
    return exp(a * vec4<f32>(ssum[4u * DB + dl], ssum[5u * DB + dl], ssum[6u * DB + dl], ssum[7u * DB + dl]));
}

// owner of (channel d, state n) in phase B: the start state of each segment (into xs, over
// its end state from a zero start) from the state entering the chunk; returns the state
// leaving the chunk.  e0, e1: the segments' decays.
fn carry_states(n: u32, dl: u32, e0: vec4<f32>, e1: vec4<f32>, s_in: f32) -> f32 {
    let r = n * XS + dl;
    var s = s_in;
    var x = xs[r];            xs[r] = s;            s = fma(e0.x, s, x);
    x = xs[r + DB];           xs[r + DB] = s;       s = fma(e0.y, s, x);
    x = xs[r + 2u * DB];      xs[r + 2u * DB] = s;  s = fma(e0.z, s, x);
    x = xs[r + 3u * DB];      xs[r + 3u * DB] = s;  s = fma(e0.w, s, x);
    x = xs[r + 4u * DB];      xs[r + 4u * DB] = s;  s = fma(e1.x, s, x);
    x = xs[r + 5u * DB];      xs[r + 5u * DB] = s;  s = fma(e1.y, s, x);
    x = xs[r + 6u * DB];      xs[r + 6u * DB] = s;  s = fma(e1.z, s, x);
    x = xs[r + 7u * DB];      xs[r + 7u * DB] = s;  s = fma(e1.w, s, x);
    return s;
}

fn fwd_carry(n: u32, dl: u32, a: f32, s_in: f32) -> f32 {
    return carry_states(n, dl, seg_decay0(dl, a), seg_decay1(dl, a), s_in);
}

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
    // phase-B owners: (channel dl, state j) and (dl, j + 8); their chunk carries when N <= NG
    var car0 = 0.0;
    var car1 = 0.0;
    // a segment's raw delta and u, loaded a chunk before they are used (see seg_in)
    var nr0 = in_raw4(b, j * K, d, live);
    var nr1 = in_raw4(b, j * K + 4u, d, live);
    var nu0 = in_u4(b, j * K, d, live);
    var nu1 = in_u4(b, j * K + 4u, d, live);
    var nz0 = in_z4(b, j * K, d, live);
    var nz1 = in_z4(b, j * K + 4u, d, live);
    var bcn = bc_fetch(b, 0u, 0u, min(NG, P.N), tid);   // (used where N fits one group)
    if (ngrp == 1u) { load_a(blk, 0u, P.N, tid); }
    for (var c = 0u; c < P.nchk; c++) {
        let t0 = c * T + j * K;
        let r0 = nr0;
        let r1 = nr1;
        let u0 = nu0;
        let u1 = nu1;
        let z0 = nz0;
        let z1 = nz1;
        if (c + 1u < P.nchk) {
            nr0 = in_raw4(b, t0 + T, d, live);
            nr1 = in_raw4(b, t0 + T + 4u, d, live);
            nu0 = in_u4(b, t0 + T, d, live);
            nu1 = in_u4(b, t0 + T + 4u, d, live);
            nz0 = in_z4(b, t0 + T, d, live);
            nz1 = in_z4(b, t0 + T + 4u, d, live);
        }
        let dt0 = dt_of4(r0, t0, live, bias);
        let dt1 = dt_of4(r1, t0 + 4u, live, bias);
        let du0 = dt0 * u0;
        let du1 = dt1 * u1;
        let sdt = dot(dt0 + dt1, vec4<f32>(1.0));
        var y0 = vec4<f32>(0.0);
        var y1 = vec4<f32>(0.0);
        for (var g = 0u; g < ngrp; g++) {
            let n0 = g * NG;
            let ng = min(NG, P.N - n0);
            if (ngrp == 1u) {   // (ash holds A from before the loop)
                bc_store(bcn, tid);
                if (c + 1u < P.nchk) { bcn = bc_fetch(b, c + 1u, 0u, ng, tid); }
            } else {
                load_group(b, c, blk, n0, ng, tid);
            }
            workgroupBarrier();
            // A: the segment's end state from a zero start
            for (var n = 0u; n < ng; n++) {
                xs[n * XS + tid] = seg_walk(n, dl, j, dt0, dt1, du0, du1).s;
            }
            ssum[tid] = sdt;
            workgroupBarrier();
            // B: the owners carry the state across the segments (and the chunks)
            let base = ((b * P.nchk + c) * P.Di + d) * P.N + n0;
            if (j < ng) {
                var s = car0;   // N <= NG: kept in a register
                if (ngrp > 1u) {
                    s = 0.0;
                    if (c > 0u && live) { s = states[P.o_states + base + j]; }   // this thread wrote it
                }
                if (live) { states[P.o_states + base + j] = s; }
                s = fwd_carry(j, dl, ash[j * DB + dl], s);
                car0 = s;
                if (ngrp > 1u && live && c + 1u < P.nchk) { states[P.o_states + base + P.Di * P.N + j] = s; }
            }
            if (j + 8u < ng) {
                var s = car1;   // N <= NG: kept in a register
                if (ngrp > 1u) {
                    s = 0.0;
                    if (c > 0u && live) { s = states[P.o_states + base + j + 8u]; }   // this thread wrote it
                }
                if (live) { states[P.o_states + base + j + 8u] = s; }
                s = fwd_carry(j + 8u, dl, ash[(j + 8u) * DB + dl], s);
                car1 = s;
                if (ngrp > 1u && live && c + 1u < P.nchk) { states[P.o_states + base + P.Di * P.N + j + 8u] = s; }
            }
            workgroupBarrier();
            // C: every segment again from its true start state; y += s * Cm
            for (var n = 0u; n < ng; n++) {
                let a = ash[n * DB + dl];
                let e0 = exp(dt0 * a);
                let e1 = exp(dt1 * a);
                let s0 = walk4(xs[n * XS + tid], e0, du0 * bc4(n, 0u, j, 0u));
                let s1 = walk4(s0.w, e1, du1 * bc4(n, 0u, j, 1u));
                y0 = fma(s0, bc4(n, 1u, j, 0u), y0);
                y1 = fma(s1, bc4(n, 1u, j, 1u), y1);
            }
            workgroupBarrier();
        }
        y0 += Dd * u0;
        y1 += Dd * u1;
        out_y(b, t0, d, live, y0.x, z0.x);
        out_y(b, t0 + 1u, d, live, y0.y, z0.y);
        out_y(b, t0 + 2u, d, live, y0.z, z0.z);
        out_y(b, t0 + 3u, d, live, y0.w, z0.w);
        out_y(b, t0 + 4u, d, live, y1.x, z1.x);
        out_y(b, t0 + 5u, d, live, y1.y, z1.y);
        out_y(b, t0 + 6u, d, live, y1.z, z1.z);
        out_y(b, t0 + 7u, d, live, y1.w, z1.w);
    }
}

fn out_y(b: u32, t: u32, d: u32, ok: bool, v: f32, z: f32) {
    if (ok && t < P.L) {
        y[P.o_y + (b * P.L + t) * P.Di + d] = v * silu(z);
    }
}
// z of steps t..t+3 of channel d (0 past L or Di), loaded a chunk ahead like dt and u
fn in_z(b: u32, t: u32, d: u32, ok: bool) -> f32 {
    if (ok && t < P.L) { return xz[P.o_xz + (b * P.L + t) * 2u * P.Di + P.Di + d]; }
    return 0.0;
}
fn in_z4(b: u32, t: u32, d: u32, ok: bool) -> vec4<f32> {
    return vec4<f32>(in_z(b, t, d, ok), in_z(b, t + 1u, d, ok), in_z(b, t + 2u, d, ok), in_z(b, t + 3u, d, ok));
}

// ---------------------------------------------------------------- backward
// (dy * silu(z), dy * silu'(z)): the output gate's two gradients, taken by the backward
// kernels from dy (in du, which they overwrite) and z as they go
fn gate_grads(g: f32, z: f32) -> vec2<f32> {
    let sz = sigmoid(z);
    return vec2<f32>(g * z * sz, g * sz * (1.0 + z * (1.0 - sz)));
}

// the same for four steps: .g = dy*silu(z), .s = dy*silu'(z)
struct Gate4 { g: vec4<f32>, s: vec4<f32> }
fn gate4(dy: vec4<f32>, z: vec4<f32>) -> Gate4 {
    let a = gate_grads(dy.x, z.x);
    let b = gate_grads(dy.y, z.y);
    let c = gate_grads(dy.z, z.z);
    let d = gate_grads(dy.w, z.w);
    return Gate4(vec4<f32>(a.x, b.x, c.x, d.x), vec4<f32>(a.y, b.y, c.y, d.y));
}

// owner of (d, n) in phase B of the backward: the segments' start states from the chunk's
// saved state s, and the adjoint entering each segment from the right from hc (what the
// next chunk passes in); returns what this chunk passes to the previous one
fn bwd_carry(n: u32, dl: u32, a: f32, s_in: f32, hc_in: f32) -> f32 {
    let e0 = seg_decay0(dl, a);
    let e1 = seg_decay1(dl, a);
    carry_states(n, dl, e0, e1, s_in);   // (what leaves the chunk is the next chunk's saved state)
    let r = n * XS + dl;
    var h = hc_in;
    var x = hs[r + 7u * DB];  hs[r + 7u * DB] = h;  h = fma(e1.w, h, x);
    x = hs[r + 6u * DB];      hs[r + 6u * DB] = h;  h = fma(e1.z, h, x);
    x = hs[r + 5u * DB];      hs[r + 5u * DB] = h;  h = fma(e1.y, h, x);
    x = hs[r + 4u * DB];      hs[r + 4u * DB] = h;  h = fma(e1.x, h, x);
    x = hs[r + 3u * DB];      hs[r + 3u * DB] = h;  h = fma(e0.w, h, x);
    x = hs[r + 2u * DB];      hs[r + 2u * DB] = h;  h = fma(e0.z, h, x);
    x = hs[r + DB];           hs[r + DB] = h;       h = fma(e0.y, h, x);
    x = hs[r];                hs[r] = h;            h = fma(e0.x, h, x);
    return h;
}

// One butterfly stage over the segment's channel lanes: lanes whose bit m is set keep `hi`
// and send `lo`, the others the opposite; each adds its partner's copy of what it keeps.
// Subgroup shuffles when the partner is in the same subgroup (m < qs), else workgroup memory.
fn bfly(lo: vec4<f32>, hi: vec4<f32>, m: u32, dl: u32, tid: u32, qs: u32) -> vec4<f32> {
    let up = (dl & m) != 0u;
    let keep = select(lo, hi, up);
    let send = select(hi, lo, up);
    if (m < qs) { return keep + sg_xor4(send, m); }
    xs[XR + tid] = send.x; xs[XR + WG + tid] = send.y; xs[XR + 2u * WG + tid] = send.z; xs[XR + 3u * WG + tid] = send.w;
    workgroupBarrier();
    let o = tid ^ m;
    let got = vec4<f32>(xs[XR + o], xs[XR + WG + o], xs[XR + 2u * WG + o], xs[XR + 3u * WG + o]);
    workgroupBarrier();
    return keep + got;
}

fn bfly2(lo: vec2<f32>, hi: vec2<f32>, m: u32, dl: u32, tid: u32, qs: u32) -> vec2<f32> {
    let up = (dl & m) != 0u;
    let keep = select(lo, hi, up);
    let send = select(hi, lo, up);
    if (m < qs) { return keep + sg_xor2(send, m); }
    xs[XR + tid] = send.x; xs[XR + WG + tid] = send.y;
    workgroupBarrier();
    let got = vec2<f32>(xs[XR + (tid ^ m)], xs[XR + WG + (tid ^ m)]);
    workgroupBarrier();
    return keep + got;
}

fn bfly1(lo: f32, hi: f32, m: u32, dl: u32, tid: u32, qs: u32) -> f32 {
    let up = (dl & m) != 0u;
    let keep = select(lo, hi, up);
    let send = select(hi, lo, up);
    if (m < qs) { return keep + sg_xor1(send, m); }
    xs[XR + tid] = send;
    workgroupBarrier();
    let got = xs[XR + (tid ^ m)];
    workgroupBarrier();
    return keep + got;
}

// scan (b, block): du (holding dy on entry: each step's dy is read before its du is
// written, by the same thread), ddelta WRITE; dxz[:, Di..] = dy*silu'(z) * y_pre WRITE;
// dBm/dCm partial sums of the block -> work[off_pbc..] [2][M][nblk][N]; per-b partials of dA_log (over A),
// of dt_bias and of D into work (summed over b by selective_scan_accumulate).
// `work` holds, besides the parameters: a copy of `states` at off_st and, when N > NG, the
// adjoint carried between chunks at off_hc.
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
    if (tid == 0u) { atomicStore(&qs_w, 0u); }
    workgroupBarrier();
    atomicMax(&qs_w, DB / qs);
    let QS = DB / workgroupUniformLoad(&qs_w);
    if (wg == 0u && tid == 0u) { work[P.off_pd + P.B * P.Di] = f32(QS); }   // butterfly_lanes()

    var bsum = 0.0;   // this thread's sum of ddelta (-> dt_bias)
    var dsum = 0.0;   // and of dy'*u (-> D)
    // phase-B owners (dl, j), (dl, j + 8): adjoint carries and dA sums when N <= NG
    var hc0 = 0.0;
    var hc1 = 0.0;
    var da0 = 0.0;
    var da1 = 0.0;
    var nxt = seg_in(b, (P.nchk - 1u) * T + j * K, d, live);
    var bcn = bc_fetch(b, P.nchk - 1u, 0u, min(NG, P.N), tid);   // (used where N fits one group)
    if (ngrp == 1u) { load_a(blk, 0u, P.N, tid); }
    var stn = saved_states(b, P.nchk - 1u, d, live, 0u, min(NG, P.N), j);
    for (var cc = 0u; cc < P.nchk; cc++) {
        let c = P.nchk - 1u - cc;
        let t0 = c * T + j * K;
        let cur = nxt;
        if (c > 0u) { nxt = seg_in(b, t0 - T, d, live); }   // the next chunk's, in flight meanwhile
        let dt0 = dt_of4(cur.r0, t0, live, bias);
        let dt1 = dt_of4(cur.r1, t0 + 4u, live, bias);
        let u0 = cur.u0;
        let u1 = cur.u1;
        let gz0 = gate4(cur.g0, cur.z0);   // dy' = dy*silu(z) and dy*silu'(z)
        let gz1 = gate4(cur.g1, cur.z1);
        let g0 = gz0.g;
        let g1 = gz1.g;
        let du0 = dt0 * u0;
        let du1 = dt1 * u1;
        let sdt = dot(dt0 + dt1, vec4<f32>(1.0));
        var gb0 = vec4<f32>(0.0);   // sum_n adjoint * Bm      (du = dt*gb + D*dy')
        var gb1 = vec4<f32>(0.0);
        var gd0 = vec4<f32>(0.0);   // d(dt)
        var gd1 = vec4<f32>(0.0);
        var yp0 = vec4<f32>(0.0);   // sum_n s * Cm            (y_pre = yp + D*u)
        var yp1 = vec4<f32>(0.0);
        for (var g = 0u; g < ngrp; g++) {
            let n0 = g * NG;
            let ng = min(NG, P.N - n0);
            let hbase = P.off_hc + (b * P.Di + d) * P.N + n0;
            var st = stn;   // states j, j + 8 of the saved state before this chunk
            if (ngrp > 1u) {
                st = saved_states(b, c, d, live, n0, ng, j);
            } else if (c > 0u) {
                stn = saved_states(b, c - 1u, d, live, 0u, ng, j);
            }
            let st0 = st.x;
            let st1 = st.y;
            if (ngrp > 1u) {
                hc0 = 0.0;
                hc1 = 0.0;
                if (cc > 0u && live && j < ng) { hc0 = work[hbase + j]; }
                if (cc > 0u && live && j + 8u < ng) { hc1 = work[hbase + j + 8u]; }
            }
            if (ngrp == 1u) {   // (ash holds A from before the loop)
                bc_store(bcn, tid);
                if (c > 0u) { bcn = bc_fetch(b, c - 1u, 0u, ng, tid); }
            } else {
                load_group(b, c, blk, n0, ng, tid);
            }
            workgroupBarrier();
            // the group's states in halves of NH (rows k = n - nh0 of xs and hs); owner (dl, j)
            // of phase B takes state nh0 + j of each half (half 0: hc0, st0, da0; half 1: hc1, ...)
            for (var nh0 = 0u; nh0 < ng; nh0 += NH) {
                let nk = min(NH, ng - nh0);
                if (nh0 > 0u) { workgroupBarrier(); }   // the previous half's dA sums have read xs
                // A: the segment's end state from a zero start, and its adjoint total
                //    h = sum_k exp(A * (dt_0 + .. + dt_k)) * Cm_k * dy'_k  (what it passes to the left)
                for (var k = 0u; k < nk; k++) {
                    let n = nh0 + k;
                    let sw = seg_walk(n, dl, j, dt0, dt1, du0, du1);
                    xs[k * XS + tid] = sw.s;
                    let e0 = sw.e0;
                    let e1 = sw.e1;
                    // running decay products w_k = e_0 * .. * e_k
                    let w0 = vec4<f32>(e0.x, e0.x * e0.y, e0.x * e0.y * e0.z, e0.x * e0.y * e0.z * e0.w);
                    let w1 = w0.w * vec4<f32>(e1.x, e1.x * e1.y, e1.x * e1.y * e1.z, e1.x * e1.y * e1.z * e1.w);
                    hs[k * XS + tid] = dot(w0, bc4(n, 1u, j, 0u) * g0) + dot(w1, bc4(n, 1u, j, 1u) * g1);
                }
                ssum[tid] = sdt;
                workgroupBarrier();
                // B: the owners carry the state rightwards from the saved chunk state and the
                //    adjoint leftwards from the next chunk's
                let second = nh0 > 0u;
                if (j < nk) {
                    let hc = bwd_carry(j, dl, ash[(nh0 + j) * DB + dl], select(st0, st1, second), select(hc0, hc1, second));
                    if (second) { hc1 = hc; } else { hc0 = hc; }
                    if (ngrp > 1u && live) { work[hbase + nh0 + j] = hc; }
                }
                workgroupBarrier();
                // C: per state, the 8 steps forward (states) and backward (adjoint, gradients)
                for (var k = 0u; k < nk; k++) {
                    let n = nh0 + k;
                    let a = ash[n * DB + dl];
                    let e0 = exp(dt0 * a);
                    let e1 = exp(dt1 * a);
                    let b0 = bc4(n, 0u, j, 0u);
                    let b1 = bc4(n, 0u, j, 1u);
                    let c0 = bc4(n, 1u, j, 0u);
                    let c1 = bc4(n, 1u, j, 1u);
                    let p0 = du0 * b0;
                    let p1 = du1 * b1;
                    // states after each step, then before each step
                    let sa0 = walk4(xs[k * XS + tid], e0, p0);
                    let sa1 = walk4(sa0.w, e1, p1);
                    let sb0 = vec4<f32>(xs[k * XS + tid], sa0.xyz);
                    let sb1 = vec4<f32>(sa0.w, sa1.xyz);
                    // adjoint g_k = Cm_k dy'_k + e_{k+1} g_{k+1}, from the right
                    let cd0 = c0 * g0;
                    let cd1 = c1 * g1;
                    let a7 = cd1.w + hs[k * XS + tid];
                    let a6 = fma(e1.w, a7, cd1.z);
                    let a5 = fma(e1.z, a6, cd1.y);
                    let a4 = fma(e1.y, a5, cd1.x);
                    let a3 = fma(e1.x, a4, cd0.w);
                    let a2 = fma(e0.w, a3, cd0.z);
                    let a1 = fma(e0.z, a2, cd0.y);
                    let a0 = fma(e0.y, a1, cd0.x);
                    let ad0 = vec4<f32>(a0, a1, a2, a3);
                    let ad1 = vec4<f32>(a4, a5, a6, a7);
                    let q0 = e0 * sb0;   // decayed previous state
                    let q1 = e1 * sb1;
                    gb0 = fma(ad0, b0, gb0);
                    gb1 = fma(ad1, b1, gb1);
                    gd0 = fma(ad0, fma(vec4<f32>(a), q0, b0 * u0), gd0);
                    gd1 = fma(ad1, fma(vec4<f32>(a), q1, b1 * u1), gd1);
                    yp0 = fma(sa0, c0, yp0);
                    yp1 = fma(sa1, c1, yp1);
                    xs[k * XS + tid] = dot(ad0 * q0, dt0) + dot(ad1 * q1, dt1);   // dA term (slot read above)
                    // dBm = adjoint*dt*u and dCm = s*dy' summed over the segment's 16 channels:
                    // lane dl ends with value dl of (dBm steps 0..7, dCm steps 0..7)
                    let w8a = bfly(ad0 * du0, sa0 * g0, 8u, dl, tid, QS);
                    let w8b = bfly(ad1 * du1, sa1 * g1, 8u, dl, tid, QS);
                    let w4 = bfly(w8a, w8b, 4u, dl, tid, QS);
                    let w2 = bfly2(w4.xy, w4.zw, 2u, dl, tid, QS);
                    let w1 = bfly1(w2.x, w2.y, 1u, dl, tid, QS);
                    let t = c * T + j * K + dl % K;
                    if (t < P.L) {
                        work[P.off_pbc + (dl / K) * P.pbc_half + ((b * P.L + t) * P.nblk + blk) * P.N + n0 + n] = w1;
                    }
                }
                workgroupBarrier();
                // dA_log partial of (b, d, state nh0 + j): this chunk's sum over the segments
                if (j < nk) {
                    var sa = 0.0;
                    for (var jj = 0u; jj < SEG; jj++) { sa += xs[j * XS + jj * DB + dl]; }
                    if (ngrp > 1u) {
                        let pa = P.off_pa + (b * P.Di + d) * P.N + n0 + nh0 + j;
                        if (live) { work[pa] = select(0.0, work[pa], cc > 0u) + sa; }
                    } else if (second) {
                        da1 += sa;
                    } else {
                        da0 += sa;
                    }
                }
            }
        }
        bsum += out_bwd(b, t0, d, live, bias, Dd, dt0.x, gb0.x, gd0.x, yp0.x, g0.x, u0.x, cur.r0.x, gz0.s.x);
        bsum += out_bwd(b, t0 + 1u, d, live, bias, Dd, dt0.y, gb0.y, gd0.y, yp0.y, g0.y, u0.y, cur.r0.y, gz0.s.y);
        bsum += out_bwd(b, t0 + 2u, d, live, bias, Dd, dt0.z, gb0.z, gd0.z, yp0.z, g0.z, u0.z, cur.r0.z, gz0.s.z);
        bsum += out_bwd(b, t0 + 3u, d, live, bias, Dd, dt0.w, gb0.w, gd0.w, yp0.w, g0.w, u0.w, cur.r0.w, gz0.s.w);
        bsum += out_bwd(b, t0 + 4u, d, live, bias, Dd, dt1.x, gb1.x, gd1.x, yp1.x, g1.x, u1.x, cur.r1.x, gz1.s.x);
        bsum += out_bwd(b, t0 + 5u, d, live, bias, Dd, dt1.y, gb1.y, gd1.y, yp1.y, g1.y, u1.y, cur.r1.y, gz1.s.y);
        bsum += out_bwd(b, t0 + 6u, d, live, bias, Dd, dt1.z, gb1.z, gd1.z, yp1.z, g1.z, u1.z, cur.r1.z, gz1.s.z);
        bsum += out_bwd(b, t0 + 7u, d, live, bias, Dd, dt1.w, gb1.w, gd1.w, yp1.w, g1.w, u1.w, cur.r1.w, gz1.s.w);
        dsum += dot(g0, u0) + dot(g1, u1);
    }
    if (ngrp == 1u && live) {
        let pa = P.off_pa + (b * P.Di + d) * P.N;
        if (j < P.N) { work[pa + j] = da0; }
        if (j + 8u < P.N) { work[pa + j + 8u] = da1; }
    }
    // dt_bias and D partials of (b, d): sum over the segments of ddelta and of dy'*u
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

fn in_g(b: u32, t: u32, d: u32, ok: bool) -> f32 {   // dy, in du until the step is written
    if (ok && t < P.L) { return du[P.o_du + (b * P.L + t) * P.Di + d]; }
    return 0.0;
}
fn in_g4(b: u32, t: u32, d: u32, ok: bool) -> vec4<f32> {
    return vec4<f32>(in_g(b, t, d, ok), in_g(b, t + 1u, d, ok), in_g(b, t + 2u, d, ok), in_g(b, t + 3u, d, ok));
}
// A segment's inputs (steps t..t+7), loaded a chunk before they are used: raw values only,
// so nothing waits for the loads until the next chunk starts.
struct SegIn { r0: vec4<f32>, r1: vec4<f32>, u0: vec4<f32>, u1: vec4<f32>, g0: vec4<f32>, g1: vec4<f32>,
               z0: vec4<f32>, z1: vec4<f32> }
fn seg_in(b: u32, t: u32, d: u32, ok: bool) -> SegIn {
    return SegIn(in_raw4(b, t, d, ok), in_raw4(b, t + 4u, d, ok), in_u4(b, t, d, ok), in_u4(b, t + 4u, d, ok),
                 in_g4(b, t, d, ok), in_g4(b, t + 4u, d, ok), in_z4(b, t, d, ok), in_z4(b, t + 4u, d, ok));
}

// writes the step's outputs; returns its ddelta (0 past L or Di) for the dt_bias sum
fn out_bwd(b: u32, t: u32, d: u32, ok: bool, bias: f32, Dd: f32, dt: f32, gb: f32, gd: f32, yp: f32,
           g: f32, uu: f32, raw: f32, zs: f32) -> f32 {
    if (ok && t < P.L) {
        let m = b * P.L + t;
        let e = m * P.Di + d;
        du[P.o_du + e] = fma(dt, gb, Dd * g);
        let dd = gd * sigmoid(raw + bias);
        ddelta[P.o_ddelta + e] = dd;
        let zi = P.o_dxz + m * 2u * P.Di + P.Di + d;
        dxz[zi] = zs * fma(Dd, uu, yp);   // dy * silu'(z) * y_pre
        return dd;
    }
    return 0.0;
}

// dbc (m, n): dxdbl[m, R+n] = sum over the channel blocks of the dBm partials; dCm likewise
// (the partials in `work` from off_pbc, bound here at binding 11)
@compute @workgroup_size(256)
fn selective_scan_backward_dbc(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                               @builtin(local_invocation_index) lid: u32) {
    let pr = P;   // read once: on lavapipe a uniform read after a branch is a gather
    let i = (wid.x + wid.y * nwg.x) * 256u + lid;
    let M = pr.B * pr.L;
    if (i >= M * pr.N) { return; }
    let m = i / pr.N;
    let n = i % pr.N;
    var sb = 0.0;
    var sc = 0.0;
    for (var q = 0u; q < pr.nblk; q++) {
        let o = (m * pr.nblk + q) * pr.N + n;
        sb += pbc[pr.off_pbc + o];
        sc += pbc[pr.off_pbc + pr.pbc_half + o];
    }
    let row = pr.o_dxdbl + m * pr.ldx + pr.R;
    dxdbl[row + n] = sb;
    dxdbl[row + pr.N + n] = sc;
}

// accumulate: acc_out[o_out + i] += sum_k work[base + k*stride + i] (* A)   (parameter gradients)
@compute @workgroup_size(256)
fn selective_scan_accumulate(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                             @builtin(local_invocation_index) lid: u32) {
    let qr = Q;   // read once: on lavapipe a uniform read after a branch is a gather
    let i = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (i >= qr.n) { return; }
    var acc = 0.0;
    for (var k = 0u; k < qr.K; k++) { acc += work[qr.base + k * qr.stride + i]; }
    if (qr.scale_a != 0u) { acc *= -exp(work[i]); }
    acc_out[qr.o_out + i] = acc_out[qr.o_out + i] + acc;
}

// ---------------------------------------------------------------- CPU adapters
// scan_lanes_forward / scan_lanes_backward: the same scan (the same parameters, bindings,
// saved states and partial sums; the dbc and accumulate entry points above serve it
// too) for CPU adapters such as lavapipe, where a workgroup runs as one SIMD
// vector of 8 lanes, a barrier switches coroutines and every load whose address differs
// between lanes is a gather.  A workgroup is one 8-lane subgroup, lane l owns channel
// blk*8 + l of batch row b and walks the sequence step by step with its NS states in four
// vec4 variables (NS is a pipeline constant: the groups past it compile away; a loop over a
// state array ran 2-6x slower on lavapipe where the driver kept the array in memory):
//   s_t = exp(dt_t*A) s_{t-1} + dt_t*Bm_t*u_t ;  y_t = (sum_n s_t*Cm_t + D*u_t) * silu(z_t)
// Bm_t and Cm_t are the same for every lane: each lane loads 2NS/8 of them and takes the rest
// by subgroup shuffle.  The forward saves the state before every chunk of T steps; the
// backward walks the chunks in reverse, recomputes the chunk's states into `hist` and runs
// the adjoint h_t = Cm_t*dy'_t + exp(dt_{t+1}A) h_{t+1} backwards through them.
// engine/ops/scan.py uses it where the subgroup is these 8 lanes and NS <= 16, NS % 4 == 0.

override NS: u32 = 16u;   // the state size N: 4, 8, 12 or 16 (states in four vec4 groups)

// lane l's batch row, channel block, channel (dc: clamped into range for loads), whether the
// channel exists, and its dt_bias and D
struct Lane { b: u32, blk: u32, d: u32, dc: u32, live: bool, bias: f32, D: f32 }

fn lane_of(p: Params, wid: vec3<u32>, nwg: vec3<u32>, l: u32) -> Lane {
    let wg = wid.x + wid.y * nwg.x;
    let blk = wg % p.nblk;
    let d = blk * 8u + l;
    let dc = min(d, p.Di - 1u);
    return Lane(wg / p.nblk, blk, d, dc, d < p.Di && wg < p.B * p.nblk,
                work[p.Di * p.N + dc], work[p.Di * p.N + p.Di + dc]);
}

// The same bindings seen as vec4 arrays (only these kernels use them: engine/ops/scan.py runs
// them where the Bm|Cm columns of xdbl start at a multiple of 4).
@group(0) @binding(4) var<storage, read> xdbl4: array<vec4<f32>>;
@group(0) @binding(11) var<storage, read_write> pbc4: array<vec4<f32>>;

// Bm|Cm of row m: lane l holds entries 4l..4l+3 of the row's 2NS (one load).  The kernels
// pass the parameters down: inside a loop lavapipe reads every uniform-buffer field as a
// gather over the lanes, outside control flow as one load, so they copy P once at the top.
// BC4 false (time_step_rank or xdbl's offset no multiple of 4): the same four entries as
// scalar loads
override BC4: bool = true;
fn bc_load(p: Params, m: u32, l: u32) -> vec4<f32> {
    if (!BC4) {
        let i = p.o_xdbl + m * p.ldx + p.R + 4u * l;   // (binding 4 seen as vec4s here)
        return vec4<f32>(xdbl4[i / 4u][i % 4u], xdbl4[(i + 1u) / 4u][(i + 1u) % 4u],
                         xdbl4[(i + 2u) / 4u][(i + 2u) % 4u], xdbl4[(i + 3u) / 4u][(i + 3u) % 4u]);
    }
    return xdbl4[(p.o_xdbl + m * p.ldx + p.R) / 4u + l];
}
fn bc_get(v: vec4<f32>, i: u32) -> f32 {   // entry i (0 <= i < 2NS) of the row, from its owner
    return sg_shuffle1(v[i % 4u], i / 4u);
}

// the lane's A = -exp(A_log), states 4q..4q+3 (zeros past NS)
fn lane_A4(dc: u32, q: u32) -> vec4<f32> {
    if (4u * q >= NS) { return vec4<f32>(0.0); }
    let i = dc * NS + 4u * q;
    return -exp(vec4<f32>(work[i], work[i + 1u], work[i + 2u], work[i + 3u]));
}
// entries i..i+3 of the row's Bm|Cm (see bc_get)
fn bc_get4(v: vec4<f32>, i: u32) -> vec4<f32> {
    return vec4<f32>(bc_get(v, i), bc_get(v, i + 1u), bc_get(v, i + 2u), bc_get(v, i + 3u));
}
fn save4(base: u32, q: u32, s: vec4<f32>) {
    if (4u * q < NS) {
        let i = base + 4u * q;
        states[i] = s.x; states[i + 1u] = s.y; states[i + 2u] = s.z; states[i + 3u] = s.w;
    }
}

@compute @workgroup_size(8)
fn scan_lanes_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_index) l: u32) {
    let p = P;   // read once, before any loop (see bc_load)
    if (wid.x + wid.y * nwg.x >= p.B * p.nblk) { return; }
    let ln = lane_of(p, wid, nwg, l);
    let a0 = lane_A4(ln.dc, 0u); let a1 = lane_A4(ln.dc, 1u); let a2 = lane_A4(ln.dc, 2u); let a3 = lane_A4(ln.dc, 3u);
    var s0 = vec4<f32>(0.0); var s1 = vec4<f32>(0.0); var s2 = vec4<f32>(0.0); var s3 = vec4<f32>(0.0);
    // the chunk states are saved outside the step loop: lavapipe runs the body of an `if`
    // whose condition differs between lanes on every pass, masked (inside the step loop
    // this kernel took 1.62 ms instead of 1.11 at Di 512, L 256)
    for (var c = 0u; c < p.nchk; c++) {
        if (ln.live) {
            let base = p.o_states + ((ln.b * p.nchk + c) * p.Di + ln.d) * NS;
            save4(base, 0u, s0); save4(base, 1u, s1); save4(base, 2u, s2); save4(base, 3u, s3);
        }
        for (var t = c * T; t < min(p.L, c * T + T); t++) {
            let m = ln.b * p.L + t;
            let e = m * p.Di + ln.dc;
            let dt = softplus(delta[p.o_delta + e] + ln.bias);
            let du = dt * u[p.o_u + e];
            let bc = bc_load(p, m, l);
            s0 = fma(exp(dt * a0), s0, du * bc_get4(bc, 0u));
            var yp = dot(s0, bc_get4(bc, NS));
            if (NS > 4u) {
                s1 = fma(exp(dt * a1), s1, du * bc_get4(bc, 4u));
                yp += dot(s1, bc_get4(bc, NS + 4u));
            }
            if (NS > 8u) {
                s2 = fma(exp(dt * a2), s2, du * bc_get4(bc, 8u));
                yp += dot(s2, bc_get4(bc, NS + 8u));
            }
            if (NS > 12u) {
                s3 = fma(exp(dt * a3), s3, du * bc_get4(bc, 12u));
                yp += dot(s3, bc_get4(bc, NS + 12u));
            }
            if (ln.live) {
                y[p.o_y + m * p.Di + ln.d] = fma(ln.D, u[p.o_u + e], yp) * silu(xz[p.o_xz + m * 2u * p.Di + p.Di + ln.d]);
            }
        }
    }
}

// The output gate's gradients taken in the step loop (dy' = dy*silu(z), dy*silu'(z): dy read
// from du just before the step's du is written, z from xz), with the saved states copied
// into work at off_st: du, ddelta WRITE; dxz[:, Di..] WRITE; dBm/dCm partial sums of the 8
// channels -> pbc4 (`work` from off_pbc on, bound as vec4; binding 6 then ends at off_pbc:
// WebGPU forbids writable bindings whose ranges overlap, which Dawn checks) [2][M][nblk][N];
// dA_log (over A), dt_bias and D partials of (b, d) into work.
// states 4q..4q+3 of a saved state row at `base` of work (zeros past NS)
fn load4(base: u32, q: u32) -> vec4<f32> {
    if (4u * q >= NS) { return vec4<f32>(0.0); }
    let i = base + 4u * q;
    return vec4<f32>(work[i], work[i + 1u], work[i + 2u], work[i + 3u]);
}

// the sum over the 8 lanes, in every lane (a butterfly of subgroup shuffles)
fn lanes_sum4(v: vec4<f32>) -> vec4<f32> {
    let a = v + sg_xor4(v, 1u);
    let b = a + sg_xor4(a, 2u);
    return b + sg_xor4(b, 4u);
}

// one step of the adjoint for states 4q..4q+3 (bn, cn: their Bm, Cm; sn, sp: the state after
// and before the step; h: the adjoint entering from the right)
struct Adj { h: vec4<f32>, da: vec4<f32>, rb: vec4<f32>, rc: vec4<f32>, sums: vec3<f32> }
fn adjoint4(bn: vec4<f32>, cn: vec4<f32>, sn: vec4<f32>, sp: vec4<f32>, h: vec4<f32>, a: vec4<f32>,
            dt: f32, uu: f32, g: f32) -> Adj {
    let hn = fma(cn, vec4<f32>(g), h);
    let ex = exp(dt * a);
    let q = ex * sp;
    return Adj(hn * ex, hn * dt * q, lanes_sum4(hn * (dt * uu)), lanes_sum4(sn * g),
               vec3<f32>(dot(hn, fma(a, q, bn * uu)), dot(hn, bn), dot(sn, cn)));
}

// of four uniform vectors, the one of lane l % 4
fn lane_quad(v0: vec4<f32>, v1: vec4<f32>, v2: vec4<f32>, v3: vec4<f32>, l: u32) -> vec4<f32> {
    let q = l % 4u;
    return select(select(v3, v2, q == 2u), select(v1, v0, q == 0u), q < 2u);
}

@compute @workgroup_size(8)
fn scan_lanes_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                       @builtin(local_invocation_index) l: u32) {
    let p = P;   // read once, before any loop (see bc_load)
    if (wid.x + wid.y * nwg.x >= p.B * p.nblk) { return; }
    let ln = lane_of(p, wid, nwg, l);
    let a0 = lane_A4(ln.dc, 0u); let a1 = lane_A4(ln.dc, 1u); let a2 = lane_A4(ln.dc, 2u); let a3 = lane_A4(ln.dc, 3u);
    // the adjoint of the state entering from the right; sums of h * dt * exp(dt*A) * s_prev (-> dA_log)
    var h0 = vec4<f32>(0.0); var h1 = vec4<f32>(0.0); var h2 = vec4<f32>(0.0); var h3 = vec4<f32>(0.0);
    var da0 = vec4<f32>(0.0); var da1 = vec4<f32>(0.0); var da2 = vec4<f32>(0.0); var da3 = vec4<f32>(0.0);
    var hist: array<vec4<f32>, 260>; // [T + 1][4]: the chunk's states, row 0 the one before it
    // the chunk's delta + dt_bias, dt, u and Bm|Cm, kept from the recompute for the adjoint
    // (reloading them took 4.40 ms instead of 3.88 at Di 512, L 256, N 16)
    var c_raw: array<f32, 64>;   // [T]
    var c_dt: array<f32, 64>;
    var c_u: array<f32, 64>;
    var c_bc: array<vec4<f32>, 64>;
    var sumb = 0.0;   // sum of ddelta (-> dt_bias)
    var sumd = 0.0;   // sum of dy'*u (-> D)
    let z = Adj(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec3<f32>(0.0));
    for (var cc = 0u; cc < p.nchk; cc++) {
        let c = p.nchk - 1u - cc;
        let t0 = c * T;
        let nt = min(T, p.L - t0);
        let base = p.off_st + ((ln.b * p.nchk + c) * p.Di + ln.dc) * NS;   // the states' copy
        var s0 = load4(base, 0u); var s1 = load4(base, 1u); var s2 = load4(base, 2u); var s3 = load4(base, 3u);
        hist[0] = s0; hist[1] = s1; hist[2] = s2; hist[3] = s3;
        for (var k = 0u; k < nt; k++) {
            let m = ln.b * p.L + t0 + k;
            let e = m * p.Di + ln.dc;
            let draw = delta[p.o_delta + e] + ln.bias;
            let dt = softplus(draw);
            let uu = u[p.o_u + e];
            let du = dt * uu;
            let bc = bc_load(p, m, l);
            c_raw[k] = draw; c_dt[k] = dt; c_u[k] = uu; c_bc[k] = bc;
            let r = (k + 1u) * 4u;
            s0 = fma(exp(dt * a0), s0, du * bc_get4(bc, 0u)); hist[r] = s0;
            if (NS > 4u) { s1 = fma(exp(dt * a1), s1, du * bc_get4(bc, 4u)); hist[r + 1u] = s1; }
            if (NS > 8u) { s2 = fma(exp(dt * a2), s2, du * bc_get4(bc, 8u)); hist[r + 2u] = s2; }
            if (NS > 12u) { s3 = fma(exp(dt * a3), s3, du * bc_get4(bc, 12u)); hist[r + 3u] = s3; }
        }
        for (var kk = 0u; kk < nt; kk++) {
            let k = nt - 1u - kk;
            let m = ln.b * p.L + t0 + k;
            let e = m * p.Di + ln.dc;
            let draw = c_raw[k];
            let dt = c_dt[k];
            let uu = select(0.0, c_u[k], ln.live);
            // the output gate's gradients: dy' = dy * silu(z), and dy * silu'(z) for dz
            let gg = gate_grads(select(0.0, du[p.o_du + e], ln.live), xz[p.o_xz + m * 2u * p.Di + p.Di + ln.dc]);
            let g = gg.x;
            let bc = c_bc[k];
            let r = k * 4u;
            let j0 = adjoint4(bc_get4(bc, 0u), bc_get4(bc, NS), hist[r + 4u], hist[r], h0, a0, dt, uu, g);
            var j1 = z; var j2 = z; var j3 = z;
            if (NS > 4u) { j1 = adjoint4(bc_get4(bc, 4u), bc_get4(bc, NS + 4u), hist[r + 5u], hist[r + 1u], h1, a1, dt, uu, g); }
            if (NS > 8u) { j2 = adjoint4(bc_get4(bc, 8u), bc_get4(bc, NS + 8u), hist[r + 6u], hist[r + 2u], h2, a2, dt, uu, g); }
            if (NS > 12u) { j3 = adjoint4(bc_get4(bc, 12u), bc_get4(bc, NS + 12u), hist[r + 7u], hist[r + 3u], h3, a3, dt, uu, g); }
            h0 = j0.h; h1 = j1.h; h2 = j2.h; h3 = j3.h;
            da0 += j0.da; da1 += j1.da; da2 += j2.da; da3 += j3.da;
            let sums = j0.sums + j1.sums + j2.sums + j3.sums;   // ddt, dus, yp
            if (ln.live) {
                du[p.o_du + e] = fma(dt, sums.y, ln.D * g);
                let dd = sums.x * sigmoid(draw);
                ddelta[p.o_ddelta + e] = dd;
                dxz[p.o_dxz + m * 2u * p.Di + p.Di + ln.d] = gg.y * fma(ln.D, uu, sums.z);
                sumb += dd;
                sumd += g * uu;
            }
            // the channel sums of dBm and dCm (the same in every lane): lane l < 4 stores dBm's
            // entries 4l..4l+3, lane 4 + q dCm's 4q..4q+3
            let pb = (m * p.nblk + ln.blk) * NS;
            if (4u * (l % 4u) < NS) {
                let isc = l >= 4u;
                pbc4[(select(0u, p.pbc_half, isc) + pb) / 4u + l % 4u] = select(
                    lane_quad(j0.rb, j1.rb, j2.rb, j3.rb, l), lane_quad(j0.rc, j1.rc, j2.rc, j3.rc, l), isc);
            }
        }
    }
    if (ln.live) {
        let pa = p.off_pa + (ln.b * p.Di + ln.d) * NS;
        let d4 = array<vec4<f32>, 4>(da0, da1, da2, da3);
        for (var n = 0u; n < NS; n++) { work[pa + n] = d4[n / 4u][n % 4u]; }
        work[p.off_pb + ln.b * p.Di + ln.d] = sumb;
        work[p.off_pd + ln.b * p.Di + ln.d] = sumd;
    }
}
