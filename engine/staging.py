"""Writing outputs so that nothing is ever half-written: the one place that does it.

* `check_output` refuses an OUT that would overwrite something, before any expensive work.
* `staged_output(out)` yields a temporary directory beside OUT and renames it into place
  on success (an existing OUT is swapped out and removed only after the rename); on any
  exception, Ctrl-C included, the temporary directory is removed and OUT is untouched.
  Used for whole outputs (init, quantize, a run without periodic checkpoints) and for
  each periodic checkpoint (OUT/checkpoints/step-K).
* A run with periodic checkpoints owns OUT while it runs: `claim_dir` creates it (under
  --force an old OUT is swapped out first) and `publish_files` replaces OUT's top-level
  files at the end, each by a rename from a staged directory, the run record last.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from .errors import MemengineError

RECORD_FILE = "memengine.json"


def check_output(out: Path, force: bool, inputs: tuple = (), owned: bool = False) -> Path:
    """Refuse OUT that would overwrite something.  `owned`: OUT is the resumed run's own
    directory (continuing in place), which may be non-empty."""
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
    if not owned and out.is_dir() and any(out.iterdir()) and not force:
        raise MemengineError(f"--output {out}: directory exists and is not empty (use --force to replace it)")
    return out


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def _swap_in(tmp: Path, out: Path) -> None:
    """Rename tmp to out; an existing out is renamed aside first and removed afterwards."""
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
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


@contextlib.contextmanager
def staged_output(out: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary directory beside OUT; on success rename it into place."""
    out = Path(out)
    parent = out.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755 & ~_umask())
        if out.exists() and out.is_dir() and any(out.iterdir()) and not force:
            raise MemengineError(f"--output {out}: directory exists and is not empty (use --force to replace it)")
        _swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def claim_dir(out: Path, force: bool, owned: bool = False) -> Path:
    """Make OUT the run's directory before its first periodic checkpoint: create it, or
    under --force replace a non-empty one with an empty one (`owned`: keep it as is)."""
    out = Path(out)
    if out.is_dir() and (owned or not any(out.iterdir())):
        return out
    if out.exists():
        if not force:
            raise MemengineError(f"--output {out}: directory exists and is not empty (use --force to replace it)")
        parent = out.resolve().parent
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
        os.chmod(tmp, 0o755 & ~_umask())
        _swap_in(tmp, out)
    else:
        out.mkdir(parents=True)
    return out


@contextlib.contextmanager
def publish_files(out: Path) -> Iterator[Path]:
    """Yield a staging directory; on success move each of its files into OUT (an owned,
    existing directory), the run record last, and remove OUT's stale top-level
    .safetensors/.json files that the new set does not have.  Subdirectories of OUT
    (checkpoints/) are left alone."""
    out = Path(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.resolve().parent))
    try:
        yield tmp
        names = sorted(p.name for p in tmp.iterdir())
        names.sort(key=lambda n: n == RECORD_FILE)
        for stale in out.iterdir():
            if stale.is_file() and stale.suffix in (".safetensors", ".json") and stale.name not in names:
                stale.unlink()
        for n in names:
            os.replace(tmp / n, out / n)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_json(path: Path, obj: Any) -> None:
    """Write `obj` as indented JSON through a temporary file and a rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=False, default=str)
        f.write("\n")
    os.replace(tmp, path)


def remove_dir(path: Path) -> None:
    """Remove a directory this run wrote (a checkpoint beyond --keep-last): renamed to a
    hidden name first, so a listing never sees it half-deleted."""
    path = Path(path)
    if not path.exists():
        return
    gone = Path(tempfile.mkdtemp(prefix=f".{path.name}.del-", dir=path.parent))
    gone.rmdir()
    os.rename(path, gone)
    shutil.rmtree(gone, ignore_errors=True)
