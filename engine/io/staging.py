"""Writing outputs so that nothing is ever half-written or lost: the one place that does it.

* `check_output` refuses, before any expensive work, an OUT that would overwrite something:
  an existing non-empty directory without --force, a file, an OUT that is, contains or
  lies inside one of the run's inputs (real paths, symlinks resolved), an OUT whose parent
  is a file or cannot be written (read-only filesystem, no permission).  It also recovers
  what a killed run left beside OUT (`recover`).
* `staged_output(out)` yields a hidden staging directory beside OUT (``.OUT.tmp-PID-*``),
  and on success fsyncs every file and directory in it and puts it at OUT in one step: an
  atomic exchange of the two directories where the OS has one (Linux renameat2
  RENAME_EXCHANGE), else two renames (OUT aside to ``.OUT.old-PID-*``, the new one in).
  The old OUT is removed only afterwards (renamed to ``.OUT.del-PID-*`` first).  A crash at
  any instant leaves the old or the new OUT at the path; `recover` puts a complete old one
  back if OUT is missing and removes the other leftovers.  On any exception, Ctrl-C
  included, the staging directory is removed and OUT is untouched.
* A run with periodic checkpoints owns OUT while it runs: `claim_dir` creates it (under
  --force an old OUT is exchanged for an empty one) and `publish_files` replaces OUT's
  top-level files at the end, each by a rename from a staged directory, the run record last.
* Files are created with the mode the umask gives (0666 & ~umask, directories 0777 &
  ~umask), written through a temporary name, fsynced, and their directory fsynced after
  the rename (`atomic_write_bytes`, `write_json`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import json
import os
import re
import secrets
import shutil
import stat
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

from memengine.engine import interrupts
from memengine.engine.errors import MemengineError

RECORD_FILE = "memengine.json"
_KINDS = ("tmp", "old", "del")


# ----------------------------------------------------------------------------- low level
def fsync_dir(path: Path) -> None:
    """fsync a directory (its entries: created, renamed, removed files)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every regular file under `root`, then every directory, deepest first."""
    dirs = []
    for d, _, files in os.walk(root):
        dirs.append(d)
        for f in files:
            p = os.path.join(d, f)
            with contextlib.suppress(OSError):
                if stat.S_ISREG(os.lstat(p).st_mode):
                    fd = os.open(p, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
    for d in reversed(dirs):
        fsync_dir(Path(d))


def _hidden_name(out: Path, kind: str) -> Path:
    return out.parent / f".{out.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def _make_dir(path: Path) -> None:
    os.mkdir(path, 0o777)  # the umask applies, as for any mkdir


def _remove(path: Path) -> None:
    """Remove a directory tree (or a file/link) this module created."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        with contextlib.suppress(OSError):
            path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def _discard(path: Path, out: Path) -> None:
    """Remove an old OUT: renamed to a hidden .del- name first (never restored), then removed."""
    gone = _hidden_name(out, "del")
    try:
        os.rename(path, gone)
    except OSError:
        gone = path
    fsync_dir(out.parent)
    _remove(gone)


def atomic_write_bytes(path: str | Path, chunks) -> None:
    """Write `chunks` (bytes or an iterable of buffers) to `path`: a temporary file created
    with the umask's mode, fsynced, renamed over `path`, the directory fsynced."""
    path = Path(path)
    if isinstance(chunks, (bytes, bytearray, memoryview)):
        chunks = [chunks]
    tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            for c in chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json(path: Path, obj: Any) -> None:
    """Write `obj` as indented JSON, atomically and durably (`atomic_write_bytes`)."""
    text = json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n"
    atomic_write_bytes(path, text.encode("utf-8"))


def write_text(path: Path, text: str) -> None:
    """Write UTF-8 text atomically and durably (`atomic_write_bytes`)."""
    atomic_write_bytes(path, text.encode("utf-8"))


# ----------------------------------------------------------------------------- exchange
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_EXCHANGE = {"fn": None, "ok": sys.platform.startswith("linux")}


def _renameat2():
    if _EXCHANGE["fn"] is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
            fn = libc.renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _EXCHANGE["fn"] = fn
        except (OSError, AttributeError):  # no renameat2 in this C library (glibc < 2.28, musl, ...)
            _EXCHANGE["ok"] = False
    return _EXCHANGE["fn"]


