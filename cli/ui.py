"""Human output for the command line: the only module that imports rich.

Everything a person reads goes to stderr.  stdout is reserved for machine output
(`--json`): one JSON object per line and nothing else.  The engine never prints; it calls
back (engine/listener.py) and `RunView` renders.

On a terminal the epoch table is live (it grows a row per epoch, with a progress bar
under it while an epoch runs).  When stderr is not a terminal there is no colour, no
cursor movement and no progress bar: each epoch, evaluation and checkpoint is one plain
line as it happens, and a progress line appears whenever nothing was printed for 30 s.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import threading
import time
from typing import Any, Iterable, Sequence

from memengine.engine.listener import Listener
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text


def _fmt(v: Any, digits: int = 4) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        if v != 0 and (abs(v) >= 1e6 or abs(v) < 1e-3):
            return f"{v:.{digits}e}"
        return f"{v:.{digits}f}"
    if v is None:
        return "-"
    return str(v)


def _json_default(o):
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except Exception:  # pragma: no cover
        pass
    if hasattr(o, "__fspath__"):
        return os.fspath(o)
    return str(o)


def _json_float(v):
    """JSON has no NaN/Infinity: non-finite floats become null."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _json_float(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_float(x) for x in v]
    return v


def _size(n: float, unit: str) -> str:
    if unit == "bytes":
        for u, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if n >= k:
                return f"{n / k:.1f} {u}"
        return f"{n:.0f} B"
    return f"{n:,.0f}{' ' + unit if unit else ''}"


def duration(s: float) -> str:
    """12s, 3m05s, 2h07m."""
    s = max(0.0, float(s))
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def eta(done: float, total: float | None, elapsed: float) -> str | None:
    """The time left at the rate so far (None before anything is done)."""
    if not total or done <= 0 or elapsed <= 0:
        return None
    return duration(elapsed * (total - done) / done)


def task_text(t) -> str:
    """One line of an operation's progress: 'tokenizing d.txt  1.2 GB of 3.2 GB (37%), 40.1 MB/s, ETA 50s'."""
    rate = t.done / t.elapsed_s if t.elapsed_s > 0 else 0.0
    if not t.total and not t.done:
        return t.name
    if t.total:
        text = f"{t.name}  {_size(t.done, t.unit)} of {_size(t.total, t.unit)} ({100 * t.done / t.total:.0f}%)"
    else:
        text = f"{t.name}  {_size(t.done, t.unit)}"
    if rate > 0:
        text += f", {_size(rate, t.unit)}/s"
    left = eta(t.done, t.total, t.elapsed_s)
    if left is not None and not t.finished:
        text += f", ETA {left}"
    return text


