"""Tokenizers: the built-in byte-level one (UTF-8 bytes, ids 0..255, no download) or a HF
`tokenizer.json` (via `tokenizers`) beside the checkpoint or given with `--tokenizer`.

`eos_id` is the end-of-text token that separates documents in training data.  The
byte-level tokenizer uses 255: the byte 0xFF never occurs in UTF-8 text, so the separator
can never be confused with text.  A tokenizer.json uses the `eos_token` of a
tokenizer_config.json beside it, else the first of the usual end-of-text tokens it has
(`<|endoftext|>`, `</s>`, `<eos>`, `<|end_of_text|>`), else none (documents are then
joined with a newline).  Both files are read as untrusted (engine/inputs.py): a FIFO, a
device, a file too large or JSON nested too deep is one error line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Protocol, runtime_checkable

import numpy as np
from memengine.engine.errors import MemengineError
from memengine.engine.hostmem import check_fits
from memengine.engine.io.inputs import check_regular, read_json

TOKENIZER_FILE = "tokenizer.json"
MAX_ID = 2**31 - 1  # token ids are i32 on the GPU
JSON_EXPANSION = 10  # host bytes per byte of tokenizer.json once `tokenizers` has parsed it (generous)
BYTE_NAMES = ("bytes", "byte", "byte-level")
BYTE_EOS = 0xFF  # never a byte of UTF-8 text
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


@runtime_checkable
class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: Optional[int]

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255."""

    name = "bytes"
    vocab_size = 256
    eos_id = BYTE_EOS

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", errors="surrogatepass"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        a = np.asarray(ids, dtype=np.int64).reshape(-1)
        a = a[(a >= 0) & (a < 256)]  # ids beyond the byte range (bigger model vocab) are dropped
        return a.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json. Text is encoded without special tokens."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        size = check_regular(self.path, "tokenizer file").st_size
        check_fits(JSON_EXPANSION * size, f"tokenizer file '{self.path}' ({size:,} bytes)",
                   "is it the right file? a tokenizer.json is rarely more than tens of MB")
        try:
            from tokenizers import Tokenizer as _Tok
        except ImportError:  # pragma: no cover
            raise MemengineError("the 'tokenizers' package is needed to read tokenizer.json") from None
        try:
            self._tok = _Tok.from_file(str(self.path))
        except Exception as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise MemengineError(f"tokenizer '{self.path}' cannot be loaded: {msg[:200]}") from None
        self.name = str(self.path)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eos_id = self._find_eos()

    def _find_eos(self) -> Optional[int]:
        cfg = self.path.parent / "tokenizer_config.json"
        if os.path.lexists(cfg):  # a FIFO, a device, a huge or a nested-bomb file there is refused
            data = read_json(cfg, "tokenizer config")
            tok = data.get("eos_token") if isinstance(data, dict) else None
            if isinstance(tok, dict):
                tok = tok.get("content")
            if isinstance(tok, str) and self._tok.token_to_id(tok) is not None:
                return int(self._tok.token_to_id(tok))
        for name in EOS_NAMES:
            i = self._tok.token_to_id(name)
            if i is not None:
                return int(i)
        return None

    def encode(self, text: str) -> np.ndarray:
        ids = np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)
        if ids.size and int(ids.max()) > MAX_ID:
            i = int(np.argmax(ids > MAX_ID))
            raise MemengineError(f"tokenizer '{self.path}': token id {int(ids[i]):,} (position {i}) is beyond 32-bit "
                                 "token ids; this tokenizer cannot serve a memengine model")
        return ids.astype(np.int32)

    def encode_offsets(self, text: str) -> tuple[np.ndarray, list]:
        """(ids, [(start, end)] character offsets of each token in `text`)."""
        enc = self._tok.encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int64)
        if ids.size and int(ids.max()) > MAX_ID:
            return self.encode(text), []  # raises, naming the id
        return ids, list(enc.offsets)

    def decode(self, ids) -> str:
        a = np.asarray(ids, dtype=np.int64).reshape(-1)
        return self._tok.decode([int(i) for i in a], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r})"


def load_tokenizer(checkpoint_dir: str | Path | None, override: str | None = None) -> Tokenizer:
    """`override` (--tokenizer: a tokenizer.json, a directory holding one, or "bytes") wins;
    else tokenizer.json beside the checkpoint (dir, or the bare file's dir); else bytes."""
    if override is not None and str(override) != "":
        if str(override).lower() in BYTE_NAMES:
            return ByteTokenizer()
        p = Path(override)
        if p.is_dir():
            p = p / TOKENIZER_FILE
        if not p.exists():
            raise MemengineError(f"--tokenizer: '{override}' not found (give a tokenizer.json, its directory, or 'bytes')")
        return HFTokenizer(p)  # refuses a FIFO or device
    if checkpoint_dir is not None:
        d = Path(checkpoint_dir)
        if not d.is_dir():
            d = d.parent
        p = d / TOKENIZER_FILE
        if p.exists():  # a FIFO or device there is refused, not skipped for the byte-level tokenizer
            return HFTokenizer(p)
    return ByteTokenizer()
