"""Shared pieces of the command line: option types, error handling, staged outputs, loading.

Conventions (SPEC section 8):

* human output on stderr (through `cli.ui.UI`), machine output (`--json`) on stdout only;
* exit 0 ok, 1 internal error, 2 bad input or usage, 3 adapt rolled back, 130 Ctrl-C;
* a user error is one line ``error: ...`` and never a traceback (``MEMENGINE_DEBUG=1``
  prints it);
* outputs are built in a temporary directory next to OUT and renamed into place, so an
  interrupted run leaves nothing behind; OUT that exists and is not empty is refused
  unless ``--force``; the input is never modified.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Annotated, Any, Iterator, Optional

import typer

from memengine.engine.errors import MemengineError

from .ui import UI

DEBUG_HINT = "(set MEMENGINE_DEBUG=1 for the traceback)"
EXIT_ROLLED_BACK = 3
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141

# --------------------------------------------------------------------------- options
# Reusable option types.  Help panels group them in --help.
_RUN = "Runtime"
_OUT = "Output"
_TRAIN = "Training"

DeviceOpt = Annotated[Optional[str], typer.Option(
    "--device", envvar="MEMENGINE_DEVICE", show_envvar=True, rich_help_panel=_RUN,
    help="WebGPU adapter: auto, gpu, cpu, or a substring of the adapter's name.")]
VerboseOpt = Annotated[bool, typer.Option(
    "--verbose", "-v", rich_help_panel=_RUN, help="Show driver and wgpu log output and extra detail.")]
QuietOpt = Annotated[bool, typer.Option(
    "--quiet", "-q", rich_help_panel=_OUT, help="No human output on stderr (errors still shown).")]
JsonOpt = Annotated[bool, typer.Option(
    "--json", rich_help_panel=_OUT, help="Write JSON lines to stdout (and nothing else).")]
ForceOpt = Annotated[bool, typer.Option(
    "--force", "-f", rich_help_panel=_OUT, help="Replace OUT if it exists and is not empty.")]
TokenizerOpt = Annotated[Optional[str], typer.Option(
    "--tokenizer", rich_help_panel=_RUN,
    help="A tokenizer.json (or its directory) to use instead of the one beside the checkpoint; "
         "'bytes' for the built-in byte-level tokenizer (the default when there is none).")]
DataOpt = Annotated[list[str], typer.Option(
    "--data", "-d", help="UTF-8 text, .jsonl with a \"text\" field, or - for stdin (repeatable).")]
OutOpt = Annotated[Path, typer.Option("--output", "-o", help="Output checkpoint directory.")]
CkptArg = Annotated[Path, typer.Argument(
    metavar="CKPT", show_default=False,
    help="Checkpoint: a directory (config.json + model.safetensors or transformers' shards), a .safetensors "
         "file, a model.safetensors.index.json, or a Hugging Face model id (from the local cache, else "
         "downloaded; HF_HUB_OFFLINE=1 forbids downloads).")]
RevisionOpt = Annotated[Optional[str], typer.Option(
    "--revision", rich_help_panel=_RUN, metavar="REV", help="Branch, tag or commit of a model id CKPT (default: main).")]
ModelTypeOpt = Annotated[Optional[str], typer.Option(
    "--model-type", rich_help_panel=_RUN, metavar="mamba|falcon_mamba",
    help="Model type of a checkpoint whose config does not state one (a bare .safetensors): "
         "mamba (assumed) or falcon_mamba.")]
MaxShardSizeOpt = Annotated[str, typer.Option(
    "--max-shard-size", rich_help_panel=_OUT, metavar="SIZE",
    help="Write the weights as shards (model-00001-of-0000N.safetensors + model.safetensors.index.json) "
         "when they exceed this size: 5GB, 500MB or a number of bytes, as transformers' save_pretrained.")]
SeqLenOpt = Annotated[int, typer.Option(
    "--seq-len", min=1, rich_help_panel=_TRAIN, help="Tokens per window.")]
BatchOpt = Annotated[int, typer.Option(
    "--batch-size", min=1, rich_help_panel=_TRAIN, help="Windows per step.")]
EpochsOpt = Annotated[int, typer.Option("--epochs", min=1, rich_help_panel=_TRAIN, help="Passes over the data.")]
LrOpt = Annotated[float, typer.Option("--lr", rich_help_panel=_TRAIN, help="AdamW learning rate.")]
MaxGradNormOpt = Annotated[float, typer.Option(
    "--max-grad-norm", rich_help_panel=_TRAIN, help="Clip the global gradient L2 norm to this (0 = off).")]
WeightDecayOpt = Annotated[float, typer.Option(
    "--weight-decay", rich_help_panel=_TRAIN, help="Decoupled AdamW weight decay.")]
MaxDeltaOpt = Annotated[float, typer.Option(
    "--max-delta", rich_help_panel=_TRAIN, help="Trust region: clamp each element's step to +-this (0 = off).")]
Beta1Opt = Annotated[float, typer.Option("--beta1", rich_help_panel=_TRAIN, help="AdamW beta1.")]
Beta2Opt = Annotated[float, typer.Option("--beta2", rich_help_panel=_TRAIN, help="AdamW beta2.")]
EpsOpt = Annotated[float, typer.Option("--eps", rich_help_panel=_TRAIN, help="AdamW epsilon.")]
SeedOpt = Annotated[int, typer.Option("--seed", rich_help_panel=_TRAIN, help="Seed recorded with the run. Training is deterministic: windows are visited in order and nothing is sampled.")]
ConfigOpt = Annotated[Optional[Path], typer.Option(
    "--config", "-c", rich_help_panel=_TRAIN, dir_okay=False,
    help="YAML or JSON file setting any of these options (flags given on the command line win).")]

# Option names a --config file may set, for train and adapt.
TRAIN_KEYS = ("epochs", "lr", "batch_size", "seq_len", "max_grad_norm", "weight_decay",
              "max_delta", "beta1", "beta2", "eps", "seed")
FLAG_OF = {k: "--" + k.replace("_", "-") for k in TRAIN_KEYS + ("tolerance", "rollback", "device", "tokenizer")}
FLAG_OF["rollback"] = "--no-rollback"


def debug_enabled() -> bool:
    return os.environ.get("MEMENGINE_DEBUG", "").strip() not in ("", "0", "false", "no")


# --------------------------------------------------------------------------- errors
def _is_input_oserror(e: BaseException) -> bool:
    return isinstance(e, (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError))


_INTERRUPT = {"deferred": 0, "pending": False}


def _on_interrupt(signum, frame):
    if _INTERRUPT["deferred"] and not _INTERRUPT["pending"]:
        _INTERRUPT["pending"] = True  # raised at the next step boundary; a second one at once
        return
    raise KeyboardInterrupt


def check_interrupt() -> None:
    """Raise the KeyboardInterrupt a signal deferred (called once per GPU step)."""
    if _INTERRUPT["pending"]:
        _INTERRUPT["pending"] = False
        raise KeyboardInterrupt


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Inside training and eval loops a Ctrl-C is noted and raised at the next step.

    Raised at an arbitrary point it can land inside a wgpu object's finalizer, where Python
    prints and swallows it and the loop runs on.
    """
    _INTERRUPT["deferred"] += 1
    try:
        yield
    finally:
        _INTERRUPT["deferred"] -= 1
    check_interrupt()


