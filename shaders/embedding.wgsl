// Embedding lookup and its deterministic backward.
//   forward : out[m, :] = weight[ids[m], :]            (ids outside [0, V) give a zero row)
//   backward: dweight[tok, :] += sum of dout[m, :] over the rows m with ids[m] == tok.
// The backward needs no float atomics: the host builds a CSR of row positions per unique
// token (ids are known on the host) and each workgroup owns one (token, column block), so
// every dweight element is written by exactly one invocation in a fixed order.
// CSR buffer (i32): [0] = U (unique tokens), [1 .. U+1] = row pointers,
//                   [2+M .. 2+M+U) = token ids, [2+2M ..) = row positions sorted by token.
// Tables larger than one storage binding are bound in vocabulary ranges: `weight` holds
// rows v0 .. v0+V of the table (V rows, of Vall in all); a call writes only the rows whose
// token falls in its range (the call with v0 = 0 also writes the zero rows of ids outside
// [0, Vall)).  Unsplit: v0 = 0, V = Vall.
struct Params { M: u32, E: u32, V: u32, o_out: u32, o_ids: u32, o_w: u32, v0: u32, Vall: u32 }

@group(0) @binding(0) var<storage, read_write> out: array<f32>;
@group(0) @binding(1) var<storage, read> ids: array<i32>;
@group(0) @binding(2) var<storage, read> weight: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;

@compute @workgroup_size(256)
fn embedding_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_id) lid: vec3<u32>) {
    let pr = P;   // read once: on lavapipe a uniform read after a branch is a gather
    let i = (wid.x + wid.y * nwg.x) * 256u + lid.x;
    if (i >= pr.M * pr.E) { return; }
    let m = i / pr.E;
    let e = i - m * pr.E;
    let tok = ids[pr.o_ids + m];
    let r = u32(tok) - pr.v0;                  // row inside this range (wraps when below it)
    if (tok >= 0 && u32(tok) >= pr.v0 && r < pr.V) {
        out[pr.o_out + i] = weight[pr.o_w + r * pr.E + e];
    } else if (pr.v0 == 0u && (tok < 0 || u32(tok) >= pr.Vall)) {
        out[pr.o_out + i] = 0.0;
    }
}

// Backward: workgroup g -> segment s = g / nblk, column block g % nblk (64 columns).
// Split calls: dweight holds table rows v0 .. v0+V and dout rows m0 .. m0+Mn; a call adds
// the positions of its row range to the tokens of its vocabulary range (unsplit: v0 = 0,
// m0 = 0, Mn = M).
struct ParamsB { M: u32, E: u32, V: u32, nblk: u32, o_dw: u32, o_dout: u32, v0: u32, m0: u32,
                 Mn: u32, _p0: u32, _p1: u32, _p2: u32 }

@group(0) @binding(0) var<storage, read_write> dweight: array<f32>;
@group(0) @binding(1) var<storage, read> csr: array<i32>;
@group(0) @binding(2) var<storage, read> dout: array<f32>;
@group(0) @binding(3) var<uniform> PB: ParamsB;

@compute @workgroup_size(64)
fn embedding_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_id) lid: vec3<u32>) {
    let pr = PB;   // read once: on lavapipe a uniform read after a branch is a gather
    let g = wid.x + wid.y * nwg.x;
    let s = g / pr.nblk;
    let e = (g - s * pr.nblk) * 64u + lid.x;
    let U = u32(csr[0]);
    if (s >= U || s >= pr.M || e >= pr.E) { return; }
    let tok = csr[2u + pr.M + s];
    let r = u32(tok) - pr.v0;
    if (tok < 0 || u32(tok) < pr.v0 || r >= pr.V) { return; }
    let start = u32(csr[1u + s]);
    let end = u32(csr[2u + s]);
    var acc = 0.0;
    for (var j = start; j < end; j = j + 1u) {
        let m = u32(csr[2u + 2u * pr.M + j]) - pr.m0;   // wraps when below the range
        if (m < pr.Mn) { acc = acc + dout[pr.o_dout + m * pr.E + e]; }
    }
    let k = pr.o_dw + r * pr.E + e;
    dweight[k] = dweight[k] + acc;
}
