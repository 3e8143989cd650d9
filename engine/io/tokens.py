"""Training data on disk: the data read as a stream, tokenized once into a memory-mapped
token file, and windows read from that file on demand (engine/io/data.py `Windows`), so a
run's host memory does not grow with the corpus.

Sources.  `--data` names text files, .jsonl files, a directory (its train.jsonl; valid.jsonl
is the validation data, test.jsonl what `eval` reads), or `-` for stdin.  Standard input
and FIFOs are copied into a spool file of the cache as they are read, in pieces, at most
`MEMENGINE_MAX_STREAM_BYTES` (default 16 GiB, and no more than a third of the cache
disk's free space), with an interrupt check between pieces.  A text file is one document;
each line of a .jsonl file is one record:

    {"text": ...}                         trained on all of it
    {"prompt": ..., "completion": ...}    the two tokenized one after the other; the loss is
                                          on the completion's tokens only, unless
                                          --train-on-prompt (eval: --score-prompt)
    {"messages": [{"role", "content"}...]}  rendered with the tokenizer's chat template
                                          (engine/io/chat.py, as transformers'
                                          apply_chat_template); the loss is on the assistant
                                          turns only, unless --train-on-prompt

Documents are packed into one stream with the tokenizer's end-of-text token between two
(a tokenizer without one: the tokens of a newline), as before, so windows cross document
boundaries and every separator is a trained target.

The token file.  One directory per (data bytes, tokenizer files, end-of-text id, prompt
loss) under the cache (`MEMENGINE_CACHE_DIR`, else $XDG_CACHE_HOME/memengine or
~/.cache/memengine, then tokens/<key>): tokens.bin (uint8 for vocabularies up to 256,
uint16 up to 65536, else uint32), mask.bin (one byte per token, 1 = a trained target; only
when some token is not) and meta.json.  It is written to a temporary directory beside and
renamed into place, so a run killed meanwhile leaves no half entry, and reused by later
runs on the same data and by --resume (the data is hashed first: one read of the files).
The sha256 of the ids as int32 (the data's fingerprint in trainer_state.json) is computed
while writing.

The cache's bound.  After a run has its token file, the entries beyond
`MEMENGINE_CACHE_MAX_BYTES` (default 32GB; units as --max-shard-size's) are removed, the
least recently used first (a use touches meta.json), never the run's own entry nor one used
in the last `RECENT` seconds (another run may be opening it); a removed entry's live
memory maps stay valid (POSIX), a later run on that data tokenizes it again.  The partial
entries and spool files of a process that no longer runs (killed: their names carry its pid)
go at the same time.  A text document larger than one piece (4 MiB) is tokenized in pieces cut
after a newline (for the byte-level tokenizer exactly; a BPE tokenizer may merge across a
cut differently than over the whole text).
"""

from __future__ import annotations

import atexit
import codecs
import contextlib
import hashlib
import json
import os
import shutil
import stat
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Optional

import numpy as np
from memengine.engine import interrupts
from memengine.engine.errors import MemengineError
from memengine.engine.io.inputs import file_kind, loads_json, read_json, stat_input
from memengine.engine.listener import TaskMeter

FORMAT = 1
PIECE = 4 << 20                      # bytes read (and text tokenized) at a time
MAX_RECORD_BYTES = 256 << 20         # one .jsonl line
DEFAULT_STREAM_CAP = 16 << 30        # stdin / FIFO bytes, unless MEMENGINE_MAX_STREAM_BYTES says otherwise
RESERVE = 256 << 20                  # disk space a token file leaves free
SPLITS = {"train": "train.jsonl", "valid": "valid.jsonl", "test": "test.jsonl"}
RECORD_SHAPES = '{"text": ...}, {"prompt": ..., "completion": ...} or {"messages": [...]}'
DEFAULT_CACHE_MAX = "32GB"           # the token cache's bound, unless MEMENGINE_CACHE_MAX_BYTES says otherwise
RECENT = 60.0                        # seconds: an entry used this recently is never removed
LEFTOVER_AGE = 86400.0               # seconds: a partial entry or spool file without a pid, older, is a leftover


