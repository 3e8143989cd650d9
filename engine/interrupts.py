"""Ctrl-C and SIGTERM: the one place that decides when they take effect.

`handling()` (entered once per command) routes SIGINT and SIGTERM to a KeyboardInterrupt.
Inside GPU loops (`deferred()`) the signal is only noted and raised at the next step
boundary (`check()`, called by the loops once per step): raised at an arbitrary point it
can land inside a wgpu object's finalizer, where Python prints and swallows it and the
loop runs on.  A second signal while one is pending is raised at once.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

_STATE = {"deferred": 0, "pending": False}


def _on_signal(signum, frame):
    if _STATE["deferred"] and not _STATE["pending"]:
        _STATE["pending"] = True  # raised at the next step boundary; a second one at once
        return
    raise KeyboardInterrupt


def check() -> None:
    """Raise the KeyboardInterrupt a signal deferred (the loops call it once per step)."""
    if _STATE["pending"]:
        _STATE["pending"] = False
        raise KeyboardInterrupt


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """While inside, a signal is noted and raised by the next `check()` (or on leaving)."""
    _STATE["deferred"] += 1
    try:
        yield
    finally:
        _STATE["deferred"] -= 1
    check()


@contextlib.contextmanager
def handling() -> Iterator[None]:
    """Route SIGINT and SIGTERM to KeyboardInterrupt while inside (main thread only)."""
    old = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(Exception):
                old[sig] = signal.signal(sig, _on_signal)
    try:
        yield
    finally:
        for sig, handler in old.items():
            with contextlib.suppress(Exception):
                signal.signal(sig, handler)
        _STATE["pending"] = False
