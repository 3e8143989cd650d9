"""Write-through selective adaptation (WSLA): what is specific to `adapt` (SPEC section 5).

The trainable set is every layer's `x_proj` (weight, and bias when one exists; the
trainer's `wsla` set); everything else is frozen and must come out bit-identical.
Perplexity on the adapt text is measured before and after training; when a loss was
non-finite, or the perplexity after is non-finite or above ``before * tolerance``, the
run rolls back: the weights are restored and nothing is written.  The loop itself is the
training loop of engine/loop.py; engine/run.py puts the pieces together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class AdaptResult:
    perplexity_before: float
    perplexity_after: float
    grad_norm: float  # mean pre-clip gradient norm over the epochs
    rolled_back: bool
    reason: str
    changed_tensors: list[str] = field(default_factory=list)
    max_abs_delta: float = 0.0
    loss_before: float = float("nan")
    loss_after: float = float("nan")

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


def snapshot(model) -> dict[str, np.ndarray]:
    return {k: np.array(v, dtype=np.float32, copy=True) for k, v in model.state_dict().items()}


def regression(ppl_before: float, ppl_after: float, tolerance: float, failure: str = "") -> str:
    """Why the adaptation regressed ("" when it did not)."""
    if failure:
        return failure
    limit = ppl_before * tolerance
    if not math.isfinite(ppl_after):
        return f"perplexity after adaptation is not finite ({ppl_after})"
    if ppl_after > limit:
        moved = "rose" if ppl_after > ppl_before else "fell" if ppl_after < ppl_before else "stayed"
        return (f"perplexity {moved} from {ppl_before:.4f} to {ppl_after:.4f}, above "
                f"before x tolerance = {ppl_before:.4f} x {tolerance:g} = {limit:.4f}")
    return ""


def changes(before: dict, after: dict, trainable) -> tuple[list[str], float]:
    """(tensors that changed, largest absolute change); a frozen tensor that changed is an
    internal error."""
    changed, max_abs = [], 0.0
    trainable = set(trainable)
    for name, b in before.items():
        a = after.get(name)
        if a is None:
            continue
        if a.shape != b.shape or not np.array_equal(a.view(np.uint32), b.view(np.uint32)):
            if name not in trainable:
                raise RuntimeError(f"internal error: frozen tensor {name} changed during adaptation")
            changed.append(name)
            with np.errstate(invalid="ignore", over="ignore"):
                d = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if a.size else 0.0
            max_abs = max(max_abs, d)
    return changed, max_abs