# ----------------------------------------------------------------------------- the cache
def cache_root() -> Path:
    """The cache directory (MEMENGINE_CACHE_DIR, else the XDG cache's memengine/)."""
    env = os.environ.get("MEMENGINE_CACHE_DIR")
    if env:
        root = Path(env)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = Path(base) / "memengine"
    if root.exists() and not root.is_dir():
        mode = root.stat().st_mode
        kind = "a file" if stat.S_ISREG(mode) else file_kind(mode)
        raise MemengineError(f"MEMENGINE_CACHE_DIR {root}: is {kind}, not a directory")
    return root


def _ensure(d: Path, what: str = "the token cache") -> Path:
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MemengineError(f"{what} {d}: cannot create it ({e.strerror or e}); set MEMENGINE_CACHE_DIR to a "
                             "writable directory") from None
    return d


def _free_bytes(d: Path) -> int:
    try:
        st = os.statvfs(d)
    except OSError:
        return 1 << 62
    return st.f_bavail * st.f_frsize


def stream_cap(d: Path) -> int:
    env = os.environ.get("MEMENGINE_MAX_STREAM_BYTES")
    cap = DEFAULT_STREAM_CAP
    if env is not None:
        try:
            cap = int(env)
            assert cap > 0
        except (ValueError, AssertionError):
            raise MemengineError(f"MEMENGINE_MAX_STREAM_BYTES={env!r}: must be a positive number of bytes") from None
    return min(cap, max(_free_bytes(d) // 3, PIECE))


def cache_max_bytes() -> int:
    from memengine.engine.io.shards import parse_size

    env = os.environ.get("MEMENGINE_CACHE_MAX_BYTES", "").strip()
    return parse_size(env or DEFAULT_CACHE_MAX, "MEMENGINE_CACHE_MAX_BYTES")


def _tree_bytes(d: Path) -> int:
    n = 0
    for dirpath, _, files in os.walk(d):
        for f in files:
            with contextlib.suppress(OSError):
                n += os.lstat(os.path.join(dirpath, f)).st_size
    return n


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0   # someone else's live process (or a pid beyond the range: not ours)
    return True


def _leftover(p: Path, prefix: str, now: float) -> bool:
    """A partial entry / spool file whose writer is gone: its pid (in its name) no longer
    runs, or, without one (an older version's), it is older than LEFTOVER_AGE."""
    pid = p.name[len(prefix):].split("-", 1)[0]
    if pid.isdigit() and "-" in p.name[len(prefix):]:
        return not _pid_alive(int(pid))
    try:
        return now - p.lstat().st_mtime > LEFTOVER_AGE
    except OSError:
        return False


def trim_cache(keep: Optional[Path] = None) -> list:
    """Keep the token cache within its bound (module docstring); returns what was removed."""
    root = cache_root()
    cap = cache_max_bytes()
    now = time.time()
    removed = []

    def rm(p: Path) -> None:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                p.unlink()
        if not os.path.lexists(p):
            removed.append(p)

    for sub_dir, prefix in (("tokens", ".tmp-"), ("spool", "stream-")):
        d = root / sub_dir
        with contextlib.suppress(OSError):
            for p in d.iterdir():
                if p.name.startswith(prefix) and _leftover(p, prefix, now):
                    rm(p)
    entries = []
    with contextlib.suppress(OSError):
        for p in (root / "tokens").iterdir():
            if p.name.startswith(".") or not p.is_dir() or p.is_symlink():
                continue
            try:
                used = (p / "meta.json").stat().st_mtime
            except OSError:
                used = p.lstat().st_mtime
            entries.append((used, p, _tree_bytes(p)))
    total = sum(e[2] for e in entries)
    keep = Path(keep).resolve() if keep is not None else None
    for used, p, size in sorted(entries, key=lambda e: e[0]):
        if total <= cap:
            break
        if (keep is not None and p.resolve() == keep) or now - used < RECENT:
            continue
        rm(p)
        if p in removed:
            total -= size
    return removed


_SPOOLED: list = []


@atexit.register
def _remove_spools() -> None:  # pragma: no cover - at exit
    for p in _SPOOLED:
        with contextlib.suppress(OSError):
            os.unlink(p)


# ----------------------------------------------------------------------------- sources
@dataclass(frozen=True)
class Source:
    name: str          # as messages name it: the path given, or "stdin"
    path: Path         # the regular file read (a spool file for stdin and FIFOs)
    jsonl: bool
    size: int
    sha256: str


@dataclass
class Sources:
    items: list
    flag: str

    @property
    def description(self) -> str:
        return ", ".join(s.name for s in self.items)


def data_dir(paths: list) -> Optional[Path]:
    """The directory when `paths` is one directory (train.jsonl / valid.jsonl / test.jsonl)."""
    if len(paths) == 1 and str(paths[0]) != "-" and Path(paths[0]).is_dir():
        return Path(paths[0])
    return None


def split_file(d: Path, split: str, flag: str = "--data", required: bool = True) -> Optional[Path]:
    p = d / SPLITS[split]
    if p.exists() or os.path.lexists(p):
        return p
    if required:
        raise MemengineError(f"{flag} {d}: a directory is read as train.jsonl, valid.jsonl and test.jsonl; it has "
                             f"no {SPLITS[split]}")
    return None


def stream_pieces(stream, cap: int, too_much: Callable[[], str], piece: int = 1 << 20) -> Iterator[bytes]:
    """The bytes of `stream` (a file descriptor, or a file object of bytes or text) in pieces
    of at most `piece`, an interrupt check before each read; more than `cap` bytes in all is
    one MemengineError, `too_much()`'s line."""
    n = 0
    while True:
        interrupts.check()
        raw = os.read(stream, piece) if isinstance(stream, int) else stream.read(piece)
        if isinstance(raw, str):
            raw = raw.encode("utf-8")
        if not raw:
            return
        n += len(raw)
        if n > cap:
            raise MemengineError(too_much())
        yield raw


def _spool(stream, name: str, on_task: Optional[Callable]) -> Source:
    """Copy a stream (stdin, a FIFO) into a spool file of the cache, hashing it: in pieces,
    at most `stream_cap` bytes, an interrupt check between pieces."""
    d = _ensure(cache_root() / "spool")
    cap = stream_cap(d)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=f"stream-{os.getpid()}-")
    _SPOOLED.append(tmp)
    h = hashlib.sha256()
    n = 0
    meter = TaskMeter(on_task, f"reading {name}", None, "bytes")
    try:
        with os.fdopen(fd, "wb") as out:
            for raw in stream_pieces(stream, cap, lambda: (
                    f"{name}: more than {cap:,} bytes were piped in (MEMENGINE_MAX_STREAM_BYTES, and at most a "
                    "third of the cache disk's free space); give a file instead"), PIECE):
                n += len(raw)
                out.write(raw)
                h.update(raw)
                meter.update(n)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        meter.finish()
    return Source(name, Path(tmp), False, n, h.hexdigest())


def _hash_file(path: Path, name: str, size: int, on_task: Optional[Callable]) -> str:
    h = hashlib.sha256()
    meter = TaskMeter(on_task, f"hashing {name}", size, "bytes")
    done = 0
    try:
        with open(path, "rb") as f:
            while True:
                interrupts.check()
                raw = f.read(PIECE)
                if not raw:
                    break
                h.update(raw)
                done += len(raw)
                meter.update(done)
    except OSError as e:
        raise MemengineError(f"data file '{name}': cannot read ({e.strerror or e})") from None
    finally:
        meter.finish()
    return h.hexdigest()


def resolve_sources(paths: list, flag: str = "--data", *, stdin: Optional[BinaryIO] = None,
                    on_task: Optional[Callable] = None) -> Sources:
    """The files `paths` name, checked, hashed, and stdin/FIFOs spooled (read once)."""
    if not paths:
        raise MemengineError(f"{flag} is required (a file, several files, a directory, or - for stdin)")
    stream_cap(_ensure(cache_root()))   # MEMENGINE_MAX_STREAM_BYTES checked whatever the data
    items = []
    for p in paths:
        p = str(p)
        if p == "-":
            stream = stdin if stdin is not None else getattr(sys.stdin, "buffer", None)
            if stream is None:
                stream = sys.stdin
            elif stdin is None:
                with contextlib.suppress(AttributeError, OSError, ValueError):
                    stream = stream.fileno()
            items.append(_spool(stream, "stdin", on_task))
            continue
        path = Path(p)
        if not os.path.lexists(path):
            raise MemengineError(f"{flag} {p}: file not found")
        if path.is_dir():
            raise MemengineError(f"{flag} {p}: is a directory, expected a text file (a directory alone is read as "
                                 "train.jsonl / valid.jsonl / test.jsonl)")
        st = stat_input(p, "data file")
        if stat.S_ISFIFO(st.st_mode):  # what a shell's <(command) gives: read like stdin
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise MemengineError(f"data file '{p}': cannot open ({e.strerror or e})") from None
            try:
                s = _spool(fd, p, on_task)
            finally:
                os.close(fd)
            items.append(Source(p, s.path, path.suffix.lower() == ".jsonl", s.size, s.sha256))
            continue
        if not stat.S_ISREG(st.st_mode):
            raise MemengineError(f"data file '{p}' is {file_kind(st.st_mode)}, not a text file")
        root = _ensure(cache_root())
        if st.st_size > _free_bytes(root):  # a token file takes at least a byte per token
            raise MemengineError(f"data file '{p}' ({st.st_size:,} bytes): its token file would not fit the "
                                 f"{_free_bytes(root):,} bytes free in the token cache {root}; is it the right "
                                 "file? (MEMENGINE_CACHE_DIR puts the cache on a larger disk)")
        items.append(Source(p, path, path.suffix.lower() == ".jsonl", st.st_size,
                            _hash_file(path, p, st.st_size, on_task)))
    return Sources(items, flag)


# ----------------------------------------------------------------------------- records
def _utf8_error(name: str, e: UnicodeDecodeError, base: int) -> MemengineError:
    return MemengineError(f"{name}: not UTF-8 text (invalid byte 0x{e.object[e.start]:02x} at offset "
                          f"{base + e.start})")


def _text_pieces(src: Source, raw_bytes: bool) -> Iterator:
    """A text file's document in pieces: bytes (`raw_bytes`, the byte-level tokenizer: its ids
    are the bytes) or str cut after a newline; checked as UTF-8 throughout."""
    dec = codecs.getincrementaldecoder("utf-8")()
    carry = ""
    with open(src.path, "rb") as f:
        while True:
            interrupts.check()
            raw = f.read(PIECE)
            final = not raw
            pending = len(dec.getstate()[0])
            try:
                text = dec.decode(raw, final)
            except UnicodeDecodeError as e:
                raise _utf8_error(f"data file '{src.name}'" if src.name != "stdin" else "stdin", e,
                                  f.tell() - len(raw) - pending) from None
            if f.tell() == len(raw) and raw:  # the first piece: no byte-order mark
                if raw_bytes and raw.startswith(codecs.BOM_UTF8):
                    raw = raw[3:]
                if text.startswith("\ufeff"):
                    text = text[1:]
            if raw_bytes:
                if raw:
                    yield raw
            else:
                carry += text
                cut = len(carry) if final else carry.rfind("\n") + 1
                if not final and cut == 0 and len(carry) < 4 * PIECE:
                    continue
                if cut == 0:
                    cut = len(carry)
                if cut:
                    yield carry[:cut]
                carry = carry[cut:]
            if final:
                return


def _record(obj, where: str):
    """('text', str) | ('pc', (prompt, completion)) | ('chat', messages) of a JSONL record."""
    if isinstance(obj, dict):
        if "text" in obj:
            if not isinstance(obj["text"], str):
                raise MemengineError(f"{where}: the \"text\" field must be a string")
            return "text", obj["text"]
        if "prompt" in obj and "completion" in obj:
            for k in ("prompt", "completion"):
                if not isinstance(obj[k], str):
                    raise MemengineError(f"{where}: the \"{k}\" field must be a string")
            return "pc", (obj["prompt"], obj["completion"])
        if "messages" in obj:
            msgs = obj["messages"]
            if not isinstance(msgs, list) or not msgs or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs):
                raise MemengineError(f"{where}: \"messages\" must be a non-empty list of objects with a \"role\" "
                                     "(and a \"content\")")
            return "chat", msgs
        keys = ", ".join(json.dumps(k) for k in list(obj)[:5]) or "no keys"
        raise MemengineError(f"{where}: a record is {RECORD_SHAPES}; this one has {keys}")
    raise MemengineError(f"{where}: a record is {RECORD_SHAPES}; this one is a JSON {type(obj).__name__}")