def exchange(a: Path, b: Path) -> bool:
    """Atomically exchange two existing paths (Linux renameat2 RENAME_EXCHANGE).  False when
    the OS or the filesystem has no such operation (the caller falls back to renames)."""
    if not _EXCHANGE["ok"] or _renameat2() is None:
        return False
    r = _EXCHANGE["fn"](_AT_FDCWD, os.fsencode(str(a)), _AT_FDCWD, os.fsencode(str(b)), _RENAME_EXCHANGE)
    if r == 0:
        return True
    e = ctypes.get_errno()
    if e in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)):
        _EXCHANGE["ok"] = False  # the kernel or the filesystem does not have it
        return False
    raise OSError(e, os.strerror(e), str(b))


def _swap_in(tmp: Path, out: Path, record: bool = True) -> None:
    """Put the complete directory `tmp` at `out` (see the module doc); old or new is at
    `out` at every instant.  `record`: note OUT as completed (what an interrupt reports)."""
    fsync_tree(tmp)
    with interrupts.critical():
        if os.path.lexists(out):
            if exchange(tmp, out):
                old = tmp  # now holds the old OUT
                fsync_dir(out.parent)
            else:
                old = _hidden_name(out, "old")
                os.rename(out, old)
                try:
                    os.rename(tmp, out)
                except BaseException:
                    os.rename(old, out)
                    raise
                fsync_dir(out.parent)
        else:
            old = None
            os.rename(tmp, out)
            fsync_dir(out.parent)
        if record:
            interrupts.completed(out)
    if old is not None:
        _discard(old, out)


# ----------------------------------------------------------------------------- leftovers
def leftovers(out: Path) -> list[tuple[str, Path]]:
    """(kind, path) of the hidden staging/old/deleted directories of dead processes beside
    OUT (a live process's, another run still writing, are not leftovers)."""
    out = Path(out)
    parent = out.parent
    pat = re.compile(r"^\." + re.escape(out.name) + r"\.(tmp|old|del)-(\d+)-[0-9a-f]+$")
    found = []
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    for n in names:
        m = pat.match(n)
        if m and not _alive(int(m.group(2))):
            found.append((m.group(1), parent / n))
    return sorted(found, key=lambda kp: kp[1].name)


def clean_leftovers(directory: Path) -> list[str]:
    """Remove every leftover of a dead process in `directory` (OUT/checkpoints on --resume)."""
    pat = re.compile(r"^\.(.+)\.(tmp|old|del)-(\d+)-[0-9a-f]+$")
    notes = []
    with contextlib.suppress(OSError):
        for n in sorted(os.listdir(directory)):
            m = pat.match(n)
            if m and not _alive(int(m.group(3))):
                _remove(Path(directory) / n)
                notes.append(f"removed {n} in {directory} (left by a run that was killed)")
    return notes


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, another user's
    return True


def recover(out: Path) -> list[str]:
    """Clean what a killed run left beside OUT; when OUT is missing and a complete old copy
    is there (killed between the two renames of a replacement), put it back.  Returns one
    note per action."""
    out = Path(os.path.abspath(out))
    notes = []
    found = leftovers(out)
    if not os.path.lexists(out):
        olds = [p for k, p in found if k == "old"]
        if olds:
            best = max(olds, key=lambda p: p.stat().st_mtime)
            os.rename(best, out)
            fsync_dir(out.parent)
            notes.append(f"restored {out} (a replacement of it was killed before it finished)")
            found = [(k, p) for k, p in found if p != best]
    for kind, p in found:
        _remove(p)
        notes.append(f"removed {p.name} beside {out.name} (left by a run that was killed)")
    return notes


# ----------------------------------------------------------------------------- checks
def _real(p) -> Path:
    return Path(os.path.realpath(os.path.expanduser(str(p))))


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def _writable_parent(out: Path) -> Path:
    """The nearest existing ancestor of OUT, which must be a directory we can write in."""
    flag = f"--output {out}"
    p = Path(os.path.abspath(out)).parent
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    if not p.is_dir():
        raise MemengineError(f"{flag}: {p} is a file, not a directory; choose an --output whose parent is a "
                             "directory")
    probe = p / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        _make_dir(probe)
    except OSError as e:
        raise MemengineError(f"{flag}: cannot write in {p} ({e.strerror or e}); choose a writable "
                             "directory") from None
    with contextlib.suppress(OSError):
        os.rmdir(probe)
    return p


