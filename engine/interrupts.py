"""Ctrl-C and SIGTERM: the one place that decides when they take effect.

`handling()` (entered once per command) routes SIGINT and SIGTERM to a KeyboardInterrupt.
Inside GPU loops (`deferred()`) the first signal is only noted and raised at the next
`check()`: the loops call it between steps, and the GPU code between submissions
(`gpu.Recorder` submits a step in bounded pieces, and waits for the GPU in short slices),
so the run stops within a piece of a step, at any model size.  Raised at an arbitrary
point instead, a KeyboardInterrupt can land inside a wgpu object's finalizer, where Python
prints and swallows it and the loop runs on.

A second signal ends the process at once, still cleanly, even while the main thread is
stuck in a long native call (Python runs signal handlers only between bytecodes of the
main thread): a watcher thread reads the signals from a wakeup pipe, waits for an output
swap in progress to finish (`critical()`), removes the staging directories registered
with `staging_dir()`, prints one line and exits with 128 + the signal number.

`signal_exit_code()` and `outcome()` let the front end say truthfully what happened: which
signal, and whether an output was completed before it arrived (`completed()`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Iterator

_STATE = {"deferred": 0, "pending": False, "signum": 0, "count": 0, "delivered": False, "finishing": 0,
          "keeping": 0}
_LEFT: list = []                 # callables saying what a run leaves on disk now (innermost last)
_COMPLETED: list = []            # outputs written completely during this command
_STAGING: dict = {}              # staging directories in progress -> True
_LOCK_FILES: set = set()         # lock files this process holds (removed by an emergency exit)
_CRITICAL = threading.RLock()    # held while an output is swapped into place
_WATCH: dict = {"thread": None, "r": -1, "w": -1, "old_fd": None, "report": None, "notice": None}


def _on_signal(signum, frame):
    _STATE["signum"] = signum
    first = not _STATE["delivered"]
    _STATE["delivered"] = True
    if not first and _WATCH["thread"] is not None:
        return  # a second one: the watcher thread (it sees it too) ends the process at once
    if first and _STATE["deferred"]:
        _STATE["pending"] = True  # raised at the next check()
        return
    raise KeyboardInterrupt


def check() -> None:
    """Raise the KeyboardInterrupt a signal deferred (loops and GPU waits call it); inside
    `finishing()` the signal stays pending for the loop to act on at its next boundary."""
    if _STATE["pending"] and not _STATE["finishing"]:
        _STATE["pending"] = False
        raise KeyboardInterrupt


def consume() -> bool:
    """Take a pending signal (True when there was one): the caller acts on it itself."""
    was = bool(_STATE["pending"])
    _STATE["pending"] = False
    return was


@contextlib.contextmanager
def finishing() -> Iterator[None]:
    """While inside (a training step in flight), a first signal does not interrupt: it stays
    `pending()` until the loop's next step boundary, where the loop writes a checkpoint and
    stops.  A second signal still ends the process at once."""
    _STATE["finishing"] += 1
    try:
        yield
    finally:
        _STATE["finishing"] -= 1


@contextlib.contextmanager
def keeping_work() -> Iterator[None]:
    """While inside (a training loop whose first signal ends in a checkpoint), a first signal
    is announced at once (`handling`'s notice): the step in flight finishes first."""
    _STATE["keeping"] += 1
    try:
        yield
    finally:
        _STATE["keeping"] -= 1


@contextlib.contextmanager
def leaving(describe) -> Iterator[None]:
    """While inside, `describe()` says what the command leaves on disk (the emergency exit
    of a second signal, from the watcher thread, and `outcome()` ask it)."""
    _LEFT.append(describe)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            _LEFT.remove(describe)


def pending() -> bool:
    return bool(_STATE["pending"])


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """While inside, a signal is noted and raised by the next `check()` (or on leaving)."""
    _STATE["deferred"] += 1
    try:
        yield
    finally:
        _STATE["deferred"] -= 1
    check()


def signal_exit_code() -> int:
    """128 + the last signal (130 for Ctrl-C, 143 for SIGTERM); 130 when none was seen."""
    return 128 + (_STATE["signum"] or signal.SIGINT)


def signal_name() -> str:
    return "terminated (SIGTERM)" if _STATE["signum"] == signal.SIGTERM else "interrupted"


# ----------------------------------------------------------------------------- outputs
def completed(path) -> None:
    """Note that the output `path` was written completely (an interrupt after this says so)."""
    _COMPLETED.append(str(path))


def was_completed(path) -> bool:
    return os.path.abspath(str(path)) in {os.path.abspath(p) for p in _COMPLETED}


def outcome() -> str:
    """What an interrupted command leaves behind: what its run says is on disk, else what it
    completed."""
    if _LEFT:
        with contextlib.suppress(Exception):
            return str(_LEFT[-1]())
    if not _COMPLETED:
        return "nothing was written"
    return f"{_COMPLETED[-1]} had been written completely and is kept"


@contextlib.contextmanager
def staging_dir(path: Path) -> Iterator[None]:
    """Register a staging directory that an emergency exit (second signal) removes."""
    key = str(path)
    _STAGING[key] = True
    try:
        yield
    finally:
        _STAGING.pop(key, None)


def holding_lock(path, held: bool = True) -> None:
    """Note a lock file this process holds (or gave up): an emergency exit removes it."""
    (_LOCK_FILES.add if held else _LOCK_FILES.discard)(str(path))


@contextlib.contextmanager
def critical() -> Iterator[None]:
    """An output swap: a first signal takes effect after it, an emergency exit waits for
    it to finish (a few renames)."""
    with deferred():
        with _CRITICAL:
            yield


def _emergency_exit(signum: int) -> None:
    """Second signal: wait for a swap in progress, remove staging directories, exit."""
    got = _CRITICAL.acquire(timeout=10)
    try:
        for key in list(_STAGING):
            with contextlib.suppress(Exception):
                shutil.rmtree(key, ignore_errors=True)
        for path in list(_LOCK_FILES):  # still held: a run that opened it meanwhile sees it gone and retries
            with contextlib.suppress(Exception):
                os.unlink(path)
        what = "terminated (SIGTERM)" if signum == signal.SIGTERM else "interrupted"
        msg = f"{what} again: stopped at once; {outcome()}"
        # written raw: the main thread may have been stopped inside the UI's own printing (its
        # console buffer or lock in any state), and nothing is flushed after os._exit
        with contextlib.suppress(Exception):
            _write_stderr(msg)
    finally:
        os._exit(128 + signum)
        if got:  # pragma: no cover
            _CRITICAL.release()


def _write_stderr(msg: str) -> None:
    os.write(2, f"error: {msg}\n".encode())


def _watch(rfd: int) -> None:
    while True:
        try:
            data = os.read(rfd, 64)
        except OSError:
            return
        if not data:
            return
        for b in data:
            if b in (signal.SIGINT, signal.SIGTERM):
                _STATE["count"] += 1
                if _STATE["count"] >= 2:
                    _emergency_exit(int(b))
                elif _STATE["keeping"] and _WATCH["notice"] is not None:
                    what = "terminated (SIGTERM)" if b == signal.SIGTERM else "interrupted"
                    with contextlib.suppress(Exception):
                        _WATCH["notice"](f"{what}: finishing the step in flight and writing a checkpoint "
                                         "(Ctrl-C again stops at once)")


def _start_watcher() -> None:
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except (ValueError, OSError):
        os.close(r)
        os.close(w)
        return
    t = threading.Thread(target=_watch, args=(r,), name="memengine-signals", daemon=True)
    t.start()
    _WATCH.update(thread=t, r=r, w=w, old_fd=old)


def _stop_watcher() -> None:
    if _WATCH["thread"] is None:
        return
    with contextlib.suppress(Exception):
        signal.set_wakeup_fd(_WATCH["old_fd"] if _WATCH["old_fd"] is not None else -1)
    with contextlib.suppress(OSError):
        os.close(_WATCH["w"])  # the watcher reads EOF and ends
    _WATCH["thread"].join(timeout=1)
    with contextlib.suppress(OSError):
        os.close(_WATCH["r"])
    _WATCH.update(thread=None, r=-1, w=-1, old_fd=None)


def install() -> None:
    """Route SIGINT and SIGTERM to KeyboardInterrupt for good (a program's first line, so
    an interrupt while modules load is one clean exception too)."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(Exception):
                signal.signal(sig, _on_signal)


def exiting() -> None:
    """The command is over (its outputs complete or removed, its message printed): a signal
    while the process exits is ignored, so the exit status stays the command's (Python
    restores the default action, death by the signal, during its own finalization unless
    the signal is ignored)."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(Exception):
                signal.signal(sig, signal.SIG_IGN)


@contextlib.contextmanager
def handling(report=None, notice=None) -> Iterator[None]:
    """Route SIGINT and SIGTERM to KeyboardInterrupt while inside (main thread only); a
    second signal ends the process at once (see the module doc), saying so in an `error:`
    line written straight to stderr (`report` is kept for callers; the emergency line does
    not go through it: a UI stopped mid-print may never flush).  `notice(message)` hears, at
    once, that a first signal during a training step will stop the run after it."""
    old = {}
    _STATE.update(pending=False, count=0, delivered=False, finishing=0, keeping=0)
    _COMPLETED.clear()
    _LEFT.clear()
    _WATCH["report"] = report
    _WATCH["notice"] = notice
    main = threading.current_thread() is threading.main_thread()
    if main:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(Exception):
                old[sig] = signal.signal(sig, _on_signal)
        if sys.platform != "win32":
            _start_watcher()
    try:
        yield
    finally:
        if main:
            _stop_watcher()
        for sig, handler in old.items():
            with contextlib.suppress(Exception):
                # a program that called install(): the command is over (its outputs complete or
                # removed, its message printed), a signal now changes nothing
                signal.signal(sig, signal.SIG_IGN if handler is _on_signal else handler)
        _STATE["pending"] = False
