// Copies and clears recorded as dispatches (gpu.Recorder.copy / clear on GPUs): inside a
// compute pass they cost what a dispatch does, where a buffer copy or clear ends the pass
// (on the H200 about 3 us per dependent dispatch against 25-60 us per copy between
// passes; benchmarks/README.md).  Words of 32 bits, so any dtype's bits go through as
// they are.  dst[o_dst + i] = src[o_src + i] (copy_words) or 0 (clear_words), i < n.
struct CopyParams { n: u32, o_src: u32, o_dst: u32, _p: u32 }

@group(0) @binding(0) var<storage, read_write> dst: array<u32>;
@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<uniform> P: CopyParams;

@compute @workgroup_size(256)
fn copy_words(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let i = lin(wid, nwg, lid);
    if (i < P.n) { dst[P.o_dst + i] = src[P.o_src + i]; }
}

@compute @workgroup_size(256)
fn clear_words(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let i = lin(wid, nwg, lid);
    if (i < P.n) { dst[P.o_dst + i] = 0u; }
}
