// The SwiGLU MLP's gate (transformers' LlamaMLP / Granite's shared_mlp): gu [rows, ld] holds
// the gate in columns 0..I and the up projection in I..2I (ld >= 2I), and with r the residual
// multiplier (Granite; 1 elsewhere), which the down projection then multiplies through:
//     out[m, c] = r * silu(g) * u                                            (swiglu_forward)
//     dgu[m, c] = r * dout * u * silu'(g),  dgu[m, I + c] = r * dout * silu(g)  (swiglu_backward, WRITE)

struct GP { rows: u32, I: u32, ld: u32, og: u32, oo: u32, od: u32, r: f32, p0: u32 }

@group(0) @binding(0) var<storage, read> gu: array<f32>;
@group(0) @binding(1) var<storage, read_write> gout: array<f32>;
@group(0) @binding(2) var<uniform> GU: GP;

@compute @workgroup_size(256)
fn swiglu_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let u = GU;
    let i = lin(wid, nwg, lid);
    if (i >= u.rows * u.I) { return; }
    let m = i / u.I;
    let c = i % u.I;
    let g = gu[u.og + m * u.ld + c];
    let up = gu[u.og + m * u.ld + u.I + c];
    gout[u.oo + i] = u.r * silu(g) * up;
}

@group(0) @binding(0) var<storage, read> bgu: array<f32>;
@group(0) @binding(1) var<storage, read> bdout: array<f32>;
@group(0) @binding(2) var<storage, read_write> bdgu: array<f32>;
@group(0) @binding(3) var<uniform> BU: GP;

@compute @workgroup_size(256)
fn swiglu_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) lid: u32) {
    let u = BU;
    let i = lin(wid, nwg, lid);
    if (i >= u.rows * u.I) { return; }
    let m = i / u.I;
    let c = i % u.I;
    let a = u.og + m * u.ld + c;
    let g = bgu[a];
    let up = bgu[a + u.I];
    let d = u.r * bdout[u.oo + i];
    let sg = sigmoid(g);
    let b = u.od + m * u.ld + c;
    bdgu[b] = d * up * sg * (1.0 + g * (1.0 - sg));
    bdgu[b + u.I] = d * g * sg;
}
