// Rotary position embedding (transformers' apply_rotary_pos_emb, partial rotary included), in
// place on the heads of q or k: for each row m (position t = m % L + pos0), head h and pair
// p < R/2 of the first R channels of the head (R = rotary dims; channels R.. pass through):
//     x1 = x[h*D + p], x2 = x[h*D + p + R/2]
//     x1' = x1 cos - x2 sin,  x2' = x2 cos + x1 sin           (rope_forward)
// and its transpose, the rotation by -angle (rope_backward: the gradient of the input from
// the gradient of the output, in place).  cs [T, R]: cos(t * inv_freq[p]) in columns 0..R/2,
// sin in R/2..R, made on the host as transformers makes them (f32 angles).

struct RP { rows: u32, L: u32, nh: u32, D: u32, hr: u32, ld: u32, ox: u32, pos0: u32 }

@group(0) @binding(0) var<storage, read_write> rx: array<f32>;
@group(0) @binding(1) var<storage, read> rcs: array<f32>;
@group(0) @binding(2) var<uniform> RU: RP;

fn rope_apply(i: u32, sgn: f32) {
    let u = RU;
    if (i >= u.rows * u.nh * u.hr) { return; }
    let p = i % u.hr;
    let h = (i / u.hr) % u.nh;
    let m = i / (u.hr * u.nh);
    let t = m % u.L + u.pos0;
    let c = rcs[t * 2u * u.hr + p];
    let s = sgn * rcs[t * 2u * u.hr + u.hr + p];
    let a = u.ox + m * u.ld + h * u.D + p;
    let x1 = rx[a];
    let x2 = rx[a + u.hr];
    rx[a] = x1 * c - x2 * s;
    rx[a + u.hr] = x2 * c + x1 * s;
}

@compute @workgroup_size(256)
fn rope_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    rope_apply(lin(wid, nwg, lid), 1.0);
}

@compute @workgroup_size(256)
fn rope_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    rope_apply(lin(wid, nwg, lid), -1.0);
}

// One decode step's q or k (rows = 1) at the position the decoder keeps on the GPU (rpos[0]).
@group(0) @binding(3) var<storage, read> rpos: array<u32>;

@compute @workgroup_size(256)
fn rope_step(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let u = RU;
    let i = lin(wid, nwg, lid);
    if (i >= u.nh * u.hr) { return; }
    let p = i % u.hr;
    let h = i / u.hr;
    let t = rpos[0];
    let c = rcs[t * 2u * u.hr + p];
    let s = rcs[t * 2u * u.hr + u.hr + p];
    let a = u.ox + h * u.D + p;
    let x1 = rx[a];
    let x2 = rx[a + u.hr];
    rx[a] = x1 * c - x2 * s;
    rx[a + u.hr] = x2 * c + x1 * s;
}