class TaskView:
    """Operations outside the training loop (engine/listener.py `Task`): on a terminal a
    transient bar; otherwise a line once one has run for `SHOW_AFTER` seconds, then one
    every `ui.progress_interval`; and a closing line for one that took that long."""

    SHOW_AFTER = 2.0

    def __init__(self, ui: "UI"):
        self.ui = ui
        self.progress: Progress | None = None
        self.bars: dict = {}
        self.shown: dict = {}
        self.latest: dict = {}
        self.timers: dict = {}

    def _late(self, name: str) -> None:
        """A task still running SHOW_AFTER seconds after it started gets its line."""
        t, seen = self.latest.get(name, (None, 0.0))
        if t is not None and name not in self.shown:
            # the last report's figures, aged to now (a slow first item: no rate of the instant it began)
            t = dataclasses.replace(t, elapsed_s=t.elapsed_s + time.monotonic() - seen)
            self.shown[name] = time.monotonic()
            try:
                self.ui.note("  " + task_text(t) + ("" if t.total or t.done else " ..."))
            except (ValueError, OSError):  # stderr closed meanwhile (the command is over)
                pass

    def __call__(self, t) -> None:
        ui = self.ui
        if ui.quiet:
            return
        self.latest[t.name] = (t, time.monotonic())
        if not ui.tty and not t.finished and t.name not in self.timers:
            timer = self.timers[t.name] = threading.Timer(self.SHOW_AFTER, self._late, (t.name,))
            timer.daemon = True
            timer.start()
        if t.finished:
            timer = self.timers.pop(t.name, None)
            if timer is not None:
                timer.cancel()
            self.latest.pop(t.name, None)
            self._close(t)
            if t.elapsed_s >= self.SHOW_AFTER:
                done = f"{_size(t.done, t.unit)} " if t.done else ""
                ui.note(f"  {t.name}: {done}in {duration(t.elapsed_s)}")
            return
        if ui.tty:
            if self.progress is None:
                self.progress = Progress(TextColumn("  {task.description}"), BarColumn(),
                                         TextColumn("{task.fields[detail]}"), console=ui.console, transient=True)
                self.progress.__enter__()
            bar = self.bars.get(t.name)
            detail = task_text(t)[len(t.name):].strip()
            if bar is None:
                bar = self.bars[t.name] = self.progress.add_task(t.name, total=t.total, detail=detail)
            self.progress.update(bar, completed=t.done, total=t.total, detail=detail)
            return
        last = self.shown.get(t.name)
        now = time.monotonic()
        if (last is None and t.elapsed_s >= self.SHOW_AFTER) or (last is not None and now - last >= ui.progress_interval):
            self.shown[t.name] = now
            ui.note("  " + task_text(t))

    def _close(self, t) -> None:
        self.shown.pop(t.name, None)
        bar = self.bars.pop(t.name, None)
        if bar is not None and self.progress is not None:
            self.progress.remove_task(bar)
        if not self.bars and self.progress is not None:
            self.progress.__exit__(None, None, None)
            self.progress = None

    def close(self) -> None:
        for timer in self.timers.values():
            timer.cancel()
        self.timers.clear()
        self.bars.clear()
        if self.progress is not None:
            self.progress.__exit__(None, None, None)
            self.progress = None


