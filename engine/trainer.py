"""Training loop and evaluation (SPEC section 4). No rich here: progress leaves by callbacks.

One step is one command submission: upload the batch, clear the gradients, forward,
loss, backward, global-norm clip factor, one AdamW dispatch per trainable parameter.
The step's mean loss and pre-clip gradient norm are accumulated on the GPU and read
back once per epoch (the only readback).  A `StepFence` keeps at most a few steps
queued, so progress callbacks follow the GPU and Ctrl-C stops promptly.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Callable


from .errors import MemengineError, NonFiniteError
from .gpu import StepFence
from .model import MambaModel, perplexity
from .ops.reduce import sum_into
from .optim import AdamW, GradClipper


@dataclass
class TrainOptions:
    epochs: int = 5
    lr: float = 1e-4
    batch_size: int = 1
    seq_len: int = 512
    max_grad_norm: float = 1.0
    weight_decay: float = 0.01
    max_delta: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    seed: int = 0           # recorded with the run; the loop itself samples nothing
    wsla: bool = False

    def validate(self) -> None:
        checks = [
            (self.epochs >= 1, "--epochs must be at least 1"),
            (self.lr > 0 and math.isfinite(self.lr), "--lr must be a positive number"),
            (self.batch_size >= 1, "--batch-size must be at least 1"),
            (self.seq_len >= 1, "--seq-len must be at least 1"),
            (self.max_grad_norm >= 0, "--max-grad-norm must be >= 0 (0 disables clipping)"),
            (self.weight_decay >= 0, "--weight-decay must be >= 0"),
            (self.max_delta >= 0, "--max-delta must be >= 0 (0 disables the trust region)"),
            (0 <= self.beta1 < 1, "--beta1 must be in [0, 1)"),
            (0 <= self.beta2 < 1, "--beta2 must be in [0, 1)"),
            (self.eps > 0, "--eps must be positive"),
        ]
        for ok, msg in checks:
            if not ok:
                raise MemengineError(msg)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class EpochStats:
    epoch: int
    loss: float
    grad_norm: float
    tokens: int
    tokens_per_s: float
    elapsed_s: float


@dataclass
class EvalResult:
    loss: float
    perplexity: float
    tokens: int


def _batch_shape(batches) -> tuple[int, int]:
    shapes = {tuple(b.ids.shape) for b in batches}
    if not batches:
        raise MemengineError("no training data: the text is too short to form one window of 2 tokens")
    if len(shapes) != 1:
        raise ValueError(f"batches must share one shape, got {sorted(shapes)}")
    return shapes.pop()


class Trainer:
    """Full fine-tuning or WSLA (x_proj only) with AdamW, on the GPU."""

    def __init__(self, model: MambaModel, options: TrainOptions, optimizer_state: dict | None = None):
        options.validate()
        self.model = model
        self.options = options
        rt = model.rt
        self.opt = AdamW(rt, lr=options.lr, betas=(options.beta1, options.beta2), eps=options.eps,
                         weight_decay=options.weight_decay, max_delta=options.max_delta)
        if optimizer_state:
            self.opt.load_state_dict(optimizer_state)
        self.clipper = GradClipper(rt)
        self._loss_acc = rt.empty((1,), name="epoch_loss")

    def optimizer_state(self) -> dict:
        return self.opt.state_dict()

    def fit(self, batches: list, on_epoch: Callable | None = None,
            on_progress: Callable | None = None) -> list:
        model, o, rt = self.model, self.options, self.model.rt
        B, L = _batch_shape(batches)
        ws = model.workspace(B, L)
        names = model.trainable_names(o.wsla)
        trainable = set(names)
        params = {n: model.P.views[n] for n in names}
        grads = {n: model.G.views[n] for n in names}
        grad_list = list(grads.values())
        history = []
        total = len(batches)
        fence = StepFence(rt)
        for epoch in range(1, o.epochs + 1):
            t0 = time.perf_counter()
            rec = rt.recorder()
            rec.clear(self._loss_acc)
            self.clipper.reset_epoch(rec)
            rec.submit()
            tokens = 0
            for step, batch in enumerate(batches, 1):
                fence.wait()  # keeps at most fence.depth steps queued (no readback)
                model.write_batch(ws, batch.ids, batch.targets)
                model.record_gradients(rec, ws, batch.ids, trainable, self._loss_acc)
                self.clipper.record(rec, grad_list, o.max_grad_norm)
                self.opt.record_step(rec, params, grads, self.clipper.factor)
                fence.mark(rec)
                rec.submit()
                tokens += int(batch.n_tokens)
                if on_progress is not None:
                    on_progress(step, total)
            # the one readback of the epoch (a GPU sync point)
            loss = float(rt.read(self._loss_acc)[0]) / total
            gnorm = self.clipper.mean_norm()
            elapsed = time.perf_counter() - t0
            stats = EpochStats(epoch, loss, gnorm, tokens, tokens / elapsed if elapsed > 0 else 0.0, elapsed)
            history.append(stats)
            if on_epoch is not None:
                on_epoch(stats)
            if not math.isfinite(loss):
                raise NonFiniteError(
                    f"loss became non-finite ({loss}) in epoch {epoch}; try a smaller --lr "
                    "or --max-grad-norm; nothing was written")
        return history


def evaluate(model: MambaModel, batches: list, on_progress: Callable | None = None) -> EvalResult:
    """Mean next-token loss and perplexity over the batches (one readback at the end)."""
    rt = model.rt
    B, L = _batch_shape(batches)
    ws = model.workspace(B, L)
    acc = rt.empty((1,), name="eval_loss")
    rec = rt.recorder()
    rec.clear(acc)
    n_targets = 0
    total = len(batches)
    fence = StepFence(rt)
    for step, batch in enumerate(batches, 1):
        fence.wait()
        n_targets += model.write_batch(ws, batch.ids, batch.targets)
        model.record_forward(rec, ws)
        model.record_loss(rec, ws, want_grad=False)
        sum_into(rec, acc, ws.loss_rows)
        fence.mark(rec)
        rec.submit()
        if on_progress is not None:
            on_progress(step, total)
    loss = float(rt.read(acc)[0]) / max(n_targets, 1)
    rt.free(acc)
    return EvalResult(loss, perplexity(loss), n_targets)
