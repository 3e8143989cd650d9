// Standalone activations and their backward passes (the reference for fused versions).
//   silu(x)     = x * sigmoid(x)
//   softplus(x) = x                 for x > 20 (torch threshold=20)
//               = log1p(exp(x))     otherwise (computed without overflow or cancellation, see below)
// Backward entry points ACCUMULATE: dx += dout * f'(x).
// Every tensor is bound from a 32/256-byte aligned offset; P.o_* are element offsets.
struct Params { n: u32, o_a: u32, o_b: u32, o_c: u32 }

@group(0) @binding(0) var<storage, read_write> out: array<f32>;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<uniform> P: Params;

@group(0) @binding(0) var<storage, read_write> dx: array<f32>;
@group(0) @binding(1) var<storage, read> dout: array<f32>;
@group(0) @binding(2) var<storage, read> xb: array<f32>;
@group(0) @binding(3) var<uniform> PB: Params;


// log(1 + e) for e in [0, 1] in plain arithmetic: GPU log() only guarantees an ABSOLUTE
// error (~2^-21) near 1, which is a large relative error for small e.  With
// s = e / (2 + e) <= 1/3:  log1p(e) = 2 atanh(s) = 2 (s + s^3/3 + s^5/5 + ...);
// terms through s^17 leave a relative error below 2e-9.
fn log1p_unit(e: f32) -> f32 {
    let s = e / (2.0 + e);
    let s2 = s * s;
    var p = 1.0 / 17.0;
    p = 1.0 / 15.0 + s2 * p;
    p = 1.0 / 13.0 + s2 * p;
    p = 1.0 / 11.0 + s2 * p;
    p = 1.0 / 9.0 + s2 * p;
    p = 1.0 / 7.0 + s2 * p;
    p = 1.0 / 5.0 + s2 * p;
    p = 1.0 / 3.0 + s2 * p;
    p = 1.0 + s2 * p;
    return 2.0 * s * p;
}

// Stable softplus, torch semantics (beta = 1, threshold = 20):
//   x > 20 -> x;  else log1p(exp(x)) = max(x, 0) + log1p(exp(-|x|))   (exp argument <= 0)
// (common.wgsl's softplus, which the fused kernels use, takes log() of 1 + e instead.)
fn softplus_stable(v: f32) -> f32 {
    if (v > 20.0) { return v; }
    return max(v, 0.0) + log1p_unit(exp(-abs(v)));
}


@compute @workgroup_size(256)
fn silu_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = lin(wid, nwg, lid.x);
    if (i >= P.n) { return; }
    let v = x[P.o_b + i];
    out[P.o_a + i] = v * sigmoid(v);
}

@compute @workgroup_size(256)
fn silu_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = lin(wid, nwg, lid.x);
    if (i >= PB.n) { return; }
    let v = xb[PB.o_c + i];
    let s = sigmoid(v);
    dx[PB.o_a + i] += dout[PB.o_b + i] * (s * (1.0 + v * (1.0 - s)));
}

@compute @workgroup_size(256)
fn softplus_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = lin(wid, nwg, lid.x);
    if (i >= P.n) { return; }
    out[P.o_a + i] = softplus_stable(x[P.o_b + i]);
}

@compute @workgroup_size(256)
fn softplus_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = lin(wid, nwg, lid.x);
    if (i >= PB.n) { return; }
    let v = xb[PB.o_c + i];
    var g = 1.0;
    if (v <= 20.0) { g = sigmoid(v); }
    dx[PB.o_a + i] += dout[PB.o_b + i] * g;
}
