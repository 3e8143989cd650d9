"""The `memengine` command line.  `main` is the console script: it routes Ctrl-C and
SIGTERM to one `error:` line (exit 130 / 143) from the first instant, before the modules
load (a second or more on a cold start), then runs the Typer app of cli/main.py."""

from __future__ import annotations

import sys


def main() -> None:
    from memengine.engine import interrupts  # the standard library only: loads at once

    interrupts.install()
    try:
        from .main import app
    except KeyboardInterrupt:
        sys.stderr.write(f"error: {interrupts.signal_name()} while starting; nothing was written\n")
        sys.exit(interrupts.signal_exit_code())
    try:
        app(prog_name="memengine")
    finally:
        interrupts.exiting()
