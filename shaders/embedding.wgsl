// Embedding lookup and its deterministic backward.
//   forward : out[m, :] = weight[ids[m], :]            (ids outside [0, V) give a zero row)
//   backward: dweight[tok, :] += sum of dout[m, :] over the rows m with ids[m] == tok.
// The backward needs no float atomics: the host builds a CSR of row positions per unique
// token (ids are known on the host) and each workgroup owns one (token, column block), so
// every dweight element is written by exactly one invocation in a fixed order.
// CSR buffer (i32): [0] = U (unique tokens), [1 .. U+1] = row pointers,
//                   [2+M .. 2+M+U) = token ids, [2+2M ..) = row positions sorted by token.
struct Params { M: u32, E: u32, V: u32, o_out: u32, o_ids: u32, o_w: u32, _p0: u32, _p1: u32 }

@group(0) @binding(0) var<storage, read_write> out: array<f32>;
@group(0) @binding(1) var<storage, read> ids: array<i32>;
@group(0) @binding(2) var<storage, read> weight: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;

@compute @workgroup_size(256)
fn embedding_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = (wid.x + wid.y * nwg.x) * 256u + lid.x;
    if (i >= P.M * P.E) { return; }
    let m = i / P.E;
    let e = i - m * P.E;
    let tok = ids[P.o_ids + m];
    var v = 0.0;
    if (tok >= 0 && u32(tok) < P.V) { v = weight[P.o_w + u32(tok) * P.E + e]; }
    out[P.o_out + i] = v;
}

// Backward: workgroup g -> segment s = g / nblk, column block g % nblk (64 columns).
struct ParamsB { M: u32, E: u32, V: u32, nblk: u32, o_dw: u32, o_dout: u32, _p0: u32, _p1: u32 }

@group(0) @binding(0) var<storage, read_write> dweight: array<f32>;
@group(0) @binding(1) var<storage, read> csr: array<i32>;
@group(0) @binding(2) var<storage, read> dout: array<f32>;
@group(0) @binding(3) var<uniform> PB: ParamsB;

@compute @workgroup_size(64)
fn embedding_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_id) lid: vec3<u32>) {
    let g = wid.x + wid.y * nwg.x;
    let s = g / PB.nblk;
    let e = (g - s * PB.nblk) * 64u + lid.x;
    let U = u32(csr[0]);
    if (s >= U || s >= PB.M || e >= PB.E) { return; }
    let tok = csr[2u + PB.M + s];
    if (tok < 0 || u32(tok) >= PB.V) { return; }
    let start = u32(csr[1u + s]);
    let end = u32(csr[2u + s]);
    var acc = 0.0;
    for (var j = start; j < end; j = j + 1u) {
        let m = u32(csr[2u + 2u * PB.M + j]);
        acc = acc + dout[PB.o_dout + m * PB.E + e];
    }
    let k = PB.o_dw + u32(tok) * PB.E + e;
    dweight[k] = dweight[k] + acc;
}
