// requires: ssd_ops
enable f16;
enable subgroups;
enable chromium_experimental_subgroup_matrix;
diagnostic(off, chromium_experimental.subgroup_matrix_uniformity);
// ssd_product_sgmat: shaders/ssd_scan.wgsl's `ssd_product` (every MODE: ssd_ops.wgsl's operands
// a_at / b_at, the same tiles of 64 x 64 outputs, the same `store`) on subgroup matrices, for
// --precision mixed on adapters that have them (Runtime.has_subgroup_matrix): the operands are
// computed in f32 as there, rounded to f16 into workgroup memory, and multiplied at 16x16x16
// with f32 accumulation. A workgroup is 8 subgroups of 32 (4 x 2): each makes a 16 x 32 part of
// the tile as two 16 x 16 results. K advances SK = 32 at a time (the two-phase modes switch
// phase at multiples of 64, so a step never straddles one). The results go through the
// tile in workgroup memory to `store`, invocation (tr, ts) writing the outputs
// ssd_product's invocation writes.

const SK: u32 = 32u;
var<workgroup> hA: array<f16, 2048>;   // [SK][T]: hA[k * T + r]
var<workgroup> hB: array<f16, 2048>;   // [SK][T]: hB[k * T + s]
var<workgroup> hC: array<f32, 4096>;   // the tile's results [T][T]

@compute @workgroup_size(256)
fn ssd_product_sgmat(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) lid: u32, @builtin(subgroup_id) sg: u32) {
    let u = US;
    let w = wid.x + wid.y * nwg.x;
    let z = w / u.ntile;
    if (z >= u.Z) { return; }    // (the whole workgroup)
    let it = item(u, z);
    let d = dims(u);
    let ns = (d.y + T - 1u) / T;
    let r0 = ((w % u.ntile) / ns) * T;
    let s0 = ((w % u.ntile) % ns) * T;
    let sm = (sg / 2u) * 16u;    // the subgroup's rows and columns in the tile
    let sn = (sg % 2u) * 32u;
    var c0: subgroup_matrix_result<f32, 16, 16>;   // zero-initialised
    var c1: subgroup_matrix_result<f32, 16, 16>;
    for (var k0 = 0u; k0 < d.z; k0 += SK) {
        let ph = select(0u, 1u, k0 >= d.w);
        let akf = a_kfast(ph);
        let bkf = b_kfast(ph);
        for (var q = 0u; q < 8u; q++) {
            let e = lid + q * 256u;
            var kk = e / T;
            var rr = e % T;
            if (akf) { kk = e % SK; rr = e / SK; }
            var v = 0.0;
            if (r0 + rr < d.x && k0 + kk < d.z) { v = a_at(u, it, r0 + rr, k0 + kk, ph, d.w); }
            hA[kk * T + rr] = f16(v);
            var kb = e / T;
            var sb = e % T;
            if (bkf) { kb = e % SK; sb = e / SK; }
            var vb = 0.0;
            if (s0 + sb < d.y && k0 + kb < d.z) { vb = b_at(u, it, k0 + kb, s0 + sb, ph, d.w); }
            hB[kb * T + sb] = f16(vb);
        }
        workgroupBarrier();
        for (var kk = 0u; kk < SK; kk += 16u) {
            // left: rows sm.. of the [k][r] tile, column-major; right: [k][s], row-major
            let a = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>>(&hA, kk * T + sm, true, T);
            let b0 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>>(&hB, kk * T + sn, false, T);
            let b1 = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>>(&hB, kk * T + sn + 16u, false, T);
            c0 = subgroupMatrixMultiplyAccumulate(a, b0, c0);
            c1 = subgroupMatrixMultiplyAccumulate(a, b1, c1);
        }
        workgroupBarrier();
    }
    subgroupMatrixStore(&hC, sm * T + sn, c0, false, T);
    subgroupMatrixStore(&hC, sm * T + sn + 16u, c1, false, T);
    workgroupBarrier();
    let tr = lid / 16u;
    let ts = lid % 16u;
    for (var a = 0u; a < 4u; a++) {
        let r = tr + 16u * a;
        if (r0 + r >= d.x) { continue; }
        for (var b = 0u; b < 4u; b++) {
            let s = ts + 16u * b;
            if (s0 + s < d.y) { store(u, it, r0 + r, s0 + s, hC[r * T + s]); }
        }
    }
}