def _jsonl_records(src: Source) -> Iterator:
    with open(src.path, "rb") as f:
        n = 0
        offset = 0
        while True:
            interrupts.check()
            line = f.readline(MAX_RECORD_BYTES + 1)
            if not line:
                return
            n += 1
            where = f"{src.name}:{n}"
            if len(line) > MAX_RECORD_BYTES and not line.endswith(b"\n"):
                raise MemengineError(f"{where}: a line longer than {MAX_RECORD_BYTES >> 20} MiB; one record per line")
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _utf8_error(src.name, e, offset) from None
            offset += len(line)
            if n == 1 and text.startswith("\ufeff"):
                text = text[1:]
            if not text.strip():
                continue
            try:
                obj = loads_json(text, where, duplicates=True)
            except json.JSONDecodeError as e:
                raise MemengineError(f"{where}: not valid JSON ({e.msg})") from None
            yield where, _record(obj, where), offset


# ----------------------------------------------------------------------------- the token file
def _dtype(vocab: int):
    return np.uint8 if vocab <= 1 << 8 else np.uint16 if vocab <= 1 << 16 else np.uint32


def tokenizer_fingerprint(tok) -> Optional[str]:
    """sha256 of what decides the tokenizer's ids: its files (the byte-level one: a name)."""
    if getattr(tok, "name", None) == "bytes" and getattr(tok, "path", None) is None:
        return "bytes"
    path = getattr(tok, "path", None)
    if path is None:
        return None
    h = hashlib.sha256()
    for name in (Path(path).name, "tokenizer_config.json", "chat_template.jinja"):
        f = Path(path).parent / name
        if f.is_file():
            h.update(name.encode() + b"\0")
            with open(f, "rb") as fh:
                for raw in iter(lambda: fh.read(PIECE), b""):
                    h.update(raw)
    return h.hexdigest()


