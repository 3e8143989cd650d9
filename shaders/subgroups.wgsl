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
