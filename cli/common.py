"""What every command shares: the error guard (one line and an exit status per failure).

Conventions (SPEC section 8):

* human output on stderr (through `cli.ui.UI`), machine output (`--json`) on stdout only;
* exit 0 ok, 1 internal error, 2 bad input or usage, 3 adapt rolled back, 130 Ctrl-C;
* a user error is one line ``error: ...`` and never a traceback (``MEMENGINE_DEBUG=1``
  prints it).

Outputs are written by the engine (engine/staging.py); signals are routed by
engine/interrupts.py, installed here for the duration of a command.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from typing import Iterator

import typer

from memengine.engine import interrupts
from memengine.engine.errors import MemengineError

from .ui import UI

DEBUG_HINT = "(set MEMENGINE_DEBUG=1 for the traceback)"
EXIT_ROLLED_BACK = 3
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141


def debug_enabled() -> bool:
    return os.environ.get("MEMENGINE_DEBUG", "").strip() not in ("", "0", "false", "no")


def _is_input_oserror(e: BaseException) -> bool:
    return isinstance(e, (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError))


@contextlib.contextmanager
def guard(ui: UI, stdout_pure: bool = True) -> Iterator[None]:
    """Run a command body: map exceptions to one line and an exit status.

    While the body runs, Python-level writes to sys.stdout go to stderr, so only the UI's
    JSON lines reach stdout; SIGINT and SIGTERM unwind like Ctrl-C.
    """
    redirect = contextlib.redirect_stdout(sys.stderr) if stdout_pure else contextlib.nullcontext()
    try:
        with interrupts.handling(), redirect:
            yield
    except (typer.Exit, typer.Abort, SystemExit):
        raise
    except KeyboardInterrupt as e:
        ui.error(getattr(e, "message", None) or "interrupted; nothing was written")
        raise typer.Exit(EXIT_INTERRUPTED)
    except BrokenPipeError:
        # The reader of stdout went away (`... --json | head -1`): stop quietly, like
        # any Unix filter killed by SIGPIPE, and keep Python's exit-time flush silent.
        with contextlib.suppress(Exception):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, ui.stdout.fileno())
        raise typer.Exit(EXIT_BROKEN_PIPE)
    except MemengineError as e:
        if debug_enabled():
            traceback.print_exc(file=sys.stderr)
        ui.error(str(e) or type(e).__name__, None if debug_enabled() else DEBUG_HINT)
        raise typer.Exit(int(getattr(e, "exit_code", 2)))
    except UnicodeDecodeError as e:
        if debug_enabled():
            traceback.print_exc(file=sys.stderr)
        ui.error(f"input is not valid UTF-8 text ({e.reason} at byte {e.start})",
                 None if debug_enabled() else DEBUG_HINT)
        raise typer.Exit(2)
    except OSError as e:
        if debug_enabled():
            traceback.print_exc(file=sys.stderr)
        where = f": {e.filename}" if getattr(e, "filename", None) else ""
        msg = f"{e.strerror or e}{where}"
        ui.error(msg, None if debug_enabled() else DEBUG_HINT)
        raise typer.Exit(2 if _is_input_oserror(e) else 1)
    except Exception as e:  # internal error
        if debug_enabled():
            traceback.print_exc(file=sys.stderr)
        text = " ".join(str(e).split()) or "no message"
        if len(text) > 400:
            text = text[:400] + "..."
        ui.error(f"internal error: {type(e).__name__}: {text}", None if debug_enabled() else DEBUG_HINT)
        raise typer.Exit(1)


def engine_version() -> str:
    from memengine.engine import __version__

    return __version__
