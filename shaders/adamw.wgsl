// adamw: one fused AdamW update per parameter (SPEC section 4).
//
//   g = grad * clip[0]
//   m = b1 m + (1-b1) g ;  v = b2 v + (1-b2) g^2
//   step = lr (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)
//   step not finite -> 0 ;  step = step + lr wd p           (decoupled weight decay)
//   max_delta > 0 -> step = clamp(step, -max_delta, max_delta)   (the whole move, decay included)
//   p = p - step
//
// Non-finite handling (documented choice): an element whose new m or v would be non-finite
// (NaN/Inf gradient, or g^2 overflowing) keeps its OLD m and v and gets step 0, as if that
// gradient element had not arrived; NaN/Inf therefore never enters the moments or the weight.
// Weight decay still applies (step = lr wd p), exactly as the SPEC formula says; with wd = 0
// the weight is unchanged.  A finite m/v whose step is still non-finite (e.g. eps = 0 and
// v = 0) keeps the new moments and gets step 0.

struct Adam {
    count: u32,
    lr: f32,
    b1: f32,
    b2: f32,
    eps: f32,
    wd: f32,
    b1t: f32,        // b1^t
    b2t: f32,        // b2^t
    max_delta: f32,  // trust region; 0 disables
    gpu_t: u32,      // 1: t = skip[3] (steps applied so far, loss scaling), b1^t b2^t computed here
    _p1: f32,
    _p2: f32,
}

// Four elements per invocation: adamw_step takes the whole vec4s of U.count elements,
// adamw_tail the (at most three) elements after them.
@group(0) @binding(0) var<storage, read_write> p: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> g: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> m: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> v: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> clip: array<f32>;
@group(0) @binding(5) var<uniform> U: Adam;
// skip[0] != 0: leave p, m and v as they are (a step skipped by loss scaling, computed on
// the GPU by reduce.wgsl's clip_finish_scaled; 0 without loss scaling).  With gpu_t the
// bias correction uses t = skip[3], the steps actually applied (torch.amp.GradScaler skips
// optimizer.step(), so a skipped step does not advance t).
@group(0) @binding(6) var<storage, read> skip: array<f32>;

fn is_finite(x: vec4<f32>) -> vec4<bool> {
    return (bitcast<vec4<u32>>(x) & vec4<u32>(0x7f800000u)) != vec4<u32>(0x7f800000u);
}

struct Moved { p: vec4<f32>, m: vec4<f32>, v: vec4<f32> }

// What every element's update reads: the uniforms, the clip factor, b1^t and b2^t.  Each
// entry point reads them first, before any branch (on lavapipe a uniform read after one is
// a gather over the lanes).
struct Hyper { a: Adam, clip: f32, b1t: f32, b2t: f32, skip: bool }

fn hyper() -> Hyper {
    let a = U;
    let c = clip[0];
    let s0 = skip[0];
    let t = skip[3];
    var b1t = a.b1t;
    var b2t = a.b2t;
    if (a.gpu_t != 0u) {
        b1t = pow(a.b1, t);
        b2t = pow(a.b2, t);
    }
    return Hyper(a, c, b1t, b2t, s0 != 0.0);
}

// the update of four elements (each on its own: the same result as one at a time)
fn adamw4(h: Hyper, pi: vec4<f32>, gr: vec4<f32>, mi: vec4<f32>, vi: vec4<f32>) -> Moved {
    let gi = gr * h.clip;
    let m1 = h.a.b1 * mi + (1.0 - h.a.b1) * gi;
    let v1 = h.a.b2 * vi + (1.0 - h.a.b2) * (gi * gi);
    let ok = is_finite(m1) & is_finite(v1);
    var step = h.a.lr * (m1 / (1.0 - h.b1t)) / (sqrt(v1 / (1.0 - h.b2t)) + h.a.eps);
    step = select(vec4<f32>(0.0), step, ok & is_finite(step));
    step = step + h.a.lr * h.a.wd * pi;
    if (h.a.max_delta > 0.0) {
        step = clamp(step, vec4<f32>(-h.a.max_delta), vec4<f32>(h.a.max_delta));
    }
    return Moved(pi - step, select(mi, m1, ok), select(vi, v1, ok));
}

// elements 4i..4i+3 (whole vec4s only)
@compute @workgroup_size(256)
fn adamw_step(@builtin(local_invocation_index) lid: u32,
              @builtin(workgroup_id) wid: vec3<u32>,
              @builtin(num_workgroups) nwg: vec3<u32>) {
    let h = hyper();
    let i = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (4u * i + 3u >= h.a.count || h.skip) {
        return;
    }
    let r = adamw4(h, p[i], g[i], m[i], v[i]);
    p[i] = r.p;
    m[i] = r.m;
    v[i] = r.v;
}

// the elements past the last whole vec4 (at most three), through the same update: the same
// bindings seen as f32 arrays
@group(0) @binding(0) var<storage, read_write> p1: array<f32>;
@group(0) @binding(1) var<storage, read> g1: array<f32>;
@group(0) @binding(2) var<storage, read_write> m1: array<f32>;
@group(0) @binding(3) var<storage, read_write> v1: array<f32>;

@compute @workgroup_size(4)
fn adamw_tail(@builtin(local_invocation_index) j: u32) {
    let h = hyper();
    let e = h.a.count / 4u * 4u + j;
    if (e >= h.a.count || h.skip) {
        return;
    }
    let r = adamw4(h, vec4<f32>(p1[e]), vec4<f32>(g1[e]), vec4<f32>(m1[e]), vec4<f32>(v1[e]));
    p1[e] = r.p.x;
    m1[e] = r.m.x;
    v1[e] = r.v.x;
}
