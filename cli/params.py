"""Typer parameters made from the engine's option dataclasses (engine/options.py).

A command (info, eval, train, adapt) is declared with `run_command(app, Options, body)`:
its flags, help texts, defaults and panels come from the dataclass fields, plus the
flags every command shares (--json, --quiet, --verbose, and --config unless the class says
otherwise).  The flags given
explicitly (command line or environment) are told apart from defaults so that a --config
file and a resumed run can fill in the rest (`options.resolve_options`).  Validation is the
dataclass's; Typer only parses.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer
from memengine.engine.app import options as eo
from memengine.engine.train.distributed import env_world

from .common import guard
from .ui import UI

# flags of every command, not options of a run
JsonOpt = Annotated[bool, typer.Option(
    "--json", rich_help_panel=eo.OUTPUT, help="Write JSON lines to stdout (and nothing else).")]
QuietOpt = Annotated[bool, typer.Option(
    "--quiet", "-q", rich_help_panel=eo.OUTPUT, help="No human output on stderr (errors still shown).")]
VerboseOpt = Annotated[bool, typer.Option(
    "--verbose", "-v", rich_help_panel=eo.RUNTIME, help="Show driver and wgpu log output and extra detail.")]
ConfigOpt = Annotated[Optional[Path], typer.Option(
    "--config", "-c", rich_help_panel=eo.TRAINING, dir_okay=False,
    help="YAML or JSON file setting any of these options (flags given on the command line win).")]

_UI_PARAMS = {"config": (ConfigOpt, None), "json_out": (JsonOpt, False), "quiet": (QuietOpt, False),
              "verbose": (VerboseOpt, False)}


def _field(cls, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def param(cls, name: str, hint: Any = None) -> tuple[Any, Any]:
    """(Annotated type, default) of option `name` of `cls`, as a Typer parameter (`hint`:
    another type, e.g. `str` for a CKPT another command requires)."""
    f = _field(cls, name)
    s = eo.spec_of(f)
    hint = hint or cls.types()[name]
    text = s.help.format(**cls.help_values())
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    kw: dict = {"help": text, "rich_help_panel": s.panel, "show_default": s.show_default}
    if s.metavar:
        kw["metavar"] = s.metavar
    if s.envvar:
        kw["envvar"] = s.envvar
        kw["show_envvar"] = True
    if s.argument:
        kw.pop("rich_help_panel")
        info = typer.Argument(**kw)
    else:
        flags = s.flags or ("--" + name.replace("_", "-"),)
        info = typer.Option(*flags, **kw)
    if hint is list or getattr(hint, "__origin__", None) is list:
        hint = list[str]
    return Annotated[hint, info], default


def run_command(app: typer.Typer, cls, body: Callable, *, name: str, help: str, epilog: str,
                hidden: tuple = ()) -> Callable:
    """Register command `name` whose parameters are the fields of `cls` (minus `hidden`).

    `body(options, ui)` runs inside the error guard and returns an exit status (or None)."""
    names = [f.name for f in cls.option_fields() if f.name not in hidden]
    params = [inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)]
    for n in names:
        ann, default = param(cls, n)
        params.append(inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, annotation=ann, default=default))
    ui_params = {n: v for n, v in _UI_PARAMS.items() if n != "config" or cls.CONFIG_FILE}
    for n, (ann, default) in ui_params.items():
        params.append(inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, annotation=ann, default=default))

    def command(ctx: typer.Context, **kw):
        # a rank other than 0 of a multi-rank run reports nothing but its errors
        quiet_rank = env_world()[0] > 0
        ui = UI(json_mode=kw["json_out"] and not quiet_rank, quiet=kw["quiet"] or quiet_rank, verbose=kw["verbose"])
        code = None
        with guard(ui):
            explicit = {n: kw[n] for n in names if _given(ctx, n)}
            opts = eo.resolve_options(cls, explicit, kw.get("config"))
            code = body(opts, ui)
        if code:
            raise typer.Exit(code)

    command.__signature__ = inspect.Signature(params)
    command.__name__ = name.replace("-", "_")
    command.__doc__ = help
    app.command(name=name, epilog=epilog)(command)
    return command


def _given(ctx: typer.Context, name: str) -> bool:
    """Was the parameter set on the command line or by its environment variable?"""
    src = ctx.get_parameter_source(name)
    # Typer may vendor its own click, so compare the enum by name
    return src is not None and getattr(src, "name", str(src)) not in ("DEFAULT", "DEFAULT_MAP")
