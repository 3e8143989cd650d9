"""The training loop: optimizer steps over shuffled windows until --epochs or --max-steps,
with the learning-rate schedule, the loss read back every --log-every steps, held-out
evaluation, and periodic checkpoints through a callback.  Used by `train` and `adapt`
alike (engine/run.py); reports through a `Listener`; nothing prints.

Per step there is no readback: the step's loss and gradient norm stay in the trainer's
GPU trace until the next read, which happens every --log-every steps, at each epoch's
end, before an evaluation or a checkpoint, and after the last step.  A non-finite loss
stops the run at that read, so within --log-every steps and before any checkpoint
could hold its result.

Under --precision mixed each step event (the history of trainer_state.json and
memengine.json) also carries `f16_scales`: the f16 operands' per-tensor scales at that
step, as {"min", "max": the least and greatest scale among the tensors that have one,
"changes": how many rescales changed a tensor's scale since the run began, "tensors":
how many have one} (engine/kernels/matmul.py F16Scales.summary): a few numbers a log
step, whatever the run's length or the model's depth; the whole table (every tensor's
scale, changes, least and greatest scale, last amax) is in the checkpoints'
optimizer.safetensors.

Ctrl-C and SIGTERM (a run with checkpoints, one process): the first signal lets the step
in flight and its end-of-step work finish (`interrupts.finishing`), then a checkpoint is
written and the loop stops with a KeyboardInterrupt; a second signal ends the process at
once (engine/interrupts.py).  Besides every --save-every steps, a checkpoint is written
after every --save-every-minutes of training.

Everything that makes a continued run identical to an uninterrupted one is in
`LoopState` (saved with each checkpoint): the step count, the data position and the
shuffle generator's state (sampler.py), the sums of the epoch and of the current
logging window, the history of events and the best checkpoint so far.  The schedule is
a function of the step count.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import numpy as np
from memengine.engine import interrupts
from memengine.engine.errors import NonFiniteError
from memengine.engine.io.data import IGNORE, Batch, make_batches, targets_of, window_count
from memengine.engine.listener import Listener, Plan, Progress
from memengine.engine.train.sampler import WindowOrder
from memengine.engine.train.schedule import Schedule
from memengine.engine.train.trainer import Trainer, evaluate


def _sums() -> dict:
    return {"loss": 0.0, "grad_norm": 0.0, "steps": 0, "tokens": 0, "elapsed_s": 0.0, "skipped": 0}


@dataclass
class LoopState:
    step: int = 0                                  # optimizer steps done, over the whole run
    order: Optional[dict] = None                   # WindowOrder.state()
    epoch_sums: dict = field(default_factory=_sums)
    window_sums: dict = field(default_factory=_sums)  # since the last step event
    last_loss: Optional[float] = None
    last_eval: Optional[dict] = None
    best: Optional[dict] = None                    # {"step", "val_loss"} of the best checkpoint
    history: list = field(default_factory=list)    # every event so far (step, eval, epoch, checkpoint)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LoopState":
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)


def reads_apart(options, n_windows: int) -> int:
    """The most steps between two reads of the trainer's trace: --log-every, or an epoch
    (the loop reads at every epoch's end)."""
    return max(1, min(options.log_every, math.ceil(n_windows / (options.batch_size * options.grad_accum))))


def total_steps(options, steps_per_epoch: int) -> int:
    """Steps the run ends at: --epochs and --max-steps, whichever comes first."""
    limits = []
    if options.epoch_limit is not None:
        limits.append(options.epoch_limit * steps_per_epoch)
    if options.max_steps is not None:
        limits.append(options.max_steps)
    return min(limits)


class TrainingLoop:
    """`run()` trains `trainer.model` on `windows` ([(inputs, targets)]) as `options` say
    (a TrainOptions).  `on_save(loop)` writes a checkpoint and returns its path."""

    def __init__(self, trainer: Trainer, windows: list, options, *, val_batches: list | None = None,
                 listener: Listener | None = None, state: LoopState | None = None,
                 on_save: Callable | None = None, title: str = "train"):
        self.trainer = trainer
        self.windows = windows
        self.o = options
        self.val_batches = val_batches or None
        self.listener = listener or Listener()
        self.state = state or LoopState()
        self.on_save = on_save
        self.title = title
        self.group = trainer.group   # a data-parallel run's ranks (engine/train/distributed.py)
        world = 1 if self.group is None else self.group.world
        # a step takes the windows of a one-process step at --batch-size x the ranks
        self.order = WindowOrder(len(windows), options.batch_size * options.grad_accum * world, options.seed,
                                 options.shuffle, self.state.order)
        self.steps_per_epoch = self.order.steps_per_epoch
        self.total = total_steps(options, self.steps_per_epoch)
        self.schedule = Schedule(options.lr_schedule, options.lr, options.warmup_steps, self.total, options.min_lr)
        self._tokens: list[int] = []   # tokens of the steps not read back yet
        self._mark = time.perf_counter()
        self._excluded = 0.0
        # a first Ctrl-C finishes the step and writes a checkpoint (one process: ranks stop at once)
        self.soft = on_save is not None and self.group is None
        self._saved_at = time.monotonic()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        self.state.order = self.order.state()
        return {**self.state.to_dict(), "schedule": self.schedule.to_dict()}

    def _record(self, event: dict) -> dict:
        self.state.history.append(event)
        return event

    # ------------------------------------------------------------------ the loop
    def run(self) -> LoopState:
        with interrupts.deferred(), (interrupts.keeping_work() if self.soft else contextlib.nullcontext()):
            try:
                self._run()
            finally:
                self.listener.on_finish()
        return self.state

    def _run(self) -> None:
        o, st, lis = self.o, self.state, self.listener
        lis.on_start(Plan(title=self.title, total_steps=self.total, steps_per_epoch=self.steps_per_epoch,
                          epochs=o.epoch_limit, first_step=st.step, windows=len(self.windows),
                          val_windows=window_count(self.val_batches)))
        self._mark = time.perf_counter()
        self._t0, self._run_tokens = self._mark, 0
        self._excluded = 0.0   # evaluation and checkpoint time: not training time
        B, L = o.batch_size, o.seq_len
        while st.step < self.total:
            with interrupts.finishing() if self.soft else contextlib.nullcontext():
                epoch, saved = self._one_step(B, L)
            if self.soft and interrupts.pending():
                self._stop_with_checkpoint(epoch, saved)

    def _stop_with_checkpoint(self, epoch: int, saved: bool) -> None:
        """A signal came during the step: the step is done; write a checkpoint (unless the
        step just wrote one) and stop."""
        interrupts.consume()
        if not saved:
            self.listener.on_note(f"{interrupts.signal_name()} after step {self.state.step}: writing a checkpoint")
            if self.trainer.pending:
                self._read(epoch)
            self._save()
        raise KeyboardInterrupt

    def _one_step(self, B: int, L: int) -> tuple[int, bool]:
        """One optimizer step and what follows it (reads, events, evaluation, checkpoint):
        (the epoch, whether a checkpoint was written)."""
        o, st, lis = self.o, self.state, self.listener
        epoch, k, idx = self.order.next()
        if k == 1:
            st.epoch_sums = _sums()
        lr = self.schedule.lr(st.step)
        if self.group is None:
            micro = make_batches([self.windows[i] for i in idx], B, L)
            self._tokens.append(self.trainer.step(micro, lr))
        else:
            micro, n_total, tokens = self._rank_share(idx)
            self.trainer.step(micro, lr, n_total=n_total)
            self._tokens.append(tokens)
        self._run_tokens += self._tokens[-1]
        st.step += 1
        lis.on_progress(Progress(step=st.step, total_steps=self.total, epoch=epoch, step_in_epoch=k,
                                 steps_per_epoch=self.steps_per_epoch, lr=lr, last_loss=st.last_loss,
                                 tokens=self._run_tokens,
                                 elapsed_s=time.perf_counter() - self._t0 - self._excluded))
        interrupts.check()

        epoch_end = self.order.epoch_done
        final = st.step >= self.total
        timed = self.on_save is not None and bool(getattr(o, "save_every_minutes", 0)) and (
            time.monotonic() - self._saved_at >= 60.0 * o.save_every_minutes)
        save = (bool(o.save_every) and (st.step % o.save_every == 0 or final)) or (timed and not final)
        log = st.step % o.log_every == 0
        val = self.val_batches is not None and (
            final or epoch_end or (o.eval_every and st.step % o.eval_every == 0) or (save and o.keep_best))
        if log or epoch_end or final or val or save or self.trainer.pending >= self.trainer.capacity:
            self._read(epoch)
        if log:
            self._step_event(epoch, lr)
        if val:
            self._evaluate()
        if epoch_end or final:
            self._epoch_event(epoch)
        if save and self.on_save is not None:
            self._save()
        return epoch, save and self.on_save is not None

    def _rank_share(self, idx) -> tuple[list, int, int]:
        """This rank's micro-batches of a step over the windows `idx`: micro-batch i of a
        one-process run at batch B x W (W ranks) is windows [i B W, (i + 1) B W) of the step;
        rank r takes its rows [r B, (r + 1) B) (a padding batch where none are left).  With
        the step's targets and tokens over all ranks (the loss's denominator, the report)."""
        B, L, W, r = self.o.batch_size, self.o.seq_len, self.group.world, self.group.rank
        chosen = [self.windows[i] for i in idx]
        micro = []
        for s in range(0, len(chosen), B * W):
            mine = chosen[s + r * B:s + (r + 1) * B]
            micro.append(make_batches(mine, B, L)[0] if mine else
                         Batch(ids=np.zeros((B, L), np.int32), targets=np.full((B, L), IGNORE, np.int32),
                               n_targets=0, n_tokens=0, n_windows=0))
        return micro, targets_of(chosen), sum(len(x) for x, _ in chosen)

    def _read(self, epoch: int) -> None:
        st = self.state
        losses, norms = self.trainer.read_trace()
        now = time.perf_counter()
        dt, self._mark = now - self._mark, now
        tokens, self._tokens = self._tokens, []
        first = st.step - len(losses) + 1
        for i, v in enumerate(losses):
            if not math.isfinite(v):
                # loss scaling covers the gradients only: under --precision mixed a forward
                # activation beyond f16's range gives a non-finite loss at any scale
                hint = ("try --precision fp32 (an activation that grew more than 8x within one step can "
                        "exceed f16's range, 65504, under mixed precision), or a smaller --lr or "
                        "--max-grad-norm"
                        if self.trainer.scaler is not None else "try a smaller --lr or --max-grad-norm")
                raise NonFiniteError(f"loss became non-finite ({v}) at step {first + i} (epoch {epoch}); {hint}")
        skipped = self.trainer.last_skipped
        for sums in (st.epoch_sums, st.window_sums):
            sums["loss"] += float(np.sum(losses))
            # a step skipped by loss scaling has no finite norm: the mean is over the others
            sums["grad_norm"] += float(np.sum(norms[~skipped])) if len(skipped) else float(np.sum(norms))
            sums["skipped"] = sums.get("skipped", 0) + int(np.sum(skipped))
            sums["steps"] += len(losses)
            sums["tokens"] += int(sum(tokens))
            sums["elapsed_s"] += dt
        if len(losses):
            st.last_loss = float(losses[-1])

    def _step_event(self, epoch: int, lr: float) -> None:
        w = self.state.window_sums
        n = max(w["steps"], 1)
        ev = {"event": "step", "step": self.state.step, "epoch": epoch, "loss": w["loss"] / n,
              "grad_norm": w["grad_norm"] / max(n - w.get("skipped", 0), 1), "lr": lr, "tokens": w["tokens"],
              "tokens_per_s": w["tokens"] / w["elapsed_s"] if w["elapsed_s"] > 0 else 0.0}
        if self.trainer.scaler is not None:  # --precision mixed: steps skipped by loss scaling
            ev["skipped_steps"] = w.get("skipped", 0)
        if self.trainer.f16 is not None:
            # --precision mixed: the f16 scales now (least, greatest) and their changes so far
            # (read after the trace, which synchronised already)
            ev["f16_scales"] = self.trainer.f16.summary()
        self.state.window_sums = _sums()
        self.listener.on_step(self._record(ev))

    def _epoch_event(self, epoch: int) -> None:
        e = self.state.epoch_sums
        n = max(e["steps"], 1)
        ev = {"event": "epoch", "epoch": epoch, "step": self.state.step, "loss": e["loss"] / n,
              "grad_norm": e["grad_norm"] / max(n - e.get("skipped", 0), 1), "tokens": e["tokens"],
              "tokens_per_s": e["tokens"] / e["elapsed_s"] if e["elapsed_s"] > 0 else 0.0,
              "elapsed_s": e["elapsed_s"]}
        if self.trainer.scaler is not None:
            ev["skipped_steps"] = e.get("skipped", 0)
        self.listener.on_epoch(self._record(ev))

    def _evaluate(self) -> None:
        t = time.perf_counter()
        try:
            self._evaluate_now()
        finally:
            self._excluded += time.perf_counter() - t

    def _evaluate_now(self) -> None:
        def progress(i, n):
            self.listener.on_eval_progress("val", i, n)
            interrupts.check()

        r = evaluate(self.trainer.model, self.val_batches, on_progress=progress, fence=self.trainer.fence)
        ev = {"event": "eval", "step": self.state.step, **r.to_dict(prefix="val_")}
        self.state.last_eval = ev
        self.listener.on_eval(self._record(ev))
        self._mark = time.perf_counter()  # evaluation time is not training time

    def checkpoint(self) -> None:
        """Write a checkpoint of where the run is now (a first signal after the last step)."""
        if self.trainer.pending:
            self._read(self.order.epoch)
        self._save()

    def _save(self) -> None:
        t = time.perf_counter()
        try:
            self._save_now()
        finally:
            self._excluded += time.perf_counter() - t

    def _save_now(self) -> None:
        st = self.state
        if self.o.keep_best and st.last_eval is not None and st.last_eval["step"] == st.step:
            v = st.last_eval["val_loss"]
            if st.best is None or v < st.best["val_loss"]:
                st.best = {"step": st.step, "val_loss": v}
        path = self.on_save(self)
        self.listener.on_checkpoint({"event": "checkpoint", "step": st.step, "path": str(path)})
        self._mark = time.perf_counter()
        self._saved_at = time.monotonic()


def fit(model, windows: list, options, *, optimizer_state: dict | None = None, val_batches: list | None = None,
        listener: Listener | None = None, state: LoopState | None = None) -> TrainingLoop:
    """Train `model` in memory (no files): the loop of `train`/`adapt` without their set-up
    and outputs.  Returns the loop (its `.state`, `.trainer.optimizer_state()`)."""
    trainer = Trainer(model, options, optimizer_state, wsla=options.WSLA,
                      trace_capacity=reads_apart(options, len(windows)))
    loop = TrainingLoop(trainer, windows, options, val_batches=val_batches, listener=listener, state=state)
    loop.run()
    return loop
