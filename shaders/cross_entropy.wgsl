// requires: subgroups, wg_reduce
// Log-softmax + cross-entropy over rows of logits [Mc, V] (one workgroup per row).
//   loss_rows[r] = logsumexp(logits[r, :]) - logits[r, target[r]]      (0 when target < 0 or >= V)
// cross_entropy_backward also OVERWRITES the row with its gradient:
//   logits[r, i] = (softmax(logits[r, :])[i] - [i == target]) * scale[0] * lscale[0]   (zero row when ignored)
// cross_entropy_eval also writes whether the target is among the top 1 / top 5 logits
// (fewer than k logits strictly greater than the target's; 0 for an ignored row):
//   hits[o_top1 + r] = rank < 1 ;  hits[o_top5 + r] = rank < 5        (as 0.0 / 1.0)
// Max and sum-exp: one online pass per invocation, then workgroup tree reductions
// (stable: every exp argument is <= 0).
// Each invocation reads and writes only its own strided columns; the target logit is
// captured into workgroup memory by its owner before any write, so no storage race.
// Invocations per row: a pipeline constant (engine/ops/lanes.py: 8, one SIMD vector, on CPU
// adapters, where a barrier switches coroutines); a power of two, at most 256.
override WG: u32 = 256u;
// the row's WG = 8 invocations are one subgroup (engine/ops/lanes.py): sums by shuffles
override SG8: bool = false;

struct Params { Mc: u32, V: u32, o_loss: u32, o_logits: u32, o_tgt: u32, o_scale: u32, o_top1: u32, o_top5: u32 }

@group(0) @binding(0) var<storage, read_write> loss_rows: array<f32>;
@group(0) @binding(1) var<storage, read_write> logits: array<f32>;
@group(0) @binding(2) var<storage, read> targets: array<i32>;
@group(0) @binding(3) var<storage, read> scale: array<f32>;
@group(0) @binding(4) var<uniform> P: Params;
@group(0) @binding(5) var<storage, read_write> hits: array<f32>;
// the loss scale (--precision mixed; 1 otherwise): the gradient is multiplied by lscale[0]
@group(0) @binding(6) var<storage, read> lscale: array<f32>;

var<workgroup> tlogit: f32;

// Returns how many logits of the row are strictly greater than the target's (when want_rank).
fn ce_row(row: u32, l: u32, want_grad: bool, want_rank: bool) -> f32 {
    let base = P.o_logits + row * P.V;
    let t = targets[P.o_tgt + row];
    let valid = t >= 0 && u32(t) < P.V;
    if (valid && u32(t) % WG == l) { tlogit = logits[base + u32(t)]; }   // its owner, before any write
    // one pass: per-invocation online (max, sum exp(v - max)), then merged across the group;
    // four of the invocation's columns a turn, loaded before any is used (here and in the
    // gradient's pass: a step's cross-entropy backward on the H200 4.66 -> 3.92 ms)
    var m = -0x1.fffffep+127f;   // -FLT_MAX (Tint refuses -3.4028235e38: it rounds past the f32 range)
    var se = 0.0;
    var i = l;
    for (; i + 3u * WG < P.V; i = i + 4u * WG) {
        let v0 = logits[base + i];
        let v1 = logits[base + i + WG];
        let v2 = logits[base + i + 2u * WG];
        let v3 = logits[base + i + 3u * WG];
        let m4 = max(max(v0, v1), max(v2, v3));
        if (m4 > m) { se = se * exp(m - m4); m = m4; }
        se = se + exp(v0 - m) + exp(v1 - m) + exp(v2 - m) + exp(v3 - m);
    }
    for (; i < P.V; i = i + WG) {
        let v = logits[base + i];
        if (v > m) { se = se * exp(m - v) + 1.0; m = v; } else { se = se + exp(v - m); }
    }
    let mx = wg_max(m, l);
    workgroupBarrier();                      // publishes tlogit
    se = wg_sum(se * exp(m - mx), l);
    if (l == 0u) {
        var loss = 0.0;
        if (valid) { loss = (mx - tlogit) + log(se); }   // no cancellation at large logits
        loss_rows[P.o_loss + row] = loss;
    }
    if (want_grad) {
        let sc = scale[P.o_scale] * lscale[0];
        let inv = 1.0 / se;
        var i = l;
        if (valid) {
            for (; i + 3u * WG < P.V; i = i + 4u * WG) {
                let v0 = logits[base + i];
                let v1 = logits[base + i + WG];
                let v2 = logits[base + i + 2u * WG];
                let v3 = logits[base + i + 3u * WG];
                logits[base + i] = exp(v0 - mx) * inv * sc;
                logits[base + i + WG] = exp(v1 - mx) * inv * sc;
                logits[base + i + 2u * WG] = exp(v2 - mx) * inv * sc;
                logits[base + i + 3u * WG] = exp(v3 - mx) * inv * sc;
            }
            for (; i < P.V; i = i + WG) { logits[base + i] = exp(logits[base + i] - mx) * inv * sc; }
            // the target's column, by its owner (which wrote it above): softmax - 1
            if (u32(t) % WG == l) { logits[base + u32(t)] = (exp(tlogit - mx) * inv - 1.0) * sc; }
        } else {
            for (; i < P.V; i = i + WG) { logits[base + i] = 0.0; }
        }
    }
    var rank = 0.0;
    if (want_rank) {
        var above = 0.0;
        if (valid) {
            for (var i = l; i < P.V; i = i + WG) {
                if (logits[base + i] > tlogit) { above = above + 1.0; }
            }
        }
        rank = wg_sum(above, l);             // exact: counts stay far below 2^24
    }
    return rank;
}

@compute @workgroup_size(WG)
fn cross_entropy_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= P.Mc) { return; }
    ce_row(row, lid.x, false, false);
}

@compute @workgroup_size(WG)
fn cross_entropy_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                          @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= P.Mc) { return; }
    ce_row(row, lid.x, true, false);
}

@compute @workgroup_size(WG)
fn cross_entropy_eval(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= P.Mc) { return; }
    let t = targets[P.o_tgt + row];
    let valid = t >= 0 && u32(t) < P.V;
    let rank = ce_row(row, lid.x, false, true);
    if (lid.x == 0u) {
        hits[P.o_top1 + row] = select(0.0, 1.0, valid && rank < 1.0);
        hits[P.o_top5 + row] = select(0.0, 1.0, valid && rank < 5.0);
    }
}
