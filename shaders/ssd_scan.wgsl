// requires: ssd_ops
// Mamba-2's SSD scan in its chunked form (the state-space dual): forward and backward.
// engine/kernels/ssd.py says what each entry point writes and in which order they run;
// shaders/ssd_ops.wgsl has the formulas, the products' operands (a_at, b_at) and stores.

// ---------------------------------------------------------------- the tiled product
const KT: u32 = 16u;     // K per step
const TP: u32 = 65u;     // a tile row in workgroup memory (padded against bank conflicts)
var<workgroup> tA: array<f32, 1040>;   // [KT][TP]: tA[k * TP + r]
var<workgroup> tB: array<f32, 1040>;   // [KT][TP]: tB[k * TP + s]

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
    var acc: array<vec4<f32>, 4>;
    if (STAGED == 0u) {     // CPU adapters: operands straight from memory, no barriers
        let ra = vec4<bool>(r0 + tr < d.x, r0 + tr + 16u < d.x, r0 + tr + 32u < d.x, r0 + tr + 48u < d.x);
        let sb = vec4<bool>(s0 + ts < d.y, s0 + ts + 16u < d.y, s0 + ts + 32u < d.y, s0 + ts + 48u < d.y);
        for (var k = 0u; k < d.z; k++) {
            let ph = select(0u, 1u, k >= d.w);
            var av = vec4<f32>(0.0);
            var bq = vec4<f32>(0.0);
            if (ra.x) { av.x = a_at(u, it, r0 + tr, k, ph, d.w); }
            if (ra.y) { av.y = a_at(u, it, r0 + tr + 16u, k, ph, d.w); }
            if (ra.z) { av.z = a_at(u, it, r0 + tr + 32u, k, ph, d.w); }
            if (ra.w) { av.w = a_at(u, it, r0 + tr + 48u, k, ph, d.w); }
            if (sb.x) { bq.x = b_at(u, it, k, s0 + ts, ph, d.w); }
            if (sb.y) { bq.y = b_at(u, it, k, s0 + ts + 16u, ph, d.w); }
            if (sb.z) { bq.z = b_at(u, it, k, s0 + ts + 32u, ph, d.w); }
            if (sb.w) { bq.w = b_at(u, it, k, s0 + ts + 48u, ph, d.w); }
            acc[0] += av.x * bq;
            acc[1] += av.y * bq;
            acc[2] += av.z * bq;
            acc[3] += av.w * bq;
        }
    }
    for (var k0 = 0u; k0 < d.z * STAGED; k0 += KT) {
        let ph = select(0u, 1u, k0 >= d.w);
        let akf = a_kfast(ph);
        let bkf = b_kfast(ph);
        for (var q = 0u; q < 4u; q++) {
            let e = lid + q * 256u;
            var kk = e / T;
            var rr = e % T;
            if (akf) { kk = e % KT; rr = e / KT; }
            var v = 0.0;
            if (r0 + rr < d.x && k0 + kk < d.z) { v = a_at(u, it, r0 + rr, k0 + kk, ph, d.w); }
            tA[kk * TP + rr] = v;
            var kb = e / T;
            var sb = e % T;
            if (bkf) { kb = e % KT; sb = e / KT; }
            var vb = 0.0;
            if (s0 + sb < d.y && k0 + kb < d.z) { vb = b_at(u, it, k0 + kb, s0 + sb, ph, d.w); }
            tB[kb * TP + sb] = vb;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < KT; kk++) {
            let bq = vec4<f32>(tB[kk * TP + ts], tB[kk * TP + ts + 16u], tB[kk * TP + ts + 32u], tB[kk * TP + ts + 48u]);
            acc[0] += tA[kk * TP + tr] * bq;
            acc[1] += tA[kk * TP + tr + 16u] * bq;
            acc[2] += tA[kk * TP + tr + 32u] * bq;
            acc[3] += tA[kk * TP + tr + 48u] * bq;
        }
        workgroupBarrier();
    }
    for (var a = 0u; a < 4u; a++) {
        let r = r0 + tr + 16u * a;
        if (r >= d.x) { continue; }
        for (var b = 0u; b < 4u; b++) {
            let s = s0 + ts + 16u * b;
            if (s < d.y) { store(u, it, r, s, acc[a][b]); }
        }
    }
}

// ---------------------------------------------------------------- the small kernels
// a[b, c, h, i] = A_h * sum_{k <= i} dt (padding repeats the last); one invocation per (b, c, h)
@compute @workgroup_size(256)
fn ssd_cumsum(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let u = US;
    let z = lin(wid, nwg, lid);
    if (z >= u.Z) { return; }
    let it = head_item(u, z);
    let A = -exp(s_small[it.h]);
    var s = 0.0;
    for (var i = 0u; i < Q; i++) {
        if (valid(u, it, i)) { s += dtv(u, row(u, it, i), it.h); }
        s_small[u.o_acs + z * Q + i] = A * s;
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

// A workgroup per (b, c, h), one invocation per step i < Q (Q <= 256):
//   r1_i = sum_p part[m, h*P + p] (= x_i . acc_i of the dx product), r2_i = sum_p dy (y - D x);
//   da_i = r2_i - dt_i r1_i (+ dlast at i = Q - 1); ddt_i = r1_i + A sum_{k >= i} da_k (WRITE);
//   the chunk's term of dA_log: A sum_i da_i sum_{k <= i} dt_k; of dD: sum_i sum_p dy x.
// aux1 = part [M, Di], aux2 = dy [M, Di], aux3 = y [M, Di]; out = ddt [M, H]
var<workgroup> wda: array<f32, 256>;
var<workgroup> wr1: array<f32, 256>;
var<workgroup> wdd: array<f32, 256>;

@compute @workgroup_size(256)
fn ssd_dt_chunk(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let u = US;
    let z = wid.x + wid.y * nwg.x;
    if (z >= u.Z) { return; }
    let it = head_item(u, z);
    let h = it.h;
    let Dh = s_small[H + h];
    let i = lid;
    var da = 0.0;
    var r1 = 0.0;
    var dd = 0.0;
    if (i < Q && valid(u, it, i)) {
        let m = row(u, it, i);
        var r2 = 0.0;
        for (var p = 0u; p < P; p++) {
            let o = m * Di + h * P + p;
            let dy = s_a2[u.o_a2 + o];
            let x = xv(u, m, h, p);
            r1 += s_a1[u.o_a1 + o];
            r2 += dy * (s_a3[u.o_a3 + o] - Dh * x);
            dd += dy * x;
        }
        da = r2 - dtv(u, m, h) * r1;
    }
    if (i + 1u == Q) { da += s_small[u.o_dl + z]; }
    wda[lid] = da;
    wr1[lid] = r1;
    wdd[lid] = dd;
    workgroupBarrier();
    if (lid == 0u) {
        let A = -exp(s_small[h]);
        var rev = 0.0;
        var cum = 0.0;
        var dA = 0.0;
        var dD = 0.0;
        for (var k = 0u; k < Q; k++) {
            if (valid(u, it, k)) { cum += dtv(u, row(u, it, k), h); }
            dA += wda[k] * cum;
            dD += wdd[k];
        }
        for (var kr = 0u; kr < Q; kr++) {
            let k = Q - 1u - kr;
            rev += wda[k];
            if (valid(u, it, k)) { s_out[u.o_out + row(u, it, k) * H + h] = wr1[k] + A * rev; }
        }
        s_small[u.o_pa + z] = A * dA;
        s_small[u.o_pd + z] = dD;
    }
}
