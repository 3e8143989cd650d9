"""What every command shares: the error guard (one line and an exit status per failure).

Conventions (SPEC section 8):

* a command's result (info's report, eval's figures, quantize's table) on stdout, progress
  and notes on stderr (through `cli.ui.UI`); with `--json`, stdout holds the JSON lines only;
* exit 0 ok, 1 internal error, 2 bad input or usage, 3 adapt rolled back, 130 Ctrl-C;
* a user error is one line ``error: ...`` and never a traceback; an internal error's line
  says that ``MEMENGINE_DEBUG=1`` prints its traceback.

Outputs are written by the engine (engine/staging.py); signals are routed by
engine/interrupts.py, installed here for the duration of a command.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import traceback
from typing import Iterator

import typer
from typer.core import TyperGroup, TyperOption

try:  # recent typer carries its own click; older ones use the click package
    from typer import _click
except ImportError:  # pragma: no cover - depends on the installed typer
    import click as _click

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


_REPORTED = {"interrupt": False}


def interrupt_reported() -> None:
    """A command said itself that it was interrupted: the group adds no second line."""
    _REPORTED["interrupt"] = True


class CommandGroup(TyperGroup):
    """The `memengine` group: usage errors (an unknown flag, a missing argument, a value of
    the wrong type) are one `error:` line and exit 2 like every other error, not Typer's
    panel; an interrupt outside a command's guard (while parsing) is one line too."""

    def get_command(self, ctx, name):
        """Every command takes --version too (it prints the version and exits)."""
        cmd = super().get_command(ctx, name)
        mine = next((p for p in self.params if "--version" in getattr(p, "opts", ())), None)
        if cmd is not None and mine is not None and not any("--version" in getattr(p, "opts", ()) for p in cmd.params):
            opt = copy.copy(mine)     # the group's own option (prints the version and exits),
            opt.expose_value = False  # not passed on to the command
            cmd.params.append(opt)
        return cmd

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        _REPORTED["interrupt"] = False
        ClickException = _click.exceptions.ClickException
        try:
            rv = super().main(args=args, prog_name=prog_name, complete_var=complete_var, standalone_mode=False,
                              **extra)
        except ClickException as e:
            if not standalone_mode:
                raise
            if type(e).__name__ == "NoArgsIsHelpError":  # `memengine` alone: the help was shown
                sys.exit(0)
            sys.stderr.write(f"error: {usage_message(e)}\n")
            sys.exit(2 if isinstance(e, _click.exceptions.UsageError) else (e.exit_code or 2))
        except (KeyboardInterrupt, typer.Abort):
            if not standalone_mode:
                raise
            sys.stderr.write(f"error: {interrupts.signal_name()}; nothing was written\n")
            sys.exit(interrupts.signal_exit_code())
        if not standalone_mode:
            return rv
        if rv in (130, 143):  # Typer's own KeyboardInterrupt handling says 130 whatever the signal
            if not _REPORTED["interrupt"]:
                sys.stderr.write(f"error: {interrupts.signal_name()}; nothing was written\n")
            rv = interrupts.signal_exit_code()
        sys.exit(rv if isinstance(rv, int) else 0)


def usage_message(e) -> str:
    """One line for a Click usage error, with where to look."""
    msg = " ".join(e.format_message().split())
    ctx = getattr(e, "ctx", None)
    if ctx is not None and isinstance(e, _click.exceptions.UsageError):
        msg += f" (see '{ctx.command_path} --help')"
    return msg


_display_type_rich = getattr(TyperOption, "display_type_rich", None)   # typer's rich help (recent typer)


def _no_bool_type(self, ctx):
    """--help shows no '<bool>' after an on/off flag (--json, --force, --help, ...)."""
    if getattr(self, "is_flag", False) and self.metavar is None:
        return None
    return _display_type_rich(self, ctx)


if _display_type_rich is not None:
    TyperOption.display_type_rich = _no_bool_type


@contextlib.contextmanager
def guard(ui: UI, stdout_pure: bool = True) -> Iterator[None]:
    """Run a command body: map exceptions to one line and an exit status.

    While the body runs, Python-level writes to sys.stdout go to stderr, so only the UI's
    JSON lines reach stdout; SIGINT and SIGTERM unwind like Ctrl-C.
    """
    from memengine.engine.io import staging

    redirect = contextlib.redirect_stdout(sys.stderr) if stdout_pure else contextlib.nullcontext()
    try:
        with interrupts.handling(report=ui.error, notice=ui.note), redirect:
            try:
                yield
            finally:
                staging.release_locks()  # the outputs' locks (engine/io/staging.py) end with the command
    except (typer.Exit, typer.Abort, SystemExit):
        raise
    except KeyboardInterrupt as e:
        if debug_enabled():
            traceback.print_exc(file=sys.stderr)
        ui.error(getattr(e, "message", None) or f"{interrupts.signal_name()}; {interrupts.outcome()}")
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        _REPORTED["interrupt"] = True
        raise typer.Exit(interrupts.signal_exit_code())
    except BrokenPipeError:
        # The reader of stdout went away (`... --json | head -1`): stop quietly, like
        # any Unix filter killed by SIGPIPE, and keep Python's exit-time flush silent.
        with contextlib.suppress(Exception):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, ui.stdout.fileno())
        raise typer.Exit(EXIT_BROKEN_PIPE)
    except MemengineError as e:  # the user's input or environment: the line says it all
        if debug_enabled():
            traceback.print_exc(file=sys.stderr)
        ui.error(str(e) or type(e).__name__)
        raise typer.Exit(int(getattr(e, "exit_code", 2)))
    except UnicodeDecodeError as e:
        if debug_enabled():
            traceback.print_exc(file=sys.stderr)
        ui.error(f"input is not valid UTF-8 text ({e.reason} at byte {e.start})")
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