@dataclass
class TokenFile:
    """The token stream of some data: `ids` (a read-only memory map), `mask` (1 where the
    token is a trained target; None when all are)."""

    ids: np.ndarray
    mask: Optional[np.ndarray]
    documents: int
    source: str
    sha256: str                  # of the ids as int32 (the data's fingerprint)
    mask_sha256: Optional[str] = None
    path: Optional[Path] = None
    reused: bool = False
    max_id: int = 0

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    def fingerprint(self) -> str:
        return self.sha256


class _Writer:
    FLUSH = 1 << 20

    def __init__(self, d: Path, dtype, vocab_limit: int):
        self.d = d
        self.dtype = dtype
        self.limit = vocab_limit
        self.f = open(d / "tokens.bin", "wb")
        self.m = None
        self.n = 0
        self.sha = hashlib.sha256()
        self.max_id = -1
        self.parts: list = []
        self.masks: list = []
        self.pending = 0
        self.any_masked = False

    def add(self, ids: np.ndarray, mask: Optional[np.ndarray] = None) -> None:
        if ids.size == 0:
            return
        self.parts.append(ids)
        self.masks.append(mask)
        if mask is not None and not self.any_masked and not bool(np.all(mask)):
            self.any_masked = True
        self.pending += ids.size
        if self.pending >= self.FLUSH:
            self.flush()

    def flush(self) -> None:
        if not self.parts:
            return
        ids = np.concatenate([np.asarray(p).reshape(-1) for p in self.parts]).astype(np.int64, copy=False)
        if ids.size and (int(ids.max()) >= self.limit or int(ids.min()) < 0):
            bad = int(ids[(ids >= self.limit) | (ids < 0)][0])
            raise MemengineError(f"the tokenizer gave id {bad:,}, beyond its own vocabulary ({self.limit:,})")
        self.max_id = max(self.max_id, int(ids.max()) if ids.size else -1)
        self.f.write(ids.astype(self.dtype).tobytes())
        self.sha.update(ids.astype("<i4").tobytes())
        if self.any_masked:
            if self.m is None:
                self.m = open(self.d / "mask.bin", "wb")
                left = self.n
                while left:
                    k = min(left, PIECE)
                    self.m.write(b"\x01" * k)
                    left -= k
            self.m.write(np.concatenate([np.ones(p.size, np.uint8) if m is None else np.asarray(m, np.uint8)
                                         for p, m in zip(self.parts, self.masks)]).tobytes())
        self.n += ids.size
        self.parts, self.masks, self.pending = [], [], 0
        if _free_bytes(self.d) < RESERVE:
            raise MemengineError(f"the token cache {self.d.parent} is out of disk space (less than "
                                 f"{RESERVE >> 20} MiB free); set MEMENGINE_CACHE_DIR to a larger disk")

    def close(self) -> Optional[str]:
        self.flush()
        self.f.close()
        if self.m is None:
            return None
        self.m.close()
        h = hashlib.sha256()
        with open(self.d / "mask.bin", "rb") as fh:
            for raw in iter(lambda: fh.read(PIECE), b""):
                h.update(raw)
        return h.hexdigest()


