// Helpers every shader may use; the runtime puts this file in front of each module
// (after its `enable` directives).  One definition each, so that kernels that must agree
// (the selective scan and the decode step) compute the same values.

fn sigmoid(x: f32) -> f32 { return 1.0 / (1.0 + exp(-x)); }
fn silu(x: f32) -> f32 { return x * sigmoid(x); }

// log1p(exp(x)), torch's threshold 20; Kahan's log1p for accuracy at small exp(x).
fn softplus(x: f32) -> f32 {
    if (x > 20.0) { return x; }
    let e = exp(x);
    let w = 1.0 + e;
    if (w == 1.0) { return e; }
    return log(w) * e / (w - 1.0);
}

// The index of invocation `lid` of a 256-wide workgroup in a dispatch of (x, y) workgroups
// (gpu.grid folds counts past 65535 into y).
fn lin(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.x + wid.y * nwg.x) * 256u + lid;
}

// 2^e for e in [-126, 127], from its exponent bits (exact): the f16 operands' per-tensor
// scales (engine/kernels/matmul.py F16Scales)
fn f16_pow2(e: i32) -> f32 {
    return bitcast<f32>(u32(e + 127) << 23u);
}
