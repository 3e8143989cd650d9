"""Human output for the command line: the only module that imports rich.

Everything a person reads goes to stderr.  stdout is reserved for machine output
(`--json`): one JSON object per line and nothing else.  The engine never prints; it calls
back (`on_epoch`, `on_progress`) and this object renders.

On a terminal the epoch table is live (it grows a row per epoch, with a progress bar
under it while an epoch runs).  When stderr is not a terminal there is no colour, no
cursor movement and no progress bar: each epoch is printed as one plain line as it ends,
so logs and pipelines see progress as it happens.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Iterable, Sequence

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


class EpochView:
    """The per-epoch table (live on a terminal, one line per epoch otherwise)."""

    COLUMNS = ("epoch", "loss", "grad norm", "tokens/s", "elapsed")

    def __init__(self, ui: "UI", title: str, total_epochs: int | None):
        self.ui = ui
        self.title = title
        self.total = total_epochs
        self.rows: list[tuple[str, ...]] = []
        self.live: Live | None = None
        self.progress: Progress | None = None
        self.task = None
        self.shown = not ui.quiet
        self.started = time.perf_counter()

    # -- rendering
    def _table(self) -> Table:
        t = Table(title=self.title, title_justify="left", box=None if not self.ui.tty else None,
                  show_edge=False, header_style="bold" if self.ui.tty else "")
        for c in self.COLUMNS:
            t.add_column(c, justify="right")
        for r in self.rows:
            t.add_row(*r)
        return t

    def _renderable(self):
        if self.progress is not None and self.task is not None:
            return Group(self._table(), self.progress)
        return self._table()

    def __enter__(self):
        if not self.shown:
            return self
        if self.ui.tty:
            self.progress = Progress(
                TextColumn("  step"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                console=self.ui.console, transient=True,
            )
            self.live = Live(self._renderable(), console=self.ui.console, refresh_per_second=8,
                             transient=False, redirect_stdout=False, redirect_stderr=False)
            self.live.__enter__()
        else:
            self.ui.console.print(self.title)
        return self

    def __exit__(self, *exc):
        if self.live is not None:
            if self.task is not None and self.progress is not None:
                self.progress.remove_task(self.task)
                self.task = None
            self.live.update(self._table(), refresh=True)
            self.live.__exit__(*exc)
            self.live = None
        return False

    # -- engine callbacks
    def on_progress(self, step: int, total_steps: int) -> None:
        """Progress within an epoch; shown only on a terminal and for long epochs."""
        if self.live is None or self.progress is None or total_steps < 2:
            return
        if self.task is None:
            self.task = self.progress.add_task("step", total=total_steps)
        self.progress.update(self.task, completed=step, total=total_steps)
        self.live.update(self._renderable())

    def on_epoch(self, s) -> None:
        total = f"/{self.total}" if self.total else ""
        row = (f"{s.epoch}{total}", _fmt(float(s.loss)), _fmt(float(s.grad_norm)),
               f"{float(s.tokens_per_s):,.0f}", f"{float(s.elapsed_s):.1f}s")
        self.rows.append(row)
        if self.task is not None and self.progress is not None:
            self.progress.remove_task(self.task)
            self.task = None
        if not self.shown:
            return
        if self.live is not None:
            self.live.update(self._renderable(), refresh=True)
        else:
            self.ui.console.print(
                f"  epoch {row[0]}  loss {row[1]}  grad norm {row[2]}  tokens/s {row[3]}  elapsed {row[4]}",
                highlight=False,
            )


class UI:
    """Receives engine callbacks and renders them; writes JSON lines when asked."""

    def __init__(self, *, json_mode: bool = False, quiet: bool = False, verbose: bool = False,
                 stdout=None, stderr=None):
        self.json_mode = json_mode
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

    def step(self, msg: str) -> None:
        """A heading for one stage of a longer command (the demo)."""
        if not self.quiet:
            self.console.print()
            self.console.print(Text(msg, style="bold cyan" if self.tty else ""))

    def debug(self, msg: str) -> None:
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

    def kv(self, title: str, rows: Iterable[tuple[str, Any]]) -> None:
        """A two-column key/value table."""
        if self.quiet:
            return
        t = Table(title=title, title_justify="left", show_header=False, show_edge=False, box=None,
                  pad_edge=False)
        t.add_column("key", style="bold" if self.tty else "")
        t.add_column("value")
        for k, v in rows:
            t.add_row(str(k), _fmt(v))
        self.console.print(t)

    def table(self, title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]],
              right: Sequence[bool] | None = None) -> None:
        if self.quiet:
            return
        t = Table(title=title, title_justify="left", show_edge=False,
                  header_style="bold" if self.tty else "")
        for i, c in enumerate(columns):
            t.add_column(str(c), justify="right" if (right and right[i]) else "left")
        for r in rows:
            t.add_row(*[_fmt(v) for v in r])
        self.console.print(t)

    def epochs(self, title: str, total_epochs: int | None = None) -> EpochView:
        return EpochView(self, title, total_epochs)

    def status(self, msg: str):
        """A spinner on a terminal (for slow single steps such as evaluation)."""
        import contextlib

        if self.quiet:
            return contextlib.nullcontext()
        if self.tty:
            return self.console.status(msg)
        self.console.print(msg, highlight=False)
        return contextlib.nullcontext()

    def eval_progress(self, title: str):
        """A transient progress bar for an evaluation pass; returns a callback holder."""
        return _EvalProgress(self, title)


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
