"""Curves of a run: `loss.png` (training and validation loss, learning rate and gradient
norm against the step) written into each checkpoint and into OUT, `memengine plot OUT
[OUT2 ...]` for one or several runs, and `--report-to tensorboard` (TensorBoard event files
in OUT/runs/, through tensorboardX).  matplotlib (the `plot` extra) and tensorboardX (the
`tensorboard` extra) are optional: without matplotlib a run writes no loss.png.

The history is the run's events (engine/listener.py): OUT/memengine.json's "history", or a
checkpoint's trainer_state.json "loop.history".
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from memengine.engine.errors import MemengineError
from memengine.engine.io.inputs import read_json
from memengine.engine.listener import Listener

PNG_FILE = "loss.png"
SIZE = (960, 720)        # pixels of loss.png
DPI = 100
RUNS_DIR = "runs"        # TensorBoard's logging directory in OUT (HF Trainer's; staging.EVENTS_DIR)
MAX_HISTORY_BYTES = 256 << 20


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def history_of(run: Path) -> list:
    """The events of a run directory (OUT) or one of its checkpoints."""
    run = Path(run)
    rec, state = run / "memengine.json", run / "trainer_state.json"
    if rec.is_file():
        h = read_json(rec, "run record", MAX_HISTORY_BYTES).get("history")
    elif state.is_file():
        h = (read_json(state, "trainer state", MAX_HISTORY_BYTES).get("loop") or {}).get("history")
    else:
        raise MemengineError(f"{run}: no memengine.json or trainer_state.json (not a memengine run or checkpoint)")
    if not isinstance(h, list):
        raise MemengineError(f"{run}: its history is not a list of events")
    return [e for e in h if isinstance(e, dict)]


def _series(history: list, event: str, key: str) -> tuple[list, list]:
    xs, ys = [], []
    for e in history:
        if e.get("event") == event and isinstance(e.get("step"), (int, float)) and isinstance(e.get(key), (int, float)):
            xs.append(e["step"])
            ys.append(e[key])
    return xs, ys


def plot(runs: list, path: Path, title: Optional[str] = None) -> Path:
    """Draw [(label, history)] into the PNG `path` (SIZE pixels)."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        from matplotlib.figure import Figure
    except ImportError:
        raise MemengineError("drawing loss.png needs matplotlib: pip install 'memengine[plot]'") from None
    fig = Figure(figsize=(SIZE[0] / DPI, SIZE[1] / DPI), dpi=DPI)
    ax_loss = fig.add_subplot(2, 1, 1)
    ax_lr = fig.add_subplot(2, 2, 3)
    ax_gn = fig.add_subplot(2, 2, 4)
    colors = [f"C{i}" for i in range(10)]
    for i, (label, h) in enumerate(runs):
        c = colors[i % len(colors)]
        xs, ys = _series(h, "step", "loss")
        kind = "step"
        if not xs:
            xs, ys = _series(h, "epoch", "loss")
            kind = "epoch"
        name = f"{label}: " if len(runs) > 1 else ""
        if xs:
            ax_loss.plot(xs, ys, color=c, label=f"{name}train loss" + (" (epoch means)" if kind == "epoch" else ""))
        vx, vy = _series(h, "eval", "val_loss")
        if vx:
            ax_loss.plot(vx, vy, color=c, linestyle="--", marker="o", markersize=3, label=f"{name}validation loss")
        ax_lr.plot(*_series(h, kind, "lr") if kind == "step" else ([], []), color=c)
        ax_gn.plot(*_series(h, kind, "grad_norm"), color=c)
    ax_loss.set_ylabel("loss (nats)")
    ax_loss.set_xlabel("step")
    if ax_loss.get_legend_handles_labels()[0]:
        ax_loss.legend(loc="upper right", fontsize=8)
    ax_lr.set_xlabel("step")
    ax_lr.set_ylabel("learning rate")
    ax_gn.set_xlabel("step")
    ax_gn.set_ylabel("gradient norm (pre-clip)")
    for ax in (ax_loss, ax_lr, ax_gn):
        ax.grid(True, alpha=0.3)
    fig.suptitle(title or ", ".join(label for label, _ in runs), fontsize=10)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, format="png", dpi=DPI, metadata={"Software": None})
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def write_png(directory: Path, history: list, title: str) -> Optional[Path]:
    """loss.png of a run into `directory` (a checkpoint being written, or OUT's staging);
    nothing without matplotlib or without a step yet."""
    if not have_matplotlib() or not any(e.get("event") in ("step", "epoch") for e in history):
        return None
    return plot([(title, history)], Path(directory) / PNG_FILE, title=title)


class TensorBoard:
    """Step, evaluation and epoch events as TensorBoard scalars (tensorboardX's writer)."""

    def __init__(self, logdir: Path):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise MemengineError("--report-to tensorboard needs tensorboardX: pip install 'memengine[tensorboard]'") \
                from None
        self.logdir = Path(logdir)
        self.writer = SummaryWriter(logdir=str(self.logdir))

    def event(self, ev: dict) -> None:
        step = int(ev.get("step", 0))
        kind = ev.get("event")
        if kind == "step":
            for k, tag in (("loss", "train/loss"), ("grad_norm", "train/grad_norm"), ("lr", "train/learning_rate"),
                           ("tokens_per_s", "train/tokens_per_s")):
                if isinstance(ev.get(k), (int, float)):
                    self.writer.add_scalar(tag, ev[k], step)
        elif kind == "eval":
            for k, v in ev.items():
                if k.startswith("val_") and isinstance(v, (int, float)):
                    self.writer.add_scalar(f"eval/{k[4:]}", v, step)
        elif kind == "epoch":
            for k in ("loss", "grad_norm"):
                if isinstance(ev.get(k), (int, float)):
                    self.writer.add_scalar(f"train/epoch_{k}", ev[k], step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class Reporting(Listener):
    """A listener that passes every callback on to `inner` and the run's events to the
    reporters (TensorBoard)."""

    def __init__(self, inner: Listener, reporters: list):
        self.inner = inner
        self.reporters = reporters

    def __getattribute__(self, name):
        if name.startswith("on_") and name not in ("on_step", "on_eval", "on_epoch", "on_finish"):
            return getattr(object.__getattribute__(self, "inner"), name)
        return object.__getattribute__(self, name)

    def _report(self, ev: dict) -> None:
        for r in self.reporters:
            r.event(ev)

    def on_step(self, event: dict) -> None:
        self._report(event)
        self.inner.on_step(event)

    def on_eval(self, event: dict) -> None:
        self._report(event)
        self.inner.on_eval(event)

    def on_epoch(self, event: dict) -> None:
        self._report(event)
        self.inner.on_epoch(event)

    def on_finish(self) -> None:
        for r in self.reporters:
            r.close()
        self.inner.on_finish()
