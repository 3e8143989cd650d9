// Stand-ins for shaders/subgroups.wgsl on devices without subgroups: a subgroup of one,
// so kernels that ask sg_size() take their workgroup-memory path.

fn sg_size() -> u32 { return 1u; }
fn sg_xor_u(v: u32, mask: u32) -> u32 { return v; }
fn sg_xor4(v: vec4<f32>, mask: u32) -> vec4<f32> { return v; }
fn sg_xor2(v: vec2<f32>, mask: u32) -> vec2<f32> { return v; }
fn sg_xor1(v: f32, mask: u32) -> f32 { return v; }
fn sg_shuffle4(v: vec4<f32>, lane: u32) -> vec4<f32> { return v; }
fn sg_shuffle1(v: f32, lane: u32) -> f32 { return v; }
fn lanes_sum8(v: f32) -> f32 { return v; }
fn lanes_max8(v: f32) -> f32 { return v; }
