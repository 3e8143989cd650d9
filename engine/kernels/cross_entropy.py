"""Log-softmax + cross-entropy on the GPU (shaders/cross_entropy.wgsl).

Rows may be a chunk of the batch (logits are produced in row chunks): pass views of
`loss_rows` / `targets` for the chunk.  The mean over the batch is the caller's sum of
loss_rows times scale (1 / number of valid targets in the whole batch).
"""

from __future__ import annotations

from memengine.engine.kernels.lanes import row_workgroup
from memengine.engine.runtime import Recorder, Tensor, bound, pack, rows, split


def cross_entropy(rec: Recorder, loss_rows: Tensor, logits: Tensor, targets: Tensor, scale: Tensor,
                  *, want_grad: bool, hits: tuple[Tensor, Tensor] | None = None,
                  loss_scale: Tensor | None = None) -> None:
    """loss_rows[Mc] = -log softmax(logits)[target] (WRITE; 0 where target < 0).
    With want_grad, logits [Mc, V] is OVERWRITTEN by (softmax - onehot) * scale[0]
    (a zero row where the target is ignored).  With hits = (top1 [Mc], top5 [Mc]) (views
    of one buffer, no gradient): 1.0 where the target is among the top 1 / top 5 logits
    (fewer than k logits strictly greater), else 0.0 (WRITE).  `loss_scale` [1] (GPU, the
    dynamic loss scale of --precision mixed) multiplies the gradient too."""
    Mc = int(targets.numel)
    V = int(logits.shape[-1])
    assert logits.numel == Mc * V and loss_rows.numel == Mc and scale.numel >= 1, (
        loss_rows.shape, logits.shape, targets.shape, scale.shape)
    if Mc == 0:
        return
    rt = rec.rt
    parts = split(rt, Mc, lambda n: (4 * n * V, 4 * n), unit=f"one row of logits ({V} values)")
    if len(parts) > 1:  # logits larger than one binding: row ranges
        for r0, n in parts:
            h = None if hits is None else (rows(hits[0], r0, n, 1), rows(hits[1], r0, n, 1))
            cross_entropy(rec, rows(loss_rows, r0, n, 1), rows(logits, r0, n, V), rows(targets, r0, n, 1),
                          scale, want_grad=want_grad, hits=h, loss_scale=loss_scale)
        return
    (bl, ol), (bx, ox), (bt, ot), (bs, os_) = (bound(rt, t) for t in (loss_rows, logits, targets, scale))
    if loss_scale is None:
        loss_scale = rt.scratch("cross_entropy.one", (1,))
        if not getattr(loss_scale, "filled", False):  # once per scratch tensor
            rt.write(loss_scale, [1.0])
            loss_scale.filled = True
    bindings = {0: bl, 1: bx, 2: bt, 3: bs, 6: loss_scale}
    o1 = o5 = 0
    if hits is not None:
        top1, top5 = hits
        gap = (top5.offset - top1.offset) // 4
        assert not want_grad and top1.buffer is top5.buffer and top1.numel == top5.numel == Mc and gap >= Mc
        bindings[5], o1 = bound(rt, Tensor(top1.buffer, (gap + Mc,), "f32", top1.offset))
        o5 = o1 + gap
    u = rt.uniform(pack("8I", Mc, V, ol, ox, ot, os_, o1, o5))
    bindings[4] = u
    entry = "cross_entropy_eval" if hits is not None else (
        "cross_entropy_backward" if want_grad else "cross_entropy_forward")
    rec.dispatch("cross_entropy", entry, bindings, Mc, row_workgroup(rt, V, 256))
