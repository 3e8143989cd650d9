// reduce: deterministic two-stage reductions (sum, sum of squares) and the gradient-clip finish.
//
// Stage 1 (reduce_partial): workgroup w owns the fixed chunk [w*256*per_thread, (w+1)*256*per_thread)
//   of x; each thread sums its strided elements (coalesced: k*256 + lid), the workgroup folds the
//   256 values with a shared-memory tree and ONE thread writes partials[pbase + w].  Every slot has
//   exactly one writer: no races, no atomics.
// Stage 2 (reduce_finish*, clip_finish): one workgroup folds partials[0..n) the same way and one
//   thread writes the scalar result.  The partition depends only on n, so results are bit-identical
//   from run to run.
//
// Views: x / out / scale_t are bound from an offset rounded down to the storage-offset alignment;
// `base`, `out_index`, `scale_index` give the element offset inside the binding.

struct Params {
    n: u32,            // stage 1: elements of x; stage 2: number of partials
    base: u32,         // stage 1: first element of x inside its binding
    per_thread: u32,   // stage 1: elements per thread (chunk = 256 * per_thread)
    pbase: u32,        // stage 1: first partial slot written by this dispatch
    square: u32,       // stage 1: 1 -> sum of x*x, 0 -> sum of x
    out_index: u32,    // stage 2: element of `out` that receives the result
    scale_index: u32,  // reduce_finish_scaled: element of scale_t that multiplies the result
    _p0: u32,
    scale: f32,        // reduce_finish*: out[out_index] += scale * total
    max_norm: f32,     // clip_finish: max_grad_norm (0 disables clipping)
    growth: f32,       // clip_finish_scaled: good steps before the loss scale doubles
    _p2: f32,
}

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> partials: array<f32>;
@group(0) @binding(2) var<uniform> P: Params;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> scale_t: array<f32>;
@group(0) @binding(5) var<storage, read_write> norm_last: array<f32>;

var<workgroup> sh: array<f32, 256>;

fn is_finite(v: f32) -> bool {
    return (bitcast<u32>(v) & 0x7f800000u) != 0x7f800000u;
}

// Tree-fold sh[0..256) into sh[0]; every invocation of the workgroup must call it.
fn fold(lid: u32, acc: f32) -> f32 {
    sh[lid] = acc;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s >> 1u) {
        if (lid < s) {
            sh[lid] = sh[lid] + sh[lid + s];
        }
        workgroupBarrier();
    }
    return sh[0];
}

// a term of stage 1: x or x*x
fn term(v: vec4<f32>, square: bool) -> vec4<f32> { return select(v, v * v, square); }

// fold a thread's sum (its four lanes) over the workgroup into partials[pbase + w]
fn put_partial(pr: Params, lid: u32, w: u32, start: u32, acc: vec4<f32>) {
    let total = fold(lid, (acc.x + acc.y) + (acc.z + acc.w));
    if (lid == 0u && start < pr.n) {
        partials[pr.pbase + w] = total;
    }
}

@compute @workgroup_size(256)
fn reduce_partial(@builtin(local_invocation_index) lid: u32,
                  @builtin(workgroup_id) wid: vec3<u32>,
                  @builtin(num_workgroups) nwg: vec3<u32>) {
    let pr = P;   // read once: on lavapipe a uniform read after a branch is a gather
    let w = wid.x + wid.y * nwg.x;
    let start = w * 256u * pr.per_thread;
    var acc = vec4<f32>(0.0);   // (.x only)
    if (start < pr.n) {
        for (var k = 0u; k < pr.per_thread; k = k + 1u) {
            let i = start + k * 256u + lid;
            if (i < pr.n) { acc = acc + term(vec4<f32>(x[pr.base + i], 0.0, 0.0, 0.0), pr.square != 0u); }
        }
    }
    put_partial(pr, lid, w, start, acc);
}

// The same chunks where n and base are multiples of 4 (per_thread is): a thread sums vec4
// number (start / 4 + k * 256 + lid) of x, then its four lanes.
@group(0) @binding(0) var<storage, read> x4: array<vec4<f32>>;

