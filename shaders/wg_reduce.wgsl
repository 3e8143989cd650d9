// Sum and max over the WG invocations that share a row (one workgroup a row), put in front of
// a module whose first line requires `subgroups, wg_reduce`; the module declares
// `override WG` (a power of two, at most 256) and `override SG8` (the row is one subgroup of
// 8: shuffles, which pair lanes as the tree below pairs them, so both give the same bits).
// Call from control flow that every invocation of the workgroup reaches.

var<workgroup> red: array<f32, 256>;

fn wg_reduce(v: f32, l: u32, take_max: bool) -> f32 {
    if (SG8) {
        if (take_max) { return lanes_max8(v); }
        return lanes_sum8(v);
    }
    red[l] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s >> 1u) {
        if (l < s) {
            let o = red[l + s];
            red[l] = select(red[l] + o, max(red[l], o), take_max);
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

fn wg_sum(v: f32, l: u32) -> f32 { return wg_reduce(v, l, false); }
fn wg_max(v: f32, l: u32) -> f32 { return wg_reduce(v, l, true); }
