"""Training data: documents in, one token stream (documents separated by the tokenizer's
end-of-text token), windows of (input, next-token target), fixed-shape batches (SPEC §4)."""

from __future__ import annotations

import hashlib
import json
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from memengine.engine.errors import MemengineError
from memengine.engine.hostmem import check_fits
from memengine.engine.io.inputs import decode_utf8, file_kind, loads_json, stat_input

DEMO_TEXT = Path(__file__).resolve().parent.parent / "data" / "demo.txt"
IGNORE = -1



def _read_jsonl(text: str, source: str) -> list[str]:
    docs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = loads_json(line, f"{source}:{n}", duplicates=True)
        except json.JSONDecodeError as e:
            raise MemengineError(f"{source}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or "text" not in obj:
            raise MemengineError(f"{source}:{n}: expected an object with a \"text\" field")
        if not isinstance(obj["text"], str):
            raise MemengineError(f"{source}:{n}: the \"text\" field must be a string")
        if obj["text"]:
            docs.append(obj["text"])
    return docs


def _check_data_file(path: Path, given: str) -> None:
    """Before reading a data file: a device (/dev/zero never ends), a socket or a directory
    is refused; a regular file must fit in host memory.  A FIFO is read: it is what a shell's
    `<(command)` gives."""
    st = stat_input(given, "data file")
    if stat.S_ISREG(st.st_mode):
        check_fits(st.st_size, f"data file '{given}' ({st.st_size:,} bytes)",
                   "is it the right file? split it, or train on part of it")
    elif not stat.S_ISFIFO(st.st_mode):
        raise MemengineError(f"data file '{given}' is {file_kind(st.st_mode)}, not a text file")


def read_documents(paths: list[str] | str, stdin: BinaryIO | None = None) -> list[str]:
    """The documents of `paths` ('-' = stdin): a text file is one document, each line of a
    *.jsonl file is one (its "text" field).  A missing, undecodable or empty source raises
    MemengineError naming it."""
    if isinstance(paths, (str, Path)):
        paths = [str(paths)]
    if not paths:
        raise MemengineError("no training data given (pass a text file, a .jsonl file, or '-' for stdin)")
    docs: list[str] = []
    for p in paths:
        p = str(p)
        if p == "-":
            src = "stdin"
            stream = stdin if stdin is not None else getattr(sys.stdin, "buffer", None)
            if stream is None:
                raw = sys.stdin.read().encode("utf-8")
            else:
                raw = stream.read()
                if isinstance(raw, str):
                    raw = raw.encode("utf-8")
            found = [decode_utf8(raw, src)]
        else:
            path = Path(p)
            _check_data_file(path, p)
            try:
                raw = path.read_bytes()
            except FileNotFoundError:
                raise MemengineError(f"data file '{p}' not found") from None
            except IsADirectoryError:
                raise MemengineError(f"data file '{p}' is a directory") from None
            except OSError as e:
                raise MemengineError(f"data file '{p}': cannot read ({e.strerror or e})") from None
            text = decode_utf8(raw, f"data file '{p}'")
            found = _read_jsonl(text, p) if path.suffix.lower() == ".jsonl" else [text]
        if not any(found):
            raise MemengineError(f"{'stdin' if p == '-' else repr(p)}: no text (the data is empty)")
        docs.extend(d for d in found if d)
    return docs


def tokenize_documents(docs: list[str], tokenizer, vocab_size: int | None = None) -> np.ndarray:
    """One token stream: each document's tokens, an end-of-text token (`tokenizer.eos_id`)
    between two documents.  A tokenizer without one joins the documents with a newline, and
    so does the byte-level tokenizer for a model whose vocabulary (`vocab_size`, below 256)
    has no id 255 for it."""
    eos = getattr(tokenizer, "eos_id", None)
    if eos is not None and vocab_size is not None and eos >= vocab_size and getattr(tokenizer, "name", "") == "bytes":
        eos = None
    if eos is None:
        return np.asarray(tokenizer.encode("\n".join(docs)), dtype=np.int32).reshape(-1)
    parts: list[np.ndarray] = []
    sep = np.array([eos], dtype=np.int32)
    for i, d in enumerate(docs):
        if i:
            parts.append(sep)
        parts.append(np.asarray(tokenizer.encode(d), dtype=np.int32).reshape(-1))
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def describe_sources(paths: list[str]) -> str:
    return ", ".join("stdin" if str(p) == "-" else str(p) for p in paths)


@dataclass
class TokenStream:
    ids: np.ndarray        # int32, the whole stream
    documents: int
    source: str            # for messages: "a.txt, b.jsonl"

    def fingerprint(self) -> str:
        """sha256 of the ids (a resumed run checks that its data is the same)."""
        return hashlib.sha256(np.ascontiguousarray(self.ids, np.int32).tobytes()).hexdigest()


def read_sources(paths: list[str], flag: str = "--data") -> tuple[list[str], str]:
    """(documents, a description for messages) of the data a flag names (read once: stdin
    cannot be read twice)."""
    if not paths:
        raise MemengineError(f"{flag} is required (a file, several files, or - for stdin)")
    for p in paths:
        if p != "-" and not Path(p).exists():
            raise MemengineError(f"{flag} {p}: file not found")
        if p != "-" and Path(p).is_dir():
            raise MemengineError(f"{flag} {p}: is a directory, expected a text file")
    source = describe_sources(paths)
    docs = read_documents(list(paths))
    if not any(d.strip() for d in docs):
        raise MemengineError(f"{flag} {source}: no text (empty data)")
    return docs, source


def token_stream(docs: list[str], source: str, tokenizer, vocab_size: int, flag: str = "--data") -> TokenStream:
    """Tokenize and check documents (SPEC section 4)."""
    ids = tokenize_documents(docs, tokenizer, vocab_size)
    if ids.size < 2:
        raise MemengineError(f"{flag} {source}: only {ids.size} token(s); need at least 2")
    check_vocab(ids, vocab_size, source)
    return TokenStream(ids=ids, documents=len(docs), source=source)


def check_vocab(ids: np.ndarray, vocab_size: int, source: str = "data") -> None:
    """Every id must be in [0, vocab_size): else one line naming the source, id and position."""
    a = np.asarray(ids).reshape(-1)
    if a.size == 0:
        return
    bad = (a < 0) | (a >= vocab_size)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise MemengineError(
            f"{source}: token id {int(a[i])} at position {i} is outside the model's vocabulary "
            f"(0..{vocab_size - 1}); {int(bad.sum())} token(s) out of range — wrong tokenizer for this checkpoint?")


def make_windows(ids: np.ndarray, seq_len: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Cut the token stream into windows of up to `seq_len` inputs, each with next-token targets.

    Window k covers inputs ids[k*L : k*L+L] and targets ids[k*L+1 : k*L+L+1]; the final
    partial window is kept when it has at least 2 tokens (one input, one target)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r} (TrainOptions validates the flag)")
    a = np.asarray(ids).reshape(-1).astype(np.int32)
    if a.size < 2:
        raise MemengineError(
            f"the data holds {a.size} token(s); at least 2 are needed (an input and its next-token target)")
    L = int(seq_len)
    out = []
    for s in range(0, a.size - 1, L):
        n = min(L, a.size - 1 - s)
        out.append((a[s:s + n].copy(), a[s + 1:s + 1 + n].copy()))
    return out


@dataclass
class Batch:
    ids: np.ndarray  # int32 [B, L], padded with 0
    targets: np.ndarray  # int32 [B, L], -1 = ignore
    n_targets: int  # targets that count (!= -1)
    n_tokens: int  # real input tokens (== n_targets)
    n_windows: int = 0  # real rows


def make_batches(windows: list[tuple[np.ndarray, np.ndarray]], batch_size: int, seq_len: int) -> list[Batch]:
    """Group windows, in order, into batches of exactly [batch_size, seq_len] (padding rows and
    positions have id 0 and target -1) so the GPU shapes never change."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
    B, L = int(batch_size), int(seq_len)
    batches = []
    for start in range(0, len(windows), B):
        group = windows[start:start + B]
        ids = np.zeros((B, L), dtype=np.int32)
        tg = np.full((B, L), IGNORE, dtype=np.int32)
        n = 0
        for r, (x, y) in enumerate(group):
            if len(x) != len(y) or len(x) > L:
                raise ValueError(f"window {start + r}: {len(x)} inputs / {len(y)} targets do not fit seq_len {L}")
            ids[r, :len(x)] = x
            tg[r, :len(y)] = y
            n += len(x)
        batches.append(Batch(ids=ids, targets=tg, n_targets=int((tg >= 0).sum()), n_tokens=n,
                             n_windows=len(group)))
    return batches


def targets_of(windows) -> int:
    """Targets that count (not IGNORE) in a list of (inputs, targets) windows."""
    return sum(int((np.asarray(y) >= 0).sum()) for _, y in windows)


class Windows:
    """The windows of a token stream (`make_windows`' cut) read on demand from `ids` (a
    memory map of a token file, or any array): window k is inputs ids[kL : kL+L] and targets
    ids[kL+1 : kL+L+1], a target whose token `mask` marks 0 being IGNORE (a prompt's tokens).
    `held`: the sorted window numbers a view leaves out (the training side of
    --val-fraction); `index`: the window numbers a view keeps (its held-out side)."""

    def __init__(self, ids, seq_len: int, mask=None, *, held=None, index=None):
        self.ids, self.mask, self.L = ids, mask, int(seq_len)
        n_ids = int(np.shape(ids)[0])
        if n_ids < 2:
            raise MemengineError(
                f"the data holds {n_ids} token(s); at least 2 are needed (an input and its next-token target)")
        self.total = -(-(n_ids - 1) // self.L)
        self.held = None if held is None else np.asarray(held, np.int64)
        self.index = None if index is None else np.asarray(index, np.int64)
        self._gaps = None if self.held is None else self.held - np.arange(self.held.size)

    def __len__(self) -> int:
        if self.index is not None:
            return int(self.index.size)
        return self.total - (0 if self.held is None else int(self.held.size))

    def number(self, i: int) -> int:
        """The window number (in the whole stream) of this view's i-th window."""
        if self.index is not None:
            return int(self.index[i])
        if self.held is None:
            return int(i)
        return int(i) + int(np.searchsorted(self._gaps, i, side="right"))

    def __getitem__(self, i):
        i = int(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        k = self.number(i)
        s = k * self.L
        n = min(self.L, int(np.shape(self.ids)[0]) - 1 - s)
        x = np.asarray(self.ids[s:s + n], dtype=np.int32)
        y = np.asarray(self.ids[s + 1:s + 1 + n], dtype=np.int32)
        if self.mask is not None:
            y = y.copy()
            y[np.asarray(self.mask[s + 1:s + 1 + n]) == 0] = IGNORE
        return x, y

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def without(self, held) -> "Windows":
        return Windows(self.ids, self.L, self.mask, held=np.sort(np.asarray(held, np.int64)))

    def only(self, index) -> "Windows":
        return Windows(self.ids, self.L, self.mask, index=np.asarray(index, np.int64))


class Batches:
    """`make_batches` of a window sequence, made as they are read (a pass over a large
    corpus holds one batch at a time)."""

    def __init__(self, windows, batch_size: int, seq_len: int):
        self.windows, self.B, self.L = windows, int(batch_size), int(seq_len)
        self.shape = (self.B, self.L)
        self.n_windows = len(windows)

    def __len__(self) -> int:
        return -(-self.n_windows // self.B)

    def __getitem__(self, k: int) -> Batch:
        k = int(k)
        if not 0 <= k < len(self):
            raise IndexError(k)
        s = k * self.B
        return make_batches([self.windows[j] for j in range(s, min(s + self.B, self.n_windows))], self.B, self.L)[0]

    def __iter__(self):
        for k in range(len(self)):
            yield self[k]


def window_count(batches) -> int:
    """Real windows in a list of batches or a `Batches`."""
    if batches is None:
        return 0
    if isinstance(batches, Batches):
        return batches.n_windows
    return sum(b.n_windows for b in batches)