@compute @workgroup_size(256)
fn reduce_partial4(@builtin(local_invocation_index) lid: u32,
                   @builtin(workgroup_id) wid: vec3<u32>,
                   @builtin(num_workgroups) nwg: vec3<u32>) {
    let pr = P;   // read once: on lavapipe a uniform read after a branch is a gather
    let w = wid.x + wid.y * nwg.x;
    let start = w * 256u * pr.per_thread;
    var acc = vec4<f32>(0.0);
    if (start < pr.n) {
        for (var k = 0u; k < pr.per_thread / 4u; k = k + 1u) {
            let i = start / 4u + k * 256u + lid;
            if (4u * i < pr.n) { acc = acc + term(x4[pr.base / 4u + i], pr.square != 0u); }
        }
    }
    put_partial(pr, lid, w, start, acc);
}

fn sum_partials(lid: u32) -> f32 {
    var acc = 0.0;
    for (var i = lid; i < P.n; i = i + 256u) {
        acc = acc + partials[i];
    }
    return fold(lid, acc);
}

@compute @workgroup_size(256)
fn reduce_finish(@builtin(local_invocation_index) lid: u32) {
    let total = sum_partials(lid);
    if (lid == 0u) {
        out[P.out_index] = out[P.out_index] + P.scale * total;
    }
}

@compute @workgroup_size(256)
fn reduce_finish_scaled(@builtin(local_invocation_index) lid: u32) {
    let total = sum_partials(lid);
    if (lid == 0u) {
        out[P.out_index] = out[P.out_index] + (P.scale * scale_t[P.scale_index]) * total;
    }
}

// Gradient clipping: partials hold the per-chunk sums of squares of every gradient view.
// out[0] <- clip factor; norm_last[0] <- norm.
@compute @workgroup_size(256)
fn clip_finish(@builtin(local_invocation_index) lid: u32) {
    let total = sum_partials(lid);
    if (lid == 0u) {
        let norm = sqrt(total);
        var factor = 1.0;
        if (P.max_norm > 0.0 && is_finite(norm) && norm > P.max_norm) {
            factor = P.max_norm / norm;
        }
        out[0] = factor;
        norm_last[0] = norm;
    }
}

// The same with dynamic loss scaling (--precision mixed; torch.amp.GradScaler's rule): the
// gradients hold S * g, S = lscale[0].  A non-finite norm skips the step (amp[0] = 1, read
// by AdamW), halves S and counts the skip in amp[2]; a finite one sets amp[0] = 0, counts
// the applied step in amp[3] (AdamW's t) and doubles S after `growth` finite steps in a
// row (amp[1] counts them).  out[0] gets
// clip factor / S (AdamW multiplies the scaled gradient by it), norm_last[0] the norm of
// the unscaled gradient.
@group(0) @binding(6) var<storage, read_write> lscale: array<f32>;
@group(0) @binding(7) var<storage, read_write> amp: array<f32>;

@compute @workgroup_size(256)
fn clip_finish_scaled(@builtin(local_invocation_index) lid: u32) {
    let total = sum_partials(lid);
    if (lid == 0u) {
        let s = lscale[0];
        let norm = sqrt(total) / s;
        let finite = is_finite(total);
        var factor = 1.0;
        if (P.max_norm > 0.0 && finite && norm > P.max_norm) {
            factor = P.max_norm / norm;
        }
        out[0] = factor / s;
        norm_last[0] = norm;
        if (finite) {
            amp[0] = 0.0;
            amp[3] = amp[3] + 1.0;
            let good = amp[1] + 1.0;
            if (good >= P.growth) {
                lscale[0] = s * 2.0;
                amp[1] = 0.0;
            } else {
                amp[1] = good;
            }
        } else {
            amp[0] = 1.0;
            amp[1] = 0.0;
            amp[2] = amp[2] + 1.0;
            lscale[0] = s * 0.5;
        }
    }
}
