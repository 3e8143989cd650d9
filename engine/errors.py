"""Exception types shared by the engine and the command line.

`MemengineError` is a *user* error: bad input, a bad flag, a missing file, no GPU. The
command line shows it as one line and exits with `exit_code` (2 unless set otherwise).
Anything else escaping the engine is an internal error (exit 1).
"""

from __future__ import annotations


class MemengineError(Exception):
    """A problem with the user's input or environment, shown as one line."""

    exit_code = 2

    def __init__(self, message: str, *, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class NoAdapterError(MemengineError):
    """No WebGPU adapter matched the request."""


class NonFiniteError(MemengineError):
    """Training produced a non-finite loss; nothing is written."""

    exit_code = 1


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped a run; `message` says what was kept."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message
