"""Write-through selective adaptation (WSLA): train only each layer's x_proj, with rollback.

SPEC section 5.  The trainable set is every layer's `x_proj` (weight, and bias when one
exists); everything else is frozen and must come out bit-identical.  Perplexity on the
adapt text is measured before and after; when any epoch loss is non-finite, or the
perplexity after is non-finite or above ``before * tolerance``, the pre-adapt weights are
restored (``rolled_back=True``) and the caller writes nothing.

Nothing here prints: progress leaves through the callbacks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from .errors import MemengineError, NonFiniteError

ADAPT_DEFAULTS = {"epochs": 3, "max_delta": 0.05}


@dataclass
class AdaptResult:
    perplexity_before: float
    perplexity_after: float
    grad_norm: float  # mean pre-clip gradient norm over all epochs
    rolled_back: bool
    reason: str
    changed_tensors: list[str] = field(default_factory=list)
    max_abs_delta: float = 0.0
    epochs: list = field(default_factory=list)  # list[EpochStats]
    optimizer_state: dict | None = None
    loss_before: float = float("nan")
    loss_after: float = float("nan")
    tokens: int = 0

    def summary(self) -> dict:
        return {
            "perplexity_before": float(self.perplexity_before),
            "perplexity_after": float(self.perplexity_after),
            "loss_before": float(self.loss_before),
            "loss_after": float(self.loss_after),
            "grad_norm": float(self.grad_norm),
            "rolled_back": bool(self.rolled_back),
            "reason": self.reason,
            "changed_tensors": list(self.changed_tensors),
            "max_abs_delta": float(self.max_abs_delta),
        }


def _snapshot(model) -> dict[str, np.ndarray]:
    return {k: np.array(v, dtype=np.float32, copy=True) for k, v in model.state_dict().items()}


def adapt(
    model,
    batches,
    options=None,
    optimizer_state: dict | None = None,
    tolerance: float = 1.25,
    rollback: bool = True,
    on_epoch: Callable | None = None,
    on_progress: Callable | None = None,
    on_eval: Callable | None = None,
) -> AdaptResult:
    """Adapt `model` in place on `batches` (WSLA).  See the module docstring.

    `options` is a `TrainOptions` (its `wsla` is forced on); `on_eval(phase, step, total)`
    reports the before/after evaluation passes ("before" / "after").
    """
    from .trainer import TrainOptions, Trainer, evaluate

    if options is None:
        options = TrainOptions(**ADAPT_DEFAULTS)
    options = replace(options, wsla=True)
    if not (tolerance > 0 and math.isfinite(tolerance)):
        raise MemengineError(f"--tolerance must be a positive finite number (got {tolerance})")
    if not batches:
        raise MemengineError("no data to adapt on")

    trainable = list(model.trainable_names(True))
    before = _snapshot(model)

    def _ev(phase):
        cb = (lambda s, t: on_eval(phase, s, t)) if on_eval else None
        return evaluate(model, batches, on_progress=cb)

    ev_before = _ev("before")
    ppl_before = float(ev_before.perplexity)
    if not math.isfinite(ppl_before):
        raise MemengineError(
            f"perplexity of the input model on the adapt text is not finite ({ppl_before}); "
            "the checkpoint cannot be adapted"
        )

    trainer = Trainer(model, options, optimizer_state)
    stats: list = []

    def _on_epoch(s):
        stats.append(s)
        if on_epoch is not None:
            on_epoch(s)

    reason = ""
    nonfinite = False
    try:
        trainer.fit(batches, on_epoch=_on_epoch, on_progress=on_progress)
    except NonFiniteError as e:
        nonfinite = True
        reason = f"non-finite training loss ({e})"
    if not nonfinite:
        bad = [s.epoch for s in stats if not math.isfinite(float(s.loss))]
        if bad:
            nonfinite = True
            reason = f"non-finite loss in epoch {bad[0]}"

    ppl_after = float("nan")
    loss_after = float("nan")
    if not nonfinite:
        ev_after = _ev("after")
        ppl_after = float(ev_after.perplexity)
        loss_after = float(ev_after.loss)
        limit = ppl_before * tolerance
        if not math.isfinite(ppl_after):
            reason = f"perplexity after adaptation is not finite ({ppl_after})"
        elif ppl_after > limit:
            reason = (f"perplexity rose from {ppl_before:.4f} to {ppl_after:.4f}, above "
                      f"before x tolerance = {ppl_before:.4f} x {tolerance:g} = {limit:.4f}")

    norms = [float(s.grad_norm) for s in stats]
    grad_norm = float(np.mean(norms)) if norms else float("nan")

    # What the training did (measured before any rollback, so a rolled-back summary
    # still says which tensors moved and by how much).
    after = _snapshot(model)
    changed: list[str] = []
    max_abs = 0.0
    trainable_set = set(trainable)
    for name, b in before.items():
        a = after.get(name)
        if a is None:
            continue
        if a.shape != b.shape or not np.array_equal(a.view(np.uint32), b.view(np.uint32)):
            if name not in trainable_set:
                raise RuntimeError(f"internal error: frozen tensor {name} changed during adaptation")
            changed.append(name)
            with np.errstate(invalid="ignore", over="ignore"):
                d = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if a.size else 0.0
            max_abs = max(max_abs, d)

    regressed = bool(reason)
    rolled_back = regressed and rollback
    if rolled_back:
        model.load_state_dict(before)
        new_opt = optimizer_state
    else:
        new_opt = trainer.optimizer_state()
        if regressed:
            reason = "not rolled back (--no-rollback): " + reason

    if not regressed:
        reason = f"perplexity {ppl_before:.4f} -> {ppl_after:.4f} (within x{tolerance:g})"

    return AdaptResult(
        perplexity_before=ppl_before,
        perplexity_after=ppl_after,
        grad_norm=grad_norm,
        rolled_back=rolled_back,
        reason=reason,
        changed_tensors=changed,
        max_abs_delta=max_abs,
        epochs=stats,
        optimizer_state=new_opt,
        loss_before=float(ev_before.loss),
        loss_after=loss_after,
        tokens=int(ev_before.tokens),
    )