def _overlap_mask(offsets, spans) -> np.ndarray:
    """1 for each token whose characters overlap an assistant span (transformers' rule)."""
    m = np.zeros(len(offsets), np.uint8)
    k = 0
    for j, (s, e) in enumerate(offsets):
        while k < len(spans) and s >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if e > spans[k][0]:
            m[j] = 1
    return m


def _encode(tok, text: str) -> np.ndarray:
    return np.asarray(tok.encode(text), dtype=np.int64).reshape(-1)


def separator_id(tok, vocab_size: int) -> Optional[int]:
    """The id between two documents: the tokenizer's end of text, except the byte-level
    tokenizer's 255 on a model whose vocabulary (below 256) has no such id (then, as for a
    tokenizer without one, a newline)."""
    eos = getattr(tok, "eos_id", None)
    if eos is not None and eos >= vocab_size and getattr(tok, "name", "") == "bytes":
        return None
    return eos


def _tokenize(sources: Sources, tok, w: _Writer, prompt_loss: bool, on_task, vocab_size: int) -> int:
    """Write every document's tokens (and mask) through `w`; returns the documents."""
    eos = separator_id(tok, vocab_size)
    sep = np.array([eos], np.int64) if eos is not None else None
    docs = 0
    template = None
    raw_bytes = getattr(tok, "name", None) == "bytes" and getattr(tok, "path", None) is None
    total = sum(s.size for s in sources.items)
    meter = TaskMeter(on_task, f"tokenizing {sources.description}", total, "bytes")
    done = 0

    def separate():
        nonlocal sep
        if docs:
            if sep is None:
                sep = _encode(tok, "\n")
            w.add(sep)

    try:
        for src in sources.items:
            if not src.jsonl:
                started = False
                for piece in _text_pieces(src, raw_bytes):
                    ids = np.frombuffer(piece, np.uint8) if raw_bytes else _encode(tok, piece)
                    if ids.size and not started:
                        separate()
                        started = True
                    w.add(ids)
                    done += len(piece) if raw_bytes else len(piece.encode("utf-8", "surrogatepass"))
                    meter.update(min(done, total))
                if started:
                    docs += 1
                done = sum(s.size for s in sources.items[:sources.items.index(src) + 1])
                meter.update(done)
                continue
            for where, (kind, payload), at in _jsonl_records(src):
                if kind == "text":
                    if not payload:
                        continue
                    separate()
                    w.add(_encode(tok, payload))
                elif kind == "pc":
                    p, c = _encode(tok, payload[0]), _encode(tok, payload[1])
                    if p.size + c.size == 0:
                        continue
                    separate()
                    mask = None if prompt_loss else np.concatenate([np.zeros(p.size, np.uint8),
                                                                     np.ones(c.size, np.uint8)])
                    w.add(np.concatenate([p, c]), mask)
                else:
                    if template is None:
                        from memengine.engine.io.chat import ChatTemplate

                        template = ChatTemplate.of(tok)
                    try:
                        text, spans = template.render(payload, spans=not prompt_loss)
                    except MemengineError as e:
                        raise MemengineError(f"{where}: {e}") from None
                    if prompt_loss:
                        ids, mask = _encode(tok, text), None
                    else:
                        enc = getattr(tok, "encode_offsets", None)
                        if enc is None:
                            raise MemengineError(f"{where}: a chat record needs a tokenizer.json")
                        ids, offsets = enc(text)
                        ids = np.asarray(ids, np.int64)
                        mask = _overlap_mask(offsets, spans)
                    if ids.size == 0:
                        continue
                    separate()
                    w.add(ids, mask)
                docs += 1
                meter.update(min(done + at, total))
            done += src.size
    finally:
        meter.finish()
    return docs


