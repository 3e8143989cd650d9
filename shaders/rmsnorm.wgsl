// requires: subgroups, wg_reduce
// RMSNorm as transformers' MambaRMSNorm computes it (f32):
//   rstd[m] = 1 / sqrt(mean_e x[m,e]^2 + eps);   out[m,e] = weight[e] * (x[m,e] * rstd[m])
// Backward, with xh = x * rstd and g = dout * weight:
//   dx[m,e]   += rstd[m] * (g[m,e] - xh[m,e] * mean_e(g * xh))          (ACC)
//   dweight[e] += sum_m dout[m,e] * xh[m,e]                              (ACC, two stages:
//   rmsnorm_dweight_partial sums fixed row chunks into scratch, rmsnorm_dweight_reduce
//   adds the chunk sums in order; every element has one writer).
// One workgroup per row for the row kernels; P.o_* are element offsets of the bindings and
// P.ld the row stride of x, out, dout and dx (E, or wider when the norm runs over a column
// slice of a matrix: falcon_mamba's weightless dt/B/C norms pass a ones weight).
// Matrices larger than one storage binding are processed in row ranges, each a call of its
// own; a range's dweight partials go to chunks pbase .. of the partial buffer.
// Invocations per row: a pipeline constant (engine/ops/lanes.py: 8, one SIMD vector, on CPU
// adapters, where a barrier switches coroutines); a power of two, at most 256.
override WG: u32 = 128u;
// the row's WG = 8 invocations are one subgroup (engine/ops/lanes.py): sums by shuffles
override SG8: bool = false;

struct Params { M: u32, E: u32, eps: f32, rows_per_chunk: u32,
                o_a: u32, o_b: u32, o_c: u32, o_d: u32, o_e: u32, nchunks: u32, ld: u32, pbase: u32 }

// ---------------------------------------------------------------- forward
@group(0) @binding(0) var<storage, read_write> out: array<f32>;
@group(0) @binding(1) var<storage, read_write> rstd: array<f32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read> weight: array<f32>;
@group(0) @binding(4) var<uniform> P: Params;
// COPY: x's row also goes to xcopy (o_e, the same row stride): the model's residual stream
// h_next = h, which out_proj then adds into, without a pass of its own over h
override COPY: bool = false;
@group(0) @binding(5) var<storage, read_write> xcopy: array<f32>;

@compute @workgroup_size(WG)
fn rmsnorm_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_id) lid: vec3<u32>) {
    let pr = P;   // read once: on lavapipe a uniform read after a branch is a gather
    let m = wid.x + wid.y * nwg.x;
    if (m >= pr.M) { return; }
    let l = lid.x;
    let xb = pr.o_c + m * pr.ld;
    var ss = 0.0;
    for (var e = l; e < pr.E; e = e + WG) { let v = x[xb + e]; ss = ss + v * v; }
    let tot = wg_sum(ss, l);
    let r = 1.0 / sqrt(tot / f32(pr.E) + pr.eps);
    if (l == 0u) { rstd[pr.o_b + m] = r; }
    let ob = pr.o_a + m * pr.ld;
    for (var e = l; e < pr.E; e = e + WG) {
        let v = x[xb + e];
        out[ob + e] = weight[pr.o_d + e] * (v * r);
        if (COPY) { xcopy[pr.o_e + m * pr.ld + e] = v; }
    }
}

// ---------------------------------------------------------------- backward: dx
@group(0) @binding(0) var<storage, read_write> dx: array<f32>;
@group(0) @binding(1) var<storage, read> dout: array<f32>;
@group(0) @binding(2) var<storage, read> xg: array<f32>;
@group(0) @binding(3) var<storage, read> wg_: array<f32>;
@group(0) @binding(4) var<storage, read> rs: array<f32>;
@group(0) @binding(5) var<uniform> PB: Params;

@compute @workgroup_size(WG)
fn rmsnorm_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_id) lid: vec3<u32>) {
    let pr = PB;   // read once: on lavapipe a uniform read after a branch is a gather
    let m = wid.x + wid.y * nwg.x;
    if (m >= pr.M) { return; }
    let l = lid.x;
    let r = rs[pr.o_e + m];
    let gb = pr.o_b + m * pr.ld;
    let xb = pr.o_c + m * pr.ld;
    var d = 0.0;
    for (var e = l; e < pr.E; e = e + WG) { d = d + dout[gb + e] * wg_[pr.o_d + e] * xg[xb + e]; }
    let c = wg_sum(d, l) * r / f32(pr.E);           // mean(g * xh)
    let db = pr.o_a + m * pr.ld;
    for (var e = l; e < pr.E; e = e + WG) {
        let g = dout[gb + e] * wg_[pr.o_d + e];
        let xh = xg[xb + e] * r;
        dx[db + e] = dx[db + e] + r * (g - xh * c);
    }
}

// ---------------------------------------------------------------- backward: dweight
// partial[p, e] = sum over rows p*rpc .. (p+1)*rpc of dout * x * rstd. Workgroup (column
// block of 64, chunk p) = linear id p * nblk + block.
@group(0) @binding(0) var<storage, read_write> partial: array<f32>;
@group(0) @binding(1) var<storage, read> dout2: array<f32>;
@group(0) @binding(2) var<storage, read> x2: array<f32>;
@group(0) @binding(3) var<storage, read> rs2: array<f32>;
@group(0) @binding(4) var<uniform> P2: Params;

@compute @workgroup_size(64)
fn rmsnorm_dweight_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                           @builtin(local_invocation_id) lid: vec3<u32>) {
    let pr = P2;   // read once: on lavapipe a uniform read after a branch is a gather
    let g = wid.x + wid.y * nwg.x;
    let nblk = (pr.E + 63u) / 64u;
    let p = g / nblk;
    let e = (g - p * nblk) * 64u + lid.x;
    if (p >= pr.nchunks || e >= pr.E) { return; }
    let m0 = p * pr.rows_per_chunk;
    let m1 = min(pr.M, m0 + pr.rows_per_chunk);
    var acc = 0.0;
    for (var m = m0; m < m1; m = m + 1u) {
        acc = acc + dout2[pr.o_b + m * pr.ld + e] * (x2[pr.o_c + m * pr.ld + e] * rs2[pr.o_e + m]);
    }
    partial[(pr.pbase + p) * pr.E + e] = acc;
}

@group(0) @binding(0) var<storage, read_write> dweight: array<f32>;
@group(0) @binding(1) var<storage, read> partial3: array<f32>;
@group(0) @binding(2) var<uniform> P3: Params;

@compute @workgroup_size(64)
fn rmsnorm_dweight_reduce(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                          @builtin(local_invocation_id) lid: vec3<u32>) {
    let pr = P3;   // read once: on lavapipe a uniform read after a branch is a gather
    let e = (wid.x + wid.y * nwg.x) * 64u + lid.x;
    if (e >= pr.E) { return; }
    var acc = 0.0;
    for (var p = 0u; p < pr.nchunks; p = p + 1u) { acc = acc + partial3[p * pr.E + e]; }
    dweight[pr.o_a + e] = dweight[pr.o_a + e] + acc;
}