@contextlib.contextmanager
def guard(ui: UI, stdout_pure: bool = True) -> Iterator[None]:
    """Run a command body: map exceptions to one line and an exit status.

    While the body runs, Python-level writes to sys.stdout go to stderr, so only the UI's
    JSON lines reach stdout.
    """
    redirect = contextlib.redirect_stdout(sys.stderr) if stdout_pure else contextlib.nullcontext()
    old_handlers = {}
    if threading.current_thread() is threading.main_thread():
        # SIGINT and SIGTERM unwind like Ctrl-C (temp outputs are removed); inside GPU loops
        # they are deferred to the next step (see deferred_interrupts)
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(Exception):
                old_handlers[sig] = signal.signal(sig, _on_interrupt)
    try:
        with redirect:
            yield
    except (typer.Exit, typer.Abort, SystemExit):
        raise
    except KeyboardInterrupt:
        ui.error("interrupted; nothing was written")
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
    finally:
        for sig, old in old_handlers.items():
            with contextlib.suppress(Exception):
                signal.signal(sig, old)
        _INTERRUPT["pending"] = False


# --------------------------------------------------------------------------- outputs
def check_output(out: Path, force: bool, inputs: tuple[Path, ...] = ()) -> Path:
    """Refuse OUT that would overwrite something (before any expensive work)."""
    out = Path(out)
    if str(out) in ("", "-"):
        raise MemengineError("--output must be a directory path")
    if out.exists() and not out.is_dir():
        raise MemengineError(f"--output {out}: exists and is not a directory")
    ro = out.resolve()
    for p in inputs:
        if p is None:
            continue
        rp = Path(p).resolve()
        rp_dir = rp if rp.is_dir() else rp.parent
        if ro == rp_dir or ro in rp.parents:
            raise MemengineError(f"--output {out}: would overwrite the input {p}; choose another directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise MemengineError(f"--output {out}: directory exists and is not empty (use --force to replace it)")
    return out


@contextlib.contextmanager
def staged_output(out: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary directory beside OUT; on success rename it into place.

    On any exception (Ctrl-C included) the temporary directory is removed and OUT is
    left as it was.
    """
    out = Path(out)
    parent = out.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755 & ~_umask())
        if out.exists():
            if out.is_dir() and any(out.iterdir()) and not force:
                raise MemengineError(f"--output {out}: directory exists and is not empty (use --force to replace it)")
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=parent))
            old.rmdir()
            os.rename(out, old)
            try:
                os.rename(tmp, out)
            except BaseException:
                os.rename(old, out)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def write_json(path: Path, obj: Any) -> None:
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False, default=str)
        f.write("\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------- --config
def load_option_file(path: Path) -> dict:
    """Read a YAML/JSON mapping of option names (dashes or underscores)."""
    p = Path(path)
    if not p.is_file():
        raise MemengineError(f"--config {p}: file not found")
    text = p.read_text(encoding="utf-8")
    try:
        if p.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MemengineError(f"--config {p}: cannot parse ({first})") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise MemengineError(f"--config {p}: expected a mapping of option names to values")
    return {str(k).strip().lstrip("-").replace("-", "_"): v for k, v in data.items()}


def resolve_options(ctx: typer.Context, values: dict, config_path: Optional[Path],
                    allowed: tuple[str, ...]) -> dict:
    """Merge a --config file under the command-line values.

    A value from the file applies only where the flag was not given explicitly
    (click's parameter source is DEFAULT); flags and environment variables win.
    """
    resolved = dict(values)
    if config_path is None:
        return resolved
    data = load_option_file(config_path)
    for key, val in data.items():
        if key not in allowed:
            raise MemengineError(
                f"--config {config_path}: unknown option '{key}' (known: {', '.join(allowed)})")
        # Typer may vendor its own click, so compare the enum by name.
        src = ctx.get_parameter_source(key)
        if src is not None and getattr(src, "name", str(src)) not in ("DEFAULT", "DEFAULT_MAP"):
            continue
        default = values.get(key)
        try:
            if isinstance(default, bool):
                if not isinstance(val, bool):
                    raise ValueError(f"expected true/false, got {val!r}")
                conv = val
            elif isinstance(default, int):
                if isinstance(val, bool) or (isinstance(val, float) and not val.is_integer()):
                    raise ValueError(f"expected an integer, got {val!r}")
                conv = int(val)
            elif isinstance(default, float):
                if isinstance(val, bool):
                    raise ValueError(f"expected a number, got {val!r}")
                conv = float(val)
            else:
                conv = val
        except (TypeError, ValueError) as e:
            raise MemengineError(f"--config {config_path}: option '{key}': {e}") from e
        resolved[key] = conv
    return resolved


def validate_train_options(o: dict) -> None:
    def bad(key, why):
        raise MemengineError(f"{FLAG_OF.get(key, key)} {o[key]}: {why}")

    for k in ("lr", "max_grad_norm", "weight_decay", "max_delta", "beta1", "beta2", "eps"):
        if k in o and not (isinstance(o[k], (int, float)) and math.isfinite(o[k])):
            bad(k, "must be a finite number")
    if o.get("epochs", 1) < 1:
        bad("epochs", "must be at least 1")
    if o.get("batch_size", 1) < 1:
        bad("batch_size", "must be at least 1")
    if o.get("seq_len", 1) < 1:
        bad("seq_len", "must be at least 1")
    if o.get("lr", 1) <= 0:
        bad("lr", "must be positive")
    for k in ("max_grad_norm", "weight_decay", "max_delta"):
        if o.get(k, 0) < 0:
            bad(k, "must not be negative")
    for k in ("beta1", "beta2"):
        if k in o and not (0 <= o[k] < 1):
            bad(k, "must be in [0, 1)")
    if o.get("eps", 1) <= 0:
        bad("eps", "must be positive")
    if "tolerance" in o and not (math.isfinite(o["tolerance"]) and o["tolerance"] > 0):
        bad("tolerance", "must be a positive number")


# --------------------------------------------------------------------------- loading
def checkpoint_dir(path: Path) -> Path:
    p = Path(path)
    return p if p.is_dir() else p.parent


def resolve_ckpt(ckpt, revision: Optional[str] = None, model_type: Optional[str] = None):
    """CKPT (a path or a model id; or an already resolved reference) -> CheckpointRef."""
    from memengine.engine.resolve import resolve_checkpoint

    return resolve_checkpoint(ckpt, revision, model_type)


def load_ckpt(ckpt, ui: Optional[UI] = None):
    """Load CKPT (see resolve_ckpt); the loader's assumptions are shown as warnings."""
    from memengine.engine.checkpoint import load_checkpoint

    ref = resolve_ckpt(ckpt)
    c = load_checkpoint(ref.path, model_type=ref.model_type)
    for w in c.warnings:
        if ui is not None:
            ui.warn(w)
    return c


def load_tok(ckpt_path, override: Optional[str], ckpt=None):
    from memengine.engine.tokenizer import load_tokenizer

    return load_tokenizer(ckpt.directory if ckpt is not None else checkpoint_dir(ckpt_path), override=override)


def describe_sources(paths: list[str]) -> str:
    return ", ".join("stdin" if p == "-" else str(p) for p in paths)


def load_batches(data: list[str], tokenizer, vocab_size: int, seq_len: int, batch_size: int,
                 text: str | None = None):
    """Read, tokenize, check and window the data (SPEC section 4)."""
    from memengine.engine.data import check_vocab, make_batches, make_windows, read_text

    if text is None:
        if not data:
            raise MemengineError("--data is required (a file, several files, or - for stdin)")
        for p in data:
            if p != "-" and not Path(p).exists():
                raise MemengineError(f"--data {p}: file not found")
            if p != "-" and Path(p).is_dir():
                raise MemengineError(f"--data {p}: is a directory, expected a text file")
        text = read_text(list(data))
    source = describe_sources(data) if data else "text"
    if not text or not text.strip():
        raise MemengineError(f"--data {source}: no text (empty data)")
    import numpy as np

    ids = np.asarray(tokenizer.encode(text))
    if ids.size < 2:
        raise MemengineError(f"--data {source}: only {ids.size} token(s); need at least 2")
    check_vocab(ids, vocab_size, source)
    windows = make_windows(ids, seq_len)
    batches = make_batches(windows, batch_size, seq_len)
    if not batches:
        raise MemengineError(f"--data {source}: no window of at least 2 tokens")
    return batches, int(ids.size)


def make_runtime(device: Optional[str], verbose: bool, ui: UI):
    from memengine.engine.gpu import get_runtime

    rt = get_runtime(device or None, verbose=verbose)
    # each command builds its own model: let go of what an earlier one in this process
    # (the demo runs several) left in the bind-group, scratch and buffer caches
    rt.trim()
    desc = rt.describe()
    if getattr(ui, "_adapter_shown", None) != desc:  # once per command (the demo runs several)
        ui.note(f"adapter: {desc}")
        ui._adapter_shown = desc
    return rt


def engine_version() -> str:
    from memengine.engine import __version__

    return __version__


def all_finite(tensors: dict) -> Optional[str]:
    """Name of the first tensor holding NaN/Inf, or None."""
    import numpy as np

    for name, a in tensors.items():
        if not np.all(np.isfinite(a)):
            return name
    return None
