// requires: subgroups
// out[0] = (subgroup size, invocations of this 8-invocation workgroup in the subgroup):
// engine/ops/lanes.py uses the 8-lane kernels (matmul_lanes, scan_lanes_*) only
// where both are 8.
@group(0) @binding(0) var<storage, read_write> out: array<vec4<f32>>;

@compute @workgroup_size(8)
fn lanes_probe(@builtin(subgroup_size) n: u32, @builtin(local_invocation_index) l: u32) {
    let live = subgroupAdd(1u);
    if (l == 0u) { out[0] = vec4<f32>(f32(n), f32(live), 0.0, 0.0); }
}
