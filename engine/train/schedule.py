"""Learning-rate schedules, with exactly the arithmetic of transformers' schedulers.

`lr(k)` is the learning rate of the update that follows k completed updates (the
scheduler's value after k `scheduler.step()` calls), i.e. base lr x factor(k):

* constant: `get_constant_schedule_with_warmup`
* linear:   `get_linear_schedule_with_warmup`
* cosine:   `get_cosine_schedule_with_warmup` (half a cosine), or with --min-lr
            `get_cosine_with_min_lr_schedule_with_warmup(min_lr=...)`

With --min-lr, the linear schedule uses the same floor as the cosine one:
factor x (1 - min_lr/lr) + min_lr/lr after the warmup (transformers has no linear
counterpart).  The step count is the run's, across resumes, so a resumed run continues
the same curve.
"""

from __future__ import annotations

import math

KINDS = ("constant", "linear", "cosine")


class Schedule:
    def __init__(self, kind: str, lr: float, warmup_steps: int, total_steps: int, min_lr: float = 0.0):
        if kind not in KINDS:
            raise ValueError(f"unknown schedule {kind!r}")
        self.kind = kind
        self.base = float(lr)
        self.warmup = int(warmup_steps)
        self.total = int(total_steps)
        self.min_rate = float(min_lr) / self.base if min_lr else 0.0

    def factor(self, k: int) -> float:
        w, t = self.warmup, self.total
        if self.kind == "constant":
            if k < w:
                return float(k) / float(max(1.0, w))
            return 1.0
        if k < w:
            return float(k) / float(max(1, w))
        if self.kind == "linear":
            f = max(0.0, float(t - k) / float(max(1, t - w)))
        else:
            progress = float(k - w) / float(max(1, t - w))
            f = max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(0.5) * 2.0 * progress)))
        if self.min_rate:
            f = f * (1 - self.min_rate) + self.min_rate
            f = max(0, f)
        return f

    def lr(self, k: int) -> float:
        return self.base * self.factor(k)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "lr": self.base, "warmup_steps": self.warmup, "total_steps": self.total,
                "min_lr": self.min_rate * self.base}