def check_output(out: Path, force: bool, inputs: Iterable = (), owned: bool = False,
                 on_note: Optional[Callable[[str], None]] = None, hint: Optional[str] = None) -> Path:
    """Refuse OUT that would overwrite or lose something (see the module doc).

    `inputs`: (what, path) pairs (or bare paths) the run reads: OUT may not be one, contain
    one or lie inside one.  `owned`: OUT is the resumed run's own directory (continuing in
    place), which may be non-empty.  `on_note` hears what `recover` did.  `hint`: what to
    say in place of "use --force" when OUT is not empty (a resumable run's `--resume`)."""
    out = Path(out)
    if str(out) in ("", "-", "."):
        raise MemengineError("--output must be a directory path")
    flag = f"--output {out}"
    if os.path.lexists(out) and not out.is_dir():
        raise MemengineError(f"{flag}: exists and is not a directory")
    _writable_parent(out)
    for note in recover(out):
        if on_note is not None:
            on_note(note)
    if not owned:
        ro = _real(out)
        for item in inputs:
            what, p = item if isinstance(item, tuple) else ("the input", item)
            if p is None or str(p) == "-":
                continue
            rp = _real(p)
            if ro == rp:
                raise MemengineError(f"{flag}: is {what} {p}; write to another directory")
            if _inside(rp, ro):
                raise MemengineError(f"{flag}: contains {what} {p} (replacing it would delete it); write to "
                                     "another directory")
            if rp.is_dir() and _inside(ro, rp):
                raise MemengineError(f"{flag}: lies inside {what} {p} (it would write into an input); write to "
                                     "another directory")
    if not owned and out.is_dir() and any(out.iterdir()) and not force:
        raise MemengineError(f"{flag}: directory exists and is not empty ({hint or 'use --force to replace it'})")
    return out


# ----------------------------------------------------------------------------- writers
def _new_staging(out: Path) -> Path:
    """A hidden staging directory beside OUT (parents created), mode from the umask."""
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = _hidden_name(out, "tmp")
        _make_dir(tmp)
    except OSError as e:
        raise MemengineError(f"--output {out}: cannot write in {parent} ({e.strerror or e}); choose a "
                             "writable directory") from None
    return tmp


@contextlib.contextmanager
def staged_output(out: Path, force: bool, record: bool = True) -> Iterator[Path]:
    """Yield a staging directory beside OUT; on success put it at OUT (see the module doc).
    `record`: OUT is a command's output (not a periodic checkpoint)."""
    out = Path(os.path.abspath(out))
    tmp = _new_staging(out)
    with interrupts.staging_dir(tmp):
        try:
            yield tmp
            if out.is_dir() and any(out.iterdir()) and not force:
                raise MemengineError(f"--output {out}: directory exists and is not empty (use --force to replace it)")
            _swap_in(tmp, out, record)
        except BaseException:
            _remove(tmp)
            raise


def claim_dir(out: Path, force: bool, owned: bool = False) -> Path:
    """Make OUT the run's directory before its first periodic checkpoint: create it, or
    under --force replace a non-empty one with an empty one (`owned`: keep it as is)."""
    out = Path(out)
    if out.is_dir() and (owned or not any(out.iterdir())):
        return out
    if out.exists() and not force:
        raise MemengineError(f"--output {out}: directory exists and is not empty (use --force to replace it)")
    with staged_output(out, force=True, record=False):
        pass
    return out


@contextlib.contextmanager
def publish_files(out: Path) -> Iterator[Path]:
    """Yield a staging directory; on success move each of its files into OUT (an owned,
    existing directory), the run record last, and remove OUT's stale top-level
    .safetensors/.json files that the new set does not have.  Subdirectories of OUT
    (checkpoints/) are left alone."""
    out = Path(os.path.abspath(out))
    tmp = _new_staging(out)
    with interrupts.staging_dir(tmp):
        try:
            yield tmp
            fsync_tree(tmp)
            names = sorted(p.name for p in tmp.iterdir())
            names.sort(key=lambda n: n == RECORD_FILE)
            with interrupts.critical():
                for stale in out.iterdir():
                    if stale.is_file() and stale.suffix in (".safetensors", ".json") and stale.name not in names:
                        stale.unlink()
                for n in names:
                    os.replace(tmp / n, out / n)
                fsync_dir(out)
                interrupts.completed(out)
        finally:
            _remove(tmp)


def remove_dir(path: Path) -> None:
    """Remove a directory this run wrote (a checkpoint beyond --keep-last): renamed to a
    hidden name first, so a listing never sees it half-deleted."""
    path = Path(path)
    if not path.exists():
        return
    _discard(path, path)