def _key(sources: Sources, tok, prompt_loss: bool, vocab_size: int) -> Optional[str]:
    fp = tokenizer_fingerprint(tok)
    if fp is None:
        return None
    desc = {"format": FORMAT, "tokenizer": fp, "eos": separator_id(tok, vocab_size), "prompt_loss": bool(prompt_loss),
            "sources": [[s.jsonl, s.sha256] for s in sources.items]}
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:40]


def _open_entry(d: Path, source: str) -> Optional[TokenFile]:
    """A cache entry, checked (None when it is not a complete one)."""
    try:
        meta = read_json(d / "meta.json", "token file record")
        dtype = np.dtype(str(meta["dtype"]))
        n = int(meta["tokens"])
        assert meta.get("format") == FORMAT and dtype in (np.uint8, np.uint16, np.uint32) and n >= 2
        assert (d / "tokens.bin").stat().st_size == n * dtype.itemsize
        ids = np.memmap(d / "tokens.bin", dtype=dtype, mode="r", shape=(n,))
        mask = None
        if meta.get("mask_sha256") is not None:
            assert (d / "mask.bin").stat().st_size == n
            mask = np.memmap(d / "mask.bin", dtype=np.uint8, mode="r", shape=(n,))
        return TokenFile(ids=ids, mask=mask, documents=int(meta["documents"]), source=source,
                         sha256=str(meta["sha256"]), mask_sha256=meta.get("mask_sha256"), path=d,
                         max_id=int(meta["max_id"]))
    except (MemengineError, OSError, KeyError, ValueError, TypeError, AssertionError):
        return None