class RunView(Listener):
    """Renders a training run from the engine's callbacks (engine/listener.py).

    On a terminal: a live table with a row per epoch (loss, grad norm, validation loss,
    tokens/s, elapsed) and a progress bar under it.  Otherwise: one plain line per epoch,
    evaluation and checkpoint, and a progress line whenever nothing was printed for
    `ui.progress_interval` seconds (30), from a timer thread, so a log shows signs of life
    even while one long step or evaluation runs.  Every event also goes to --json.
    """

    COLUMNS = ("epoch", "loss", "grad norm", "val loss", "tokens/s", "elapsed")
    VAL = 3  # the validation column, shown when the run evaluates held-out data

    def __init__(self, ui: "UI"):
        self.ui = ui
        self.rows: list[tuple[str, ...]] = []
        self.live: Live | None = None
        self.progress: Progress | None = None
        self.task = None
        self.plan = None
        self.title = ""
        self.total_epochs = None
        self.last_eval: dict | None = None
        self._val: bool | None = None
        self.status = ""               # what the progress line says now
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._eval_bars: dict = {}
        self._eval_t0: dict = {}      # phase -> when its pass began (its ETA)
        self._eval_shown: set = set()  # phases whose pass has had its first log line

    # -- rendering
    def _shown(self, row) -> tuple:
        val = self._val is not False
        return tuple(v for i, v in enumerate(row) if val or i != self.VAL)

    def _table(self) -> Table:
        t = Table(title=self.title, title_justify="left", box=None, show_edge=False,
                  header_style="bold" if self.ui.tty else "")
        for c in self._shown(self.COLUMNS):
            t.add_column(c, justify="right")
        for r in self.rows:
            t.add_row(*self._shown(r))
        return t

    def _renderable(self):
        if self.progress is not None and self.task is not None:
            return Group(self._table(), self.progress)
        return self._table()

    def _line(self, text: str) -> None:
        if not self.ui.quiet:
            self.ui.console.print(text, highlight=False)
            self.ui.last_print = time.monotonic()

    def _heartbeat(self) -> None:
        interval = self.ui.progress_interval
        while not self._stop.wait(min(interval, 1.0) if interval > 1 else interval):
            if time.monotonic() - self.ui.last_print >= interval and self.status:
                self._line(f"  {self.status}  elapsed {time.monotonic() - self.started:.0f}s")

    def _beat(self) -> None:
        """Start the progress-line timer (stderr not a terminal), once."""
        if self._thread is None and not self.ui.tty and not self.ui.quiet and not self._stop.is_set():
            self._thread = threading.Thread(target=self._heartbeat, name="memengine-progress", daemon=True)
            self._thread.start()

    # -- engine callbacks
    def on_note(self, message: str) -> None:
        self._beat()
        self.ui.note(message)

    def on_device(self, description: str) -> None:
        if self.ui.device_shown != description:  # once per command (the demo runs several)
            self.ui.device_shown = description
            self.on_note(f"adapter: {description}")

    def on_warning(self, message: str) -> None:
        self.ui.warn(message)

    def on_task(self, task) -> None:
        self._beat()
        if not task.finished:
            self.status = task_text(task)
        self.ui.on_task(task)

    def on_start(self, plan) -> None:
        self._close_eval_bars()
        self.ui.tasks.close()
        self.plan = plan
        self._val = plan.val_windows > 0
        self.title = plan.title
        self.total_epochs = plan.epochs
        self.started = time.monotonic()
        if self.ui.quiet:
            return
        self._beat()
        if self.ui.tty:
            self.progress = Progress(
                TextColumn("  {task.description}"), BarColumn(),
                # the epoch's count and time beside the bar where they fit (the status line has
                # the step and both ETAs: on 80 columns they were cut to '14/… 0:00…')
                *((MofNCompleteColumn(), TimeElapsedColumn()) if self.ui.console.width >= 100 else ()),
                console=self.ui.console, transient=True,
            )
            self.live = Live(self._renderable(), console=self.ui.console, refresh_per_second=8,
                             transient=False, redirect_stdout=False, redirect_stderr=False)
            self.live.__enter__()
        else:
            self._line(self.title)

    def _bar(self, description: str, done: int, total: int) -> None:
        if self.live is None or self.progress is None or total < 2:
            return
        if self.task is None:
            self.task = self.progress.add_task(description, total=total)
        self.progress.update(self.task, description=description, completed=done, total=total)
        self.live.update(self._renderable())

    def on_progress(self, p) -> None:
        loss = "" if p.last_loss is None else f"  loss {_fmt(float(p.last_loss))}"
        speed = self.speed(p)
        self.status = f"step {p.step}/{p.total_steps}  epoch {p.epoch}{loss}  lr {p.lr:.3g}{speed}"
        self._bar(f"step {p.step}/{p.total_steps}{loss}{speed}", p.step_in_epoch, p.steps_per_epoch)

    def speed(self, p) -> str:
        """'  1,234 tokens/s  ETA epoch 1m05s, run 12m30s' (this invocation's rate so far)."""
        first = self.plan.first_step if self.plan is not None else 0
        done = p.step - first
        if done <= 0 or p.elapsed_s <= 0:
            return ""
        per_step = p.elapsed_s / done
        text = f"  {p.tokens / p.elapsed_s:,.0f} tokens/s" if p.tokens else ""
        left_epoch = max(0, p.steps_per_epoch - p.step_in_epoch)
        left_run = max(0, p.total_steps - p.step)
        if left_run:
            text += f"  ETA epoch {duration(per_step * min(left_epoch, left_run))}, run {duration(per_step * left_run)}"
        return text

    def on_step(self, event: dict) -> None:
        self.ui.emit(event)

    def on_eval_progress(self, phase: str, done: int, total: int) -> None:
        self._beat()
        now = time.monotonic()
        if done <= 1 or phase not in self._eval_t0:
            self._eval_t0[phase] = now
            self._eval_shown.discard(phase)
        left = eta(done, total, now - self._eval_t0[phase])
        self.status = f"evaluating ({phase}) {done}/{total}" + (f", ETA {left}" if left and done < total else "")
        if (not self.ui.tty and self.plan is None and phase not in self._eval_shown and done < total
                and now - self._eval_t0[phase] >= TaskView.SHOW_AFTER):
            self._eval_shown.add(phase)   # a log's first line once the pass has run a while (then every interval)
            self._line("  " + self.status)
        if self.plan is None or self.live is None:
            if self.ui.tty and not self.ui.quiet:  # before training: a bar of its own
                bar = self._eval_bars.get(phase)
                if bar is None:
                    self._close_eval_bars()
                    bar = self._eval_bars[phase] = _EvalProgress(self.ui, phase).__enter__()
                bar(done, total)
            return
        self._bar(f"eval ({phase})", done, total)

    def _close_eval_bars(self) -> None:
        for b in self._eval_bars.values():
            b.__exit__(None, None, None)
        self._eval_bars.clear()

    def on_eval(self, event: dict) -> None:
        self.last_eval = event
        self.ui.emit(event)
        if self.task is not None and self.progress is not None:
            self.progress.remove_task(self.task)
            self.task = None
        self._line(f"  eval at step {event['step']}  val loss {_fmt(float(event['val_loss']))}  "
                   f"perplexity {_fmt(float(event['val_perplexity']))}  "
                   f"top-1 {_fmt(float(event['val_top1_accuracy']))}  "
                   f"top-5 {_fmt(float(event['val_top5_accuracy']))}")

    def on_epoch(self, ev: dict) -> None:
        self.ui.emit(ev)
        total = f"/{self.total_epochs}" if self.total_epochs else ""
        val = "-"
        if self.last_eval is not None and self.last_eval["step"] == ev["step"]:
            val = _fmt(float(self.last_eval["val_loss"]))
        row = (f"{ev['epoch']}{total}", _fmt(float(ev["loss"])), _fmt(float(ev["grad_norm"])), val,
               f"{float(ev['tokens_per_s']):,.0f}", f"{float(ev['elapsed_s']):.1f}s")
        self.rows.append(row)
        if self.task is not None and self.progress is not None:
            self.progress.remove_task(self.task)
            self.task = None
        if self.ui.quiet:
            return
        if self.live is not None:
            self.live.update(self._renderable(), refresh=True)
        else:
            self._line("  " + "  ".join(f"{c} {v}" for c, v in zip(self._shown(self.COLUMNS), self._shown(row))))

    def on_checkpoint(self, event: dict) -> None:
        self.ui.emit(event)
        self._line(f"  saved checkpoint {event['path']} (step {event['step']})")

    def on_finish(self) -> None:
        """The training loop ended: the table stops being live."""
        self._close_eval_bars()
        if self.live is not None:
            if self.task is not None and self.progress is not None:
                self.progress.remove_task(self.task)
                self.task = None
            self.live.update(self._table(), refresh=True)
            self.live.__exit__(None, None, None)
            self.live = None
        self.plan = None
        self.status = ""

    def close(self) -> None:
        """The command is done with the view: stop the progress-line timer, close displays."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self.on_finish()

    def __enter__(self) -> "RunView":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False


class UI:
    """Receives engine callbacks and renders them; writes JSON lines when asked."""

    def __init__(self, *, json_mode: bool = False, quiet: bool = False, verbose: bool = False,
                 stdout=None, stderr=None, progress_interval: float = 30.0):
        self.json_mode = json_mode
        self.progress_interval = progress_interval
        self.last_print = time.monotonic()
        self.device_shown: str | None = None
        self.quiet = quiet
        self.verbose = verbose
        self.stdout = stdout if stdout is not None else sys.stdout
        err = stderr if stderr is not None else sys.stderr
        tty = False
        try:
            tty = bool(err.isatty())
        except Exception:
            tty = False
        no_color = bool(os.environ.get("NO_COLOR")) or not tty
        self.tty = tty
        self.console = Console(file=err, force_terminal=tty, no_color=no_color,
                               highlight=tty, soft_wrap=not tty,
                               width=None if tty else 200)
        # a command's result (info's report, eval's figures, quantize's table) goes to stdout,
        # so `memengine info m | grep parameters` finds it; with --json stdout is JSON only
        out_tty = False
        try:
            out_tty = bool(self.stdout.isatty())
        except Exception:
            out_tty = False
        self.tasks = TaskView(self)
        self.result_console = self.console if json_mode else Console(
            file=self.stdout, force_terminal=out_tty, no_color=bool(os.environ.get("NO_COLOR")) or not out_tty,
            highlight=out_tty, soft_wrap=not out_tty, width=None if out_tty else 200)

    def on_task(self, task) -> None:
        """An operation's progress (engine/listener.py Task): a bar or lines (TaskView)."""
        self.tasks(task)

    # -- machine output
    def emit(self, obj: dict) -> None:
        """One JSON object on one stdout line (only in --json mode)."""
        if not self.json_mode:
            return
        self.stdout.write(json.dumps(_json_float(obj), default=_json_default) + "\n")
        self.stdout.flush()

    # -- human output
    def print(self, *msg, **kw) -> None:
        if not self.quiet:
            self.console.print(*msg, **kw)

    def note(self, msg: str) -> None:
        if not self.quiet:
            self.console.print(msg, highlight=False)
            self.last_print = time.monotonic()

    def step(self, msg: str) -> None:
        """A heading for one stage of a longer command (the demo)."""
        if not self.quiet:
            self.console.print()
            self.console.print(Text(msg, style="bold cyan" if self.tty else ""))

    def debug(self, msg: str) -> None:
        """A detail shown with --verbose only (export's tensor by tensor)."""
        if self.verbose and not self.quiet:
            self.console.print(Text(msg, style="dim" if self.tty else ""))

    def warn(self, msg: str) -> None:
        if not self.quiet:
            self.console.print(Text("warning: " + msg, style="yellow" if self.tty else ""))

    def error(self, msg: str, hint: str | None = None) -> None:
        """One line on stderr (shown even with --quiet)."""
        line = "error: " + " ".join(str(msg).split("\n")).strip()
        if hint:
            line += f" {hint}"
        self.console.print(Text(line, style="bold red" if self.tty else ""), soft_wrap=True)

    def kv(self, title: str, rows: Iterable[tuple[str, Any]], result: bool = False) -> None:
        """A two-column key/value table (`result`: the command's result, on stdout)."""
        if self.quiet:
            return
        t = Table(title=title, title_justify="left", show_header=False, show_edge=False, box=None,
                  pad_edge=False)
        t.add_column("key", style="bold" if self.tty else "")
        t.add_column("value")
        for k, v in rows:
            t.add_row(str(k), _fmt(v))
        (self.result_console if result else self.console).print(t)

    def table(self, title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]],
              right: Sequence[bool] | None = None, result: bool = False) -> None:
        """A table (`result`: the command's result, on stdout)."""
        if self.quiet:
            return
        t = Table(title=title, title_justify="left", show_edge=False,
                  header_style="bold" if self.tty else "")
        for i, c in enumerate(columns):
            t.add_column(str(c), justify="right" if (right and right[i]) else "left")
        for r in rows:
            t.add_row(*[_fmt(v) for v in r])
        (self.result_console if result else self.console).print(t)

    def run_view(self) -> RunView:
        return RunView(self)


class _EvalProgress:
    def __init__(self, ui: UI, title: str):
        self.ui = ui
        self.title = title
        self.progress: Progress | None = None
        self.task = None

    def __enter__(self):
        if not self.ui.quiet and self.ui.tty:
            self.progress = Progress(TextColumn(f"  {self.title}"), BarColumn(), MofNCompleteColumn(),
                                     console=self.ui.console, transient=True)
            self.progress.__enter__()
        return self

    def __call__(self, step: int, total: int) -> None:
        if self.progress is None:
            return
        if self.task is None:
            self.task = self.progress.add_task(self.title, total=total)
        self.progress.update(self.task, completed=step, total=total)

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.__exit__(*exc)
            self.progress = None
        return False
