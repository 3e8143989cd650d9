"""How a run reports: the engine calls these methods, a front end (cli/ui.py) renders.

Events are plain dicts, the same objects that `--json` prints, so their keys are defined
once, where the engine builds them:

    {"event": "step", "step", "epoch", "loss", "grad_norm", "lr", "tokens", "tokens_per_s"}
    {"event": "eval", "step", "val_loss", "val_perplexity", "val_tokens", "val_bits_per_token",
     "val_top1_accuracy", "val_top5_accuracy"}
    {"event": "epoch", "epoch", "step", "loss", "grad_norm", "tokens", "tokens_per_s", "elapsed_s"}
    {"event": "checkpoint", "step", "path"}

`step` counts optimizer steps from 1 over the whole run (resumes continue the count);
"loss" and "grad_norm" of a step event are means over the steps since the previous one.
"""

from __future__ import annotations

from dataclasses import dataclass


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

    def on_finish(self) -> None:
        """The training loop ended (normally or not); live displays of it can close."""