def token_file(sources: Sources, tok, vocab_size: int, *, prompt_loss: bool = False,
               on_task: Optional[Callable] = None) -> TokenFile:
    """The token file of `sources` under `tok`: from the cache, else tokenized into it."""
    flag, desc = sources.flag, sources.description
    cache_max_bytes()   # its variable checked before the work
    key = _key(sources, tok, prompt_loss, vocab_size)
    root = _ensure(cache_root() / "tokens")
    final = root / key if key is not None else None
    tf = _open_entry(final, desc) if final is not None and final.is_dir() else None
    if tf is not None:
        tf.reused = True
        with contextlib.suppress(OSError):
            os.utime(final / "meta.json")   # used now: the cache's bound removes the least recently used
    else:
        if final is not None and os.path.lexists(final):
            shutil.rmtree(final, ignore_errors=True)  # an incomplete or damaged entry of ours
        limit = int(getattr(tok, "vocab_size", 1 << 31))
        dtype = _dtype(limit)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{os.getpid()}-"))
        try:
            with interrupts.staging_dir(tmp):
                w = _Writer(tmp, dtype, limit)
                try:
                    docs = _tokenize(sources, tok, w, prompt_loss, on_task, vocab_size)
                finally:
                    mask_sha = w.close()
                if docs == 0 or w.n == 0:
                    raise MemengineError(f"{flag} {desc}: no text (the data is empty)")
                if w.n < 2:
                    raise MemengineError(f"{flag} {desc}: only {w.n} token(s); need at least 2")
                meta = {"format": FORMAT, "dtype": np.dtype(dtype).name, "tokens": w.n, "documents": docs,
                        "sha256": w.sha.hexdigest(), "mask_sha256": mask_sha, "max_id": w.max_id,
                        "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
                with open(tmp / "meta.json", "w") as f:
                    json.dump(meta, f)
                if final is None:
                    final = tmp  # a tokenizer without a fingerprint: this run's file only
                    _SPOOLED.append(str(tmp))
                else:
                    try:
                        os.rename(tmp, final)
                    except OSError:  # another run wrote the same entry meanwhile
                        shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        tf = _open_entry(final, desc)
        if tf is None:  # pragma: no cover - the entry was just written
            raise MemengineError(f"{flag} {desc}: the token file {final} cannot be read back")
    trim_cache(keep=tf.path)
    if tf.max_id >= vocab_size:
        _vocab_error(tf, vocab_size, desc)
    return tf


def _vocab_error(tf: TokenFile, vocab_size: int, source: str) -> None:
    first, count = None, 0
    for s in range(0, tf.size, PIECE):
        a = np.asarray(tf.ids[s:s + PIECE])
        bad = a >= vocab_size
        if bad.any():
            count += int(bad.sum())
            if first is None:
                i = int(np.flatnonzero(bad)[0])
                first = (int(a[i]), s + i)
    raise MemengineError(
        f"{source}: token id {first[0]} at position {first[1]} is outside the model's vocabulary "
        f"(0..{vocab_size - 1}); {count} token(s) out of range — wrong tokenizer for this checkpoint?")
