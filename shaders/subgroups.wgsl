// Subgroup helpers, put in front of a shader whose first line is `// requires: subgroups`
// when the device has the `subgroup` feature (shaders/subgroups_off.wgsl otherwise).
// Call them from control flow that every invocation of the subgroup reaches.
// (naga 0.32 takes subgroup built-ins without an `enable subgroups;` directive and rejects it)

// invocations in this subgroup (call where all of them are active)
fn sg_size() -> u32 { return subgroupAdd(1u); }
// the value of the invocation whose subgroup index is this one's XOR mask
fn sg_xor_u(v: u32, mask: u32) -> u32 { return subgroupShuffleXor(v, mask); }
fn sg_xor4(v: vec4<f32>, mask: u32) -> vec4<f32> { return subgroupShuffleXor(v, mask); }
fn sg_xor2(v: vec2<f32>, mask: u32) -> vec2<f32> { return subgroupShuffleXor(v, mask); }
fn sg_xor1(v: f32, mask: u32) -> f32 { return subgroupShuffleXor(v, mask); }
// the value of invocation `lane` of the subgroup (lane the same for all: a broadcast)
fn sg_shuffle4(v: vec4<f32>, lane: u32) -> vec4<f32> { return subgroupShuffle(v, lane); }
fn sg_shuffle1(v: f32, lane: u32) -> f32 { return subgroupShuffle(v, lane); }
// the sum / max over a subgroup of 8, in every lane, paired as a halving tree pairs them
// (lanes 4 apart, then 2, then 1): bit for bit what the kernels' workgroup-memory trees give
fn lanes_sum8(v: f32) -> f32 {
    let a = v + sg_xor1(v, 4u);
    let b = a + sg_xor1(a, 2u);
    return b + sg_xor1(b, 1u);
}
fn lanes_max8(v: f32) -> f32 {
    let a = max(v, sg_xor1(v, 4u));
    let b = max(a, sg_xor1(a, 2u));
    return max(b, sg_xor1(b, 1u));
}
