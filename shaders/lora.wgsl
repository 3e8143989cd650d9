// LoRA helpers (engine/ops/lora.py): the adapter's scaling in place, and PEFT's dropout on the
// input of lora_A as a counter-based mask (the same mask forward and backward, from a seed).
//   lora_scale:   x[i] *= s
//   lora_dropout: out[r, c] (+)= x[r, c] * keep(r * cols + c) / (1 - p)
//                 keep(k) = hash(seed, step, salt, k) / 2^24 >= p; rng = [seed, step] (storage,
//                 written once per step, so the mask changes per step without a new uniform)
// Row-strided views: element (r, c) of x is x[o_x + r * ld_x + c], of out out[o_out + r * ld_out + c].
struct Scale { n: u32, o: u32, s: f32, pad: u32 }
struct Drop { rows: u32, cols: u32, ld_out: u32, ld_x: u32, o_out: u32, o_x: u32, salt: u32, acc: u32,
              p: f32, inv: f32, pad0: u32, pad1: u32 }

@group(0) @binding(0) var<storage, read_write> xs: array<f32>;
@group(0) @binding(1) var<uniform> S: Scale;

@group(0) @binding(0) var<storage, read_write> out: array<f32>;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> rng: array<u32>;
@group(0) @binding(3) var<uniform> P: Drop;


// PCG output permutation (O'Neill), as an integer hash
fn pcg(v: u32) -> u32 {
    let s = v * 747796405u + 2891336453u;
    let w = ((s >> ((s >> 28u) + 4u)) ^ s) * 277803737u;
    return (w >> 22u) ^ w;
}

@compute @workgroup_size(256)
fn lora_scale(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = lin(wid, nwg, lid.x);
    if (i >= S.n) { return; }
    xs[S.o + i] = xs[S.o + i] * S.s;
}

@compute @workgroup_size(256)
fn lora_dropout(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_id) lid: vec3<u32>) {
    let k = lin(wid, nwg, lid.x);
    if (k >= P.rows * P.cols) { return; }
    let r = k / P.cols;
    let c = k - r * P.cols;
    let h = pcg(pcg(pcg(pcg(rng[0]) ^ rng[1]) ^ P.salt) ^ k);
    let u = f32(h >> 8u) * (1.0 / 16777216.0);
    var v = 0.0;
    if (u >= P.p) { v = x[P.o_x + r * P.ld_x + c] * P.inv; }
    let o = P.o_out + r * P.ld_out + c;
    if (P.acc != 0u) { out[o] = out[o] + v; } else { out[o] = v; }
}
