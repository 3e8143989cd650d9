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
* A run with periodic checkpoints owns OUT from its first checkpoint on: that checkpoint is
  staged inside a new OUT (``.OUT.tmp-*/checkpoints/step-K``) and put at OUT as above, so an
  old OUT (--force) stays until the new one holds a complete checkpoint.  `publish_files`
  then changes OUT's files together or not at all: the new files are staged beside OUT, a
  commit mark is written, everything else of OUT (checkpoints/, the user's own files) is
  moved into the staged directory and the two are exchanged; a run killed after the mark
  is finished by `recover` (rolled forward), one killed before it leaves OUT as it was.
* `--force` replaces only what memengine writes (`foreign_entries`: a directory holding
  anything else is refused, naming a few), and an in-place run never deletes a file it did
  not write.
* `lock_output` takes an advisory lock (flock) on ``.OUT.lock`` beside OUT for the rest of
  the command: a second writer of the same OUT is refused in one line; the kernel drops the
  lock of a killed run.
* Every input file is checked by its real path (`input_files`: a checkpoint directory's
  files one by one, symlinks followed, as in a Hugging Face cache snapshot).
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


# a file name may have 255 bytes; the hidden names add up to 30 characters to OUT's name
_MAX_STEM = 200


def _stem(name: str) -> str:
    """OUT's name as the hidden names beside it carry it: a name too long to take the
    suffixes is cut, with a hash of the whole name (a valid 240-character OUT works)."""
    if len(os.fsencode(name)) <= _MAX_STEM:
        return name
    import hashlib

    cut = os.fsencode(name)[:_MAX_STEM - 9].decode("utf-8", "ignore")
    return f"{cut}~{hashlib.sha1(os.fsencode(name)).hexdigest()[:8]}"


def _hidden_name(out: Path, kind: str) -> Path:
    return out.parent / f".{_stem(out.name)}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


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
    tmp = path.parent / f".{_stem(path.name)}.{secrets.token_hex(4)}.tmp"
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


def _put_in(tmp: Path, out: Path) -> Optional[Path]:
    """Put the complete directory `tmp` at `out`: old or new is at `out` at every instant.
    Returns where the old OUT now is (None when there was none); the caller discards it."""
    if os.path.lexists(out):
        if exchange(tmp, out):
            fsync_dir(out.parent)
            return tmp  # now holds the old OUT
        old = _hidden_name(out, "old")
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(old, out)
            raise
        fsync_dir(out.parent)
        return old
    os.rename(tmp, out)
    fsync_dir(out.parent)
    return None


def _swap_in(tmp: Path, out: Path, record: bool = True) -> None:
    """Put the complete directory `tmp` at `out` (see the module doc); old or new is at
    `out` at every instant.  `record`: note OUT as completed (what an interrupt reports)."""
    fsync_tree(tmp)
    with interrupts.critical():
        old = _put_in(tmp, out)
        if record:
            interrupts.completed(out)
    if old is not None:
        _discard(old, out)


# ----------------------------------------------------------------------------- what memengine writes
# the files memengine writes into an output directory (a checkpoint, an adapter, a run's OUT);
# a front end or a module that writes another one adds its name here
OWNED_FILES = {
    "model.safetensors", "model.safetensors.index.json", "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "optimizer.safetensors",
    "trainer_state.json", RECORD_FILE, "README.md", "adapter_config.json", "adapter_model.safetensors",
    "loss.png",
}
EVENTS_DIR = "runs"   # --report-to tensorboard's event files (engine/app/curves.RUNS_DIR)
CHECKPOINTS_DIR = "checkpoints"
COMMIT_MARK = ".memengine-commit"
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_STEP_DIR = re.compile(r"^step-\d+$")
_TEMP_FILE = re.compile(r"^\..+\.[0-9a-f]{8}\.tmp$")           # atomic_write_bytes' temporary
_LEFTOVER = re.compile(r"^\.(.+)\.(tmp|old|del)-(\d+)-[0-9a-f]+$")  # a hidden staging/old/deleted directory


def owned_file(name: str) -> bool:
    """A top-level file name of an output that memengine writes (or its temporary)."""
    return name in OWNED_FILES or bool(_SHARD.match(name)) or bool(_TEMP_FILE.match(name)) or name == COMMIT_MARK


def foreign_entries(out: Path, limit: int = 4) -> list[str]:
    """What OUT holds that memengine would not have written (relative paths, directories
    with a trailing /), at most `limit`: --force replaces only a memengine output."""
    found: list[str] = []

    def kind(e) -> str:
        try:
            return "dir" if e.is_dir(follow_symlinks=False) else "file"
        except OSError:
            return "file"

    def walk(d: str, rel: str, level: int) -> None:
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:
            return
        for e in entries:
            if len(found) > limit:
                return
            k = kind(e)
            shown = rel + e.name + ("/" if k == "dir" else "")
            if _LEFTOVER.match(e.name) or (k == "file" and _TEMP_FILE.match(e.name)):
                continue  # a killed run's own staging
            if level == 0 and e.name == CHECKPOINTS_DIR and k == "dir":
                walk(e.path, shown, 1)
            elif level == 0 and e.name == EVENTS_DIR and k == "dir":
                continue   # TensorBoard's event files of earlier invocations
            elif level == 1 and _STEP_DIR.match(e.name) and k == "dir":
                walk(e.path, shown, 2)
            elif level != 1 and k == "file" and owned_file(e.name):
                continue
            else:
                found.append(shown)

    if Path(out).is_dir():
        walk(str(out), "", 0)
    return found


def _refuse_foreign(out: Path, flag: str) -> None:
    few = foreign_entries(out)
    if few:
        shown = ", ".join(few[:3]) + (", ..." if len(few) > 3 else "")
        raise MemengineError(f"{flag}: holds files memengine did not write ({shown}); --force replaces only "
                             "what memengine writes: move them away or choose another --output")


# ----------------------------------------------------------------------------- the lock
try:
    import fcntl as _fcntl
except ImportError:  # pragma: no cover - not a POSIX system: no advisory locks
    _fcntl = None

_LOCKS: dict = {}   # abspath(OUT) -> (fd, lock file)


def _lock_key(out: Path) -> str:
    """OUT by its real parent (the same OUT however it is spelled)."""
    out = Path(os.path.abspath(out))
    return os.path.join(os.path.realpath(out.parent), out.name)


def _lock_file(out: Path) -> Path:
    key = Path(_lock_key(out))
    return key.parent / f".{_stem(key.name)}.lock"


def lock_output(out: Path) -> None:
    """Take the advisory lock of OUT (flock on ``.OUT.lock`` beside it) for the rest of the
    command, or refuse in one line when another run holds it.  The kernel releases the lock
    of a process that dies, so a killed run leaves nothing stuck."""
    key = _lock_key(out)
    if key in _LOCKS or _fcntl is None:
        return
    path = _lock_file(out)
    with contextlib.suppress(OSError):   # OUT's parents are made as its staging would make them
        path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(20):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
        except OSError as e:
            raise MemengineError(f"--output {out}: cannot make its lock file {path.name} in {path.parent} "
                                 f"({e.strerror or e}); choose a writable directory") from None
        try:
            _fcntl.flock(fd, _fcntl.LOCK_EX | _fcntl.LOCK_NB)
        except OSError:
            try:
                pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            except OSError:
                pid = ""
            os.close(fd)
            who = f" (pid {pid})" if pid.isdigit() else ""
            raise MemengineError(f"--output {out}: another memengine run{who} is writing it; wait for it to end "
                                 "or choose another --output") from None
        # the holder before us may have removed the file (and a third made a new one) between
        # our open and our flock: the lock counts only on the file still at the path
        try:
            st, now = os.fstat(fd), os.stat(path)
            same = (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)
        except OSError:
            same = False
        if same:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            _LOCKS[key] = (fd, path)
            interrupts.holding_lock(path)
            return
        os.close(fd)
    raise MemengineError(f"--output {out}: could not take its lock ({path.name} keeps changing)")


def release_lock(out: Path) -> None:
    """Give up OUT's lock (its file removed while still held)."""
    got = _LOCKS.pop(_lock_key(out), None)
    if got is not None:
        fd, path = got
        interrupts.holding_lock(path, held=False)
        with contextlib.suppress(OSError):
            os.unlink(path)
        with contextlib.suppress(OSError):
            os.close(fd)


def release_locks() -> None:
    """The command is over: every lock it took is given up."""
    for key in list(_LOCKS):
        release_lock(Path(key))


def _clean_stale_lock(out: Path) -> None:
    """Remove the lock file a killed run left (when no one holds it)."""
    path = _lock_file(out)
    if _lock_key(out) in _LOCKS or _fcntl is None or not os.path.lexists(path):
        return
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return
    try:
        _fcntl.flock(fd, _fcntl.LOCK_EX | _fcntl.LOCK_NB)
        with contextlib.suppress(OSError):
            os.unlink(path)
    except OSError:
        pass  # a live run holds it
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- leftovers
def leftovers(out: Path) -> list[tuple[str, Path]]:
    """(kind, path) of the hidden staging/old/deleted directories of dead processes beside
    OUT (a live process's, another run still writing, are not leftovers)."""
    out = Path(out)
    parent = out.parent
    pat = re.compile(r"^\." + re.escape(_stem(out.name)) + r"\.(tmp|old|del)-(\d+)-[0-9a-f]+$")
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
    notes = []
    with contextlib.suppress(OSError):
        for n in sorted(os.listdir(directory)):
            m = _LEFTOVER.match(n)
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


def _read_mark(tmp: Path) -> Optional[list]:
    """The new file names a staged commit holds (None: not a commit, or its mark unreadable)."""
    try:
        names = json.loads((Path(tmp) / COMMIT_MARK).read_text(encoding="utf-8")).get("names")
    except (OSError, ValueError, AttributeError):
        return None
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else None


def recover(out: Path) -> list[str]:
    """Clean what a killed run left beside OUT; when OUT is missing and a complete old copy
    is there (killed between the two renames of a replacement), put it back; finish a
    commit of OUT's files that was killed after its mark (`publish_files`).  Returns one
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
        names = _read_mark(p) if kind == "tmp" else None
        if names is not None:
            _commit(p, out, names)
            notes.append(f"finished writing {out} (the run writing it was killed while it replaced its files)")
            continue
        _remove(p)
        notes.append(f"removed {p.name} beside {out.name} (left by a run that was killed)")
    if os.path.lexists(out / COMMIT_MARK):  # killed after its commit, before it removed the mark
        with contextlib.suppress(OSError):
            os.unlink(out / COMMIT_MARK)
    if os.path.isdir(out / CHECKPOINTS_DIR) and not os.path.islink(out / CHECKPOINTS_DIR):
        notes += clean_leftovers(out / CHECKPOINTS_DIR)   # a checkpoint a killed run was writing
    _clean_stale_lock(out)
    return notes


# ----------------------------------------------------------------------------- checks
def _real(p) -> Path:
    return Path(os.path.realpath(os.path.expanduser(str(p))))


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


# how many files of an input directory are looked at one by one (a checkpoint holds a few)
MAX_INPUT_FILES = 10_000


def input_files(p) -> list[Path]:
    """The real paths of what an input is: a file's target, or a directory and each file
    in it (two levels down), symlinks followed: a Hugging Face cache snapshot is a
    directory of links into blobs/."""
    rp = _real(p)
    out = [rp]
    if not rp.is_dir():
        if str(p).endswith(".index.json"):   # a sharded checkpoint named by its index: its shards too
            with contextlib.suppress(OSError):
                d = Path(os.path.abspath(os.path.expanduser(str(p)))).parent
                out += [_real(f) for f in sorted(d.iterdir())[:MAX_INPUT_FILES] if f.name.endswith(".safetensors")]
        return out
    todo = [(Path(os.path.abspath(os.path.expanduser(str(p)))), 0)]
    while todo and len(out) < MAX_INPUT_FILES:
        d, depth = todo.pop()
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries[:MAX_INPUT_FILES]:
            try:
                if e.is_symlink() or e.is_file(follow_symlinks=False):
                    out.append(_real(e.path))
                elif e.is_dir(follow_symlinks=False) and depth < 1:
                    todo.append((Path(e.path), depth + 1))
            except OSError:
                continue
    return out


def _writable_parent(out: Path) -> Path:
    """The nearest existing ancestor of OUT, which must be a directory we can write in."""
    flag = f"--output {out}"
    p = Path(os.path.abspath(out)).parent
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    if not p.is_dir():
        raise MemengineError(f"{flag}: {p} is a file, not a directory; choose an --output whose parent is a "
                             "directory")
    probe = _hidden_name(Path(p) / out.name, "tmp")
    try:
        _make_dir(probe)
    except OSError as e:
        raise MemengineError(f"{flag}: cannot write in {p} ({e.strerror or e}); choose a writable "
                             "directory") from None
    with contextlib.suppress(OSError):
        os.rmdir(probe)
    return p


def check_inputs_apart(out: Path, inputs: Iterable, owned: bool = False, flag: Optional[str] = None) -> None:
    """OUT may not be, contain or lie inside any input (real paths, each file of an input
    directory too).  `owned`: OUT is the resumed run's own directory; then only an input
    file at a path memengine replaces in it is refused."""
    flag = flag or f"--output {out}"
    ro = _real(out)
    for item in inputs:
        what, p = item if isinstance(item, tuple) else ("the input", item)
        if p is None or str(p) == "-":
            continue
        files = input_files(p)
        rp = files[0]
        if owned:
            for f in files:
                if f.parent == ro and owned_file(f.name):
                    raise MemengineError(f"{flag}: {what} {p} is {f}, a file this run replaces; move it "
                                         "elsewhere")
            continue
        if ro == rp:
            raise MemengineError(f"{flag}: is {what} {p}; write to another directory")
        if rp.is_dir() and _inside(ro, rp):
            raise MemengineError(f"{flag}: lies inside {what} {p} (it would write into an input); write to "
                                 "another directory")
        for f in files:
            if _inside(f, ro):
                shown = "" if f == rp or str(f) == os.path.abspath(str(p)) else f" ({f})"
                raise MemengineError(f"{flag}: contains {what} {p}{shown} (replacing it would delete it); write to "
                                     "another directory")


def check_output(out: Path, force: bool, inputs: Iterable = (), owned: bool = False,
                 on_note: Optional[Callable[[str], None]] = None, hint: Optional[str] = None) -> Path:
    """Refuse OUT that would overwrite or lose something (see the module doc), and take
    its lock (`lock_output`) for the rest of the command.

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
    lock_output(out)
    for note in recover(out):
        if on_note is not None:
            on_note(note)
    check_inputs_apart(out, inputs, owned)
    if not owned and out.is_dir() and any(out.iterdir()):
        if not force:
            raise MemengineError(f"{flag}: directory exists and is not empty ({hint or 'use --force to replace it'})")
        _refuse_foreign(out, flag)
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
            if out.is_dir() and any(out.iterdir()):
                if not force:
                    raise MemengineError(f"--output {out}: directory exists and is not empty (use --force to "
                                         "replace it)")
                _refuse_foreign(out, f"--output {out}")
            _swap_in(tmp, out, record)
        except BaseException:
            _remove(tmp)
            raise


def _commit(tmp: Path, out: Path, names: list) -> None:
    """Make the staged directory `tmp` (the new files `names`) OUT: move every other entry of
    OUT into it (checkpoints/, the user's files), but not memengine's files that the new set
    replaces or no longer has, then put it at OUT and discard the old one.  Run again on
    the same directories (`recover`, after a kill) it finishes the job."""
    new = set(names)
    if os.path.isdir(out):
        for n in sorted(os.listdir(out)):
            if n in new or n == COMMIT_MARK or owned_file(n) or os.path.lexists(tmp / n):
                continue
            os.rename(out / n, tmp / n)
        fsync_dir(out)
        fsync_dir(tmp)
    old = _put_in(tmp, out)
    with contextlib.suppress(OSError):
        os.unlink(out / COMMIT_MARK)
    fsync_dir(out)
    if old is not None:
        _discard(old, out)


@contextlib.contextmanager
def publish_files(out: Path, record: bool = True) -> Iterator[Path]:
    """Yield a staging directory for OUT's new files; on success change OUT's files together
    or not at all (see the module doc): OUT keeps checkpoints/ and every file that is not
    memengine's; memengine's files that the new set does not have go."""
    out = Path(os.path.abspath(out))
    tmp = _new_staging(out)
    committing = False
    try:
        with interrupts.staging_dir(tmp):
            yield tmp
            fsync_tree(tmp)
            names = sorted(p.name for p in tmp.iterdir())
        with interrupts.critical():
            # from the mark on, the staged directory is the new OUT: an emergency exit keeps it
            # and the next run finishes the commit (`recover`)
            committing = True
            write_json(tmp / COMMIT_MARK, {"names": names, "pid": os.getpid()})
            _commit(tmp, out, names)
            if record:
                interrupts.completed(out)
    finally:
        if not committing:
            _remove(tmp)


def remove_dir(path: Path) -> None:
    """Remove a directory this run wrote (a checkpoint beyond --keep-last): renamed to a
    hidden name first, so a listing never sees it half-deleted."""
    path = Path(path)
    if not path.exists():
        return
    _discard(path, path)
