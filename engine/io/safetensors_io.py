"""Our own safetensors reader and writer, with strict validation.

Format: 8-byte little-endian u64 header length n, n bytes of UTF-8 JSON
`{"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
"__metadata__": {str: str}}`, then the data buffer (offsets are relative to it).

Anything wrong with a file (too short, header length beyond the file, bad JSON, bad
entries, offsets out of range / overlapping / not matching shape x dtype, unknown dtype,
truncated data) raises `MemengineError` naming the file and, where there is one, the tensor.

Floating tensors decode exactly to float32 (F64 is rounded to f32). bfloat16 is written from
uint16 bit patterns wrapped in `BF16Bits` (numpy has no bfloat16); float16 from np.float16
arrays (or `F16Bits`).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from memengine.engine.errors import MemengineError
from memengine.engine.io.codec import bf16_bits_to_f32, f16_bits_to_f32
from memengine.engine.io.inputs import loads_json, open_regular
from memengine.engine.io.staging import atomic_write_bytes

MAX_HEADER_BYTES = 100_000_000  # the limit of the reference implementation

# dtype -> (numpy storage dtype, item size)
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("<f8", 8), "F32": ("<f4", 4), "F16": ("<u2", 2), "BF16": ("<u2", 2),
    "I64": ("<i8", 8), "I32": ("<i4", 4), "I16": ("<i2", 2), "I8": ("i1", 1),
    "U64": ("<u8", 8), "U32": ("<u4", 4), "U16": ("<u2", 2), "U8": ("u1", 1), "BOOL": ("?", 1),
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


@dataclass(frozen=True)
class BF16Bits:
    """Marker for writing: `bits` are uint16 bfloat16 bit patterns."""

    bits: np.ndarray


@dataclass(frozen=True)
class F16Bits:
    """Marker for writing: `bits` are uint16 IEEE half bit patterns."""

    bits: np.ndarray


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass
class SafetensorsHeader:
    path: Path
    tensors: dict[str, TensorInfo]  # in file order
    metadata: dict[str, str]
    data_start: int  # absolute file offset of the data buffer
    file_size: int


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate written as a \\ud800 escape
        return False
    return True


def read_header(path: str | Path) -> SafetensorsHeader:
    """Parse and validate the header of a safetensors file (reads no tensor data).

    As strict as the reference implementation (`safetensors`): the tensors' data_offsets,
    taken in order, must cover the data buffer exactly (no byte before the first tensor,
    between two, or after the last), each span must equal shape x dtype size, and the
    header must be a UTF-8 JSON object of at most 100,000,000 bytes without NaN, negative or
    non-integer numbers. Stricter on purpose: duplicate keys and unknown entry fields are
    refused rather than silently resolved."""
    path = Path(path)
    try:
        with open_regular(path, "model file") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise MemengineError(f"{path}: not a safetensors file (only {size} bytes, the header length needs 8)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise MemengineError(f"{path}: header length {n} is implausibly large (corrupt or not safetensors)")
            if 8 + n > size:
                raise MemengineError(f"{path}: header length {n} runs beyond the end of the file ({size} bytes); truncated or corrupt")
            raw = f.read(n)
    except MemengineError:
        raise
    except OSError as e:
        raise MemengineError(f"{path}: cannot read ({e.strerror or e})") from None
    if len(raw) != n:
        raise MemengineError(f"{path}: truncated while reading the header")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MemengineError(f"{path}: header is not valid UTF-8 ({e.reason} at byte {8 + e.start})") from None
    if not text.lstrip(" \t\r\n").startswith("{"):
        raise MemengineError(f"{path}: header must be a JSON object (it does not start with '{{'); not a safetensors file")
    hdr = loads_json(text, f"{path}: header", constants=False, negative=False)
    if not isinstance(hdr, dict):
        raise MemengineError(f"{path}: header must be a JSON object, got {type(hdr).__name__}")

    metadata: dict[str, str] = {}
    meta = hdr.pop("__metadata__", None)
    if meta is not None:
        if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise MemengineError(f"{path}: __metadata__ must map strings to strings")
        if not all(_utf8(k) and _utf8(v) for k, v in meta.items()):
            raise MemengineError(f"{path}: __metadata__ holds a string that is not valid UTF-8 (a lone surrogate escape)")
        metadata = dict(meta)

    data_size = size - 8 - n
    tensors: dict[str, TensorInfo] = {}
    for name, e in hdr.items():
        if not _utf8(name):
            raise MemengineError(f"{path}: a tensor name {name.encode('utf-8', 'backslashreplace')[:80]!r} is not valid "
                                 "UTF-8 (a lone surrogate escape)")
        where = f"{path}: tensor '{name}'"
        if not isinstance(e, dict):
            raise MemengineError(f"{where}: entry must be an object")
        dtype, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if not isinstance(dtype, str):
            raise MemengineError(f"{where}: missing or non-string 'dtype'")
        if dtype not in DTYPES:
            raise MemengineError(f"{where}: unknown or unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise MemengineError(f"{where}: 'shape' must be a list of non-negative integers, got {shape!r}"[:300])
        if len(shape) > 16:
            raise MemengineError(f"{where}: {len(shape)} dimensions is implausible")
        if not isinstance(offs, list) or len(offs) != 2 or not all(_is_int(o) for o in offs):
            raise MemengineError(f"{where}: 'data_offsets' must be [begin, end] integers, got {offs!r}"[:300])
        begin, end = offs
        if begin < 0 or end < begin:
            raise MemengineError(f"{where}: bad data_offsets [{begin}, {end}]")
        if end > data_size:
            raise MemengineError(
                f"{where}: data_offsets [{begin}, {end}] run beyond the data ({data_size} bytes); file truncated or corrupt"
            )
        nbytes = math.prod(shape) * DTYPES[dtype][1]
        if end - begin != nbytes:
            raise MemengineError(
                f"{where}: data_offsets span {end - begin} bytes but shape {shape} x {dtype} needs {nbytes}"
            )
        extra = set(e) - {"dtype", "shape", "data_offsets"}
        if extra:
            raise MemengineError(f"{where}: unexpected key(s) {sorted(extra)}")
        tensors[name] = TensorInfo(name, dtype, tuple(shape), begin, end)
    _check_coverage(path, tensors, data_size)
    return SafetensorsHeader(path, tensors, metadata, 8 + n, size)


def _check_coverage(path: Path, tensors: dict[str, TensorInfo], data_size: int) -> None:
    """The spans, in (begin, end) order, must tile the data buffer [0, data_size) exactly,
    as the reference implementation requires: bytes that belong to no tensor (before the
    first, between two, after the last) or to two tensors mean a corrupt or doctored file."""
    pos, prev = 0, None
    for t in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if t.begin < pos:
            p = tensors[prev]
            raise MemengineError(f"{path}: tensors '{prev}' (bytes {p.begin}..{p.end}) and '{t.name}' (bytes "
                                 f"{t.begin}..{t.end}) overlap; corrupt or doctored file")
        if t.begin > pos:
            where = f"before tensor '{t.name}', the first in the data," if prev is None else \
                f"between tensors '{prev}' and '{t.name}'"
            raise MemengineError(f"{path}: data bytes {pos}..{t.begin} {where} belong to no tensor; the offsets must "
                                 "cover the data exactly (corrupt, or not written by a safetensors writer)")
        pos, prev = t.end, t.name
    if pos != data_size:
        where = f"after the last tensor '{prev}'" if prev is not None else "(the header lists no tensor)"
        raise MemengineError(f"{path}: {data_size - pos} data byte(s) {where} belong to no tensor; the offsets must "
                             "cover the data exactly (corrupt, or something was appended to the file)")


def _decode(buf: bytes, info: TensorInfo, raw: bool) -> np.ndarray:
    npdt, _ = DTYPES[info.dtype]
    a = np.frombuffer(buf, dtype=npdt).reshape(info.shape)
    if raw:
        return a.astype(a.dtype.newbyteorder("="), copy=True)
    if info.dtype == "F32":
        return a.astype(np.float32, copy=True)
    if info.dtype == "F64":
        with np.errstate(over="ignore"):
            return a.astype(np.float32)
    if info.dtype == "F16":
        return f16_bits_to_f32(a).reshape(info.shape)
    if info.dtype == "BF16":
        return bf16_bits_to_f32(a).reshape(info.shape)
    return a.astype(a.dtype.newbyteorder("="), copy=True)


def read_safetensors(path: str | Path, *, names: list[str] | None = None, raw: bool = False
                     ) -> tuple[dict[str, np.ndarray], dict[str, str], dict[str, str]]:
    """Read a safetensors file -> (tensors, dtypes, metadata).

    Floating tensors come back as float32 (decoded exactly); integer/bool ones in their own
    numpy dtype. With `raw`, F16/BF16 come back as their uint16 bit patterns instead.
    `names` restricts reading to those tensors (unknown name -> MemengineError).
    """
    hdr = read_header(path)
    want = list(hdr.tensors) if names is None else list(names)
    for nm in want:
        if nm not in hdr.tensors:
            raise MemengineError(f"{hdr.path}: no tensor named '{nm}'")
    tensors: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    try:
        with open_regular(hdr.path, "model file") as f:
            for nm in want:
                info = hdr.tensors[nm]
                f.seek(hdr.data_start + info.begin)
                n = info.end - info.begin
                buf = f.read(n)
                if len(buf) != n:
                    raise MemengineError(f"{hdr.path}: tensor '{nm}': file truncated while reading its data")
                tensors[nm] = _decode(buf, info, raw)
                dtypes[nm] = info.dtype
    except MemengineError:
        raise
    except OSError as e:
        raise MemengineError(f"{hdr.path}: cannot read ({e.strerror or e})") from None
    return tensors, dtypes, hdr.metadata


# --------------------------------------------------------------------------- writing
_NP_TO_ST = {
    np.dtype("float64"): "F64", np.dtype("float32"): "F32", np.dtype("float16"): "F16",
    np.dtype("int64"): "I64", np.dtype("int32"): "I32", np.dtype("int16"): "I16", np.dtype("int8"): "I8",
    np.dtype("uint64"): "U64", np.dtype("uint32"): "U32", np.dtype("uint16"): "U16", np.dtype("uint8"): "U8",
    np.dtype("bool"): "BOOL",
}


def _as_storage(name: str, value: Any) -> tuple[str, np.ndarray]:
    if isinstance(value, BF16Bits):
        bits = np.asarray(value.bits)
        if bits.dtype != np.uint16:
            raise MemengineError(f"tensor '{name}': BF16Bits needs a uint16 array, got {bits.dtype}")
        return "BF16", bits
    if isinstance(value, F16Bits):
        bits = np.asarray(value.bits)
        if bits.dtype != np.uint16:
            raise MemengineError(f"tensor '{name}': F16Bits needs a uint16 array, got {bits.dtype}")
        return "F16", bits
    a = np.asarray(value)
    st = _NP_TO_ST.get(a.dtype.newbyteorder("="))
    if st is None:
        raise MemengineError(f"tensor '{name}': cannot store numpy dtype {a.dtype} in safetensors")
    return st, a


def write_safetensors(path: str | Path, tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> Path:
    """Write `tensors` (name -> ndarray | BF16Bits | F16Bits) atomically to `path`, in the given order."""
    path = Path(path)
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise MemengineError(f"{path}: safetensors metadata must map strings to strings")
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    arrays: list[np.ndarray] = []
    offset = 0
    for name, value in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise MemengineError(f"{path}: invalid tensor name {name!r}")
        st, a = _as_storage(name, value)
        a = np.asarray(a, dtype=a.dtype.newbyteorder("<") if a.dtype.itemsize > 1 else a.dtype)
        if not a.flags.c_contiguous:
            a = a.copy(order="C")
        nbytes = a.nbytes
        header[name] = {"dtype": st, "shape": list(a.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        arrays.append(a)
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hjson += b" " * (-len(hjson) % 8)  # align the data buffer to 8 bytes

    def chunks():
        yield struct.pack("<Q", len(hjson))
        yield hjson
        for a in arrays:
            yield a.reshape(-1).view(np.uint8).data if a.size else b""

    try:
        atomic_write_bytes(path, chunks())
    except OSError as e:
        raise MemengineError(f"{path}: cannot write ({e.strerror or e})") from None
    return path
