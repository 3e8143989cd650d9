"""The `memengine` command line.  `main` is the console script: it routes Ctrl-C and
SIGTERM to one `error:` line (exit 130 / 143) from the first instant, before the modules
load (a second or more on a cold start), then runs the Typer app of cli/main.py."""

from __future__ import annotations

import os as _os
import sys

import _signal


def _early_exit(signum, frame):  # pragma: no cover - timing: a signal in the first milliseconds
    what = "terminated (SIGTERM)" if signum == _signal.SIGTERM else "interrupted"
    _os.write(2, f"error: {what} while starting; nothing was written\n".encode())
    _os._exit(128 + signum)


# The console script (or `python -m memengine.cli...`) imports this package first: from here
# on, until `main` installs the real handling, a signal is one line and its status, not a
# traceback from whatever module is loading.  Imported by anything else (tests, a library
# user), the process's signal handling is left alone.
if _os.path.basename(sys.argv[0] if sys.argv else "") in ("memengine", "-m") and \
        _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
    for _sig in (_signal.SIGINT, _signal.SIGTERM):
        _signal.signal(_sig, _early_exit)


def main() -> None:
    try:
        from memengine.engine import interrupts  # the standard library only: loads at once
    except KeyboardInterrupt:  # a signal before even the handler could be installed
        sys.stderr.write("error: interrupted while starting; nothing was written\n")
        sys.exit(130)

    interrupts.install()
    try:
        when = " while starting"
        try:
            from .main import app

            when = ""
            app(prog_name="memengine")  # exits through SystemExit with the command's status
        except KeyboardInterrupt:  # outside a command's guard: while loading or building the commands
            interrupts.exiting()
            sys.stderr.write(f"error: {interrupts.signal_name()}{when}; {interrupts.outcome()}\n")
            sys.exit(interrupts.signal_exit_code())
    finally:
        interrupts.exiting()
        # A KeyboardInterrupt that once left code run by exec/compile (dataclasses, typing)
        # leaves CPython's "unhandled KeyboardInterrupt" flag set even when it was caught, and
        # the interpreter would then end by killing itself with SIGINT; running code this way
        # clears the flag, so the exit status is the command's.
        exec("pass", {})
