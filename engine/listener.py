"""How a run reports: the engine calls these methods, a front end (cli/ui.py) renders.

Events are plain dicts, the same objects that `--json` prints, so their keys are defined
once, where the engine builds them:

    {"event": "step", "step", "epoch", "loss", "grad_norm", "lr", "tokens", "tokens_per_s"}
    {"event": "eval", "step", "val_loss", "val_perplexity", "val_tokens", "val_bits_per_token",
     "val_top1_accuracy", "val_top5_accuracy"}
    {"event": "epoch", "epoch", "step", "loss", "grad_norm", "tokens", "tokens_per_s", "elapsed_s"}
    {"event": "checkpoint", "step", "path"}

Operations that may take a while outside the loop (hashing and tokenizing data, loading a
checkpoint, initialising or quantizing one) report through `on_task(Task)`: repeatedly
while they run (at most ten times a second, `TaskMeter`), and once with `finished`.

`step` counts optimizer steps from 1 over the whole run (resumes continue the count);
"loss" and "grad_norm" of a step event are means over the steps since the previous one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass
class Plan:
    """What a run is about to do (given to `on_start`)."""

    title: str
    total_steps: int
    steps_per_epoch: int
    epochs: int | None          # epochs the run may reach (None: bounded by steps only)
    first_step: int = 0         # steps already done (a resumed run)
    windows: int = 0
    val_windows: int = 0


@dataclass
class Progress:
    """After every optimizer step (no readback: the loss is the last one read)."""

    step: int
    total_steps: int
    epoch: int
    step_in_epoch: int
    steps_per_epoch: int
    lr: float
    last_loss: float | None
    tokens: int = 0             # input tokens trained on by this invocation so far
    elapsed_s: float = 0.0      # since this invocation's first step (evaluations and saves left out)


@dataclass
class Task:
    """An operation that may take a while: `done` of `total` (None: unknown) `unit`s
    ("bytes", "tensors")."""

    name: str
    done: float
    total: Optional[float]
    unit: str = ""
    elapsed_s: float = 0.0
    finished: bool = False


class TaskMeter:
    """Reports a Task to `callback` (a Listener's on_task, or None): `update(done)` as it
    goes (rate-limited), `finish()` at the end (also on an error: the display closes)."""

    INTERVAL = 0.1

    def __init__(self, callback: Optional[Callable], name: str, total: Optional[float], unit: str = ""):
        self.callback = callback
        self.name = name
        self.total = total
        self.unit = unit
        self.t0 = time.monotonic()
        self.last = 0.0
        self.done = 0.0
        self.closed = False
        if callback is not None:   # started: a display may show it once it has run a while
            callback(Task(name, 0, total, unit, 0.0))

    def update(self, done: float) -> None:
        self.done = done
        if self.callback is None:
            return
        now = time.monotonic()
        if now - self.last >= self.INTERVAL:
            self.last = now
            self.callback(Task(self.name, done, self.total, self.unit, now - self.t0))

    def advance(self, n: float = 1) -> None:
        self.update(self.done + n)

    def finish(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.callback is not None:
            self.callback(Task(self.name, self.done, self.total, self.unit, time.monotonic() - self.t0, True))

    def __enter__(self) -> "TaskMeter":
        return self

    def __exit__(self, *exc) -> bool:
        self.finish()
        return False


class Listener:
    """No-op base: override what you render."""

    def on_note(self, message: str) -> None:
        pass

    def on_device(self, description: str) -> None:
        """The GPU adapter (wgpu adapter) a run uses."""

    def on_warning(self, message: str) -> None:
        pass

    def on_start(self, plan: Plan) -> None:
        pass

    def on_progress(self, progress: Progress) -> None:
        pass

    def on_step(self, event: dict) -> None:
        pass

    def on_eval_progress(self, phase: str, done: int, total: int) -> None:
        """A pass over evaluation batches: phase is "val", "before", "after" or a name."""

    def on_eval(self, event: dict) -> None:
        pass

    def on_epoch(self, event: dict) -> None:
        pass

    def on_checkpoint(self, event: dict) -> None:
        pass

    def on_task(self, task: Task) -> None:
        """An operation's progress (see Task)."""

    def on_finish(self) -> None:
        """The training loop ended (normally or not); live displays of it can close."""
