"""`memengine quantize`: every floating tensor of a checkpoint to f16 or bf16 (the codec is
engine/codec.py), with a per-tensor report of sizes and the largest absolute error."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from memengine.engine.errors import MemengineError
from memengine.engine.listener import TaskMeter
from memengine.engine.io.checkpoint import Checkpoint, load_checkpoint, save_checkpoint, side_files
from memengine.engine.io.codec import ENCODERS, decode, encode, normalize_dtype, overflows
from memengine.engine.io.resolve import public_path
from memengine.engine.io.shards import DEFAULT_MAX_SHARD_SIZE

# ------------------------------------------------------------------------- quantize
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


@dataclass
class TensorReport:
    name: str
    shape: tuple[int, ...]
    dtype_before: str
    dtype_after: str
    bytes_before: int
    bytes_after: int
    max_abs_error: float
    saturated: int = 0


@dataclass
class QuantizeReport:
    src: Path
    out_dir: Path | None
    dtype: str
    tensors: list[TensorReport] = field(default_factory=list)
    dry_run: bool = False

    @property
    def n_params(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors)

    @property
    def bytes_before(self) -> int:
        return sum(t.bytes_before for t in self.tensors)

    @property
    def bytes_after(self) -> int:
        return sum(t.bytes_after for t in self.tensors)

    @property
    def max_abs_error(self) -> float:
        return max((t.max_abs_error for t in self.tensors), default=0.0)

    @property
    def saturated(self) -> int:
        return sum(t.saturated for t in self.tensors)

    @property
    def bits_per_weight(self) -> float:
        n = self.n_params
        return 8.0 * self.bytes_after / n if n else 0.0

    def to_dict(self) -> dict:
        return {
            "src": str(self.src),
            "out": str(self.out_dir) if self.out_dir is not None else None,
            "dtype": self.dtype,
            "dry_run": self.dry_run,
            "n_params": self.n_params,
            "bytes_before": self.bytes_before,
            "bytes_after": self.bytes_after,
            "bits_per_weight": self.bits_per_weight,
            "max_abs_error": self.max_abs_error,
            "saturated": self.saturated,
            "tensors": [
                {"name": t.name, "shape": list(t.shape), "dtype_before": t.dtype_before,
                 "dtype_after": t.dtype_after, "bytes_before": t.bytes_before,
                 "bytes_after": t.bytes_after, "max_abs_error": t.max_abs_error,
                 "saturated": t.saturated}
                for t in self.tensors
            ],
        }


def quantize_checkpoint(src, out_dir, dtype: str = "f16", saturate: bool = False,
                        dry_run: bool = False, *, source_name: str | None = None,
                        max_shard_size: int | str | None = None, on_task=None) -> QuantizeReport:
    """Write every tensor of checkpoint `src` (a path, or a loaded Checkpoint) as `dtype`
    (f16 | bf16) into `out_dir`, sharded beyond `max_shard_size` as save_checkpoint does.

    config.json, the tokenizer and the side files (generation and tokenizer configs) come
    along; each file is written atomically; `src` is never modified. `source_name` is what the
    output's metadata records as the source (default: the path if relative, else its base
    name). With `dry_run`, everything is computed and checked but nothing written.
    `on_task`: a Listener's on_task (the tensors converted so far, engine/listener.py)."""
    dt = normalize_dtype(dtype)
    if dt not in ENCODERS:
        raise MemengineError(f"--dtype: quantize writes f16 or bf16, not {dtype!r}")
    if isinstance(src, Checkpoint):   # read already (the caller showed that)
        ckpt = src
    else:
        with TaskMeter(on_task, f"reading {src}", None):
            ckpt = load_checkpoint(src)
    out = Path(out_dir) if out_dir is not None else None
    if out is None and not dry_run:
        raise MemengineError("-o/--out: an output directory is needed")
    if out is not None:
        src_dir = ckpt.path if ckpt.path.is_dir() else ckpt.path.parent
        if out.exists() and not out.is_dir():
            raise MemengineError(f"-o/--out: '{out}' exists and is not a directory")
        if out.exists() and out.resolve() == src_dir.resolve():
            raise MemengineError(f"-o/--out: '{out}' is the input checkpoint's directory; choose another")

    report = QuantizeReport(src=ckpt.path, out_dir=out, dtype=dt, dry_run=dry_run)
    encoded: dict[str, np.ndarray] = {}
    meter = TaskMeter(on_task, f"converting to {dt}", len(ckpt.tensors), "tensors")
    for name, x in ckpt.tensors.items():
        meter.advance()
        bits = encode(x, dt, name=name, saturate=saturate)
        overflow = overflows(x, dt)
        back = decode(bits, dt)
        err = float(np.max(np.abs(back.astype(np.float64) - x.astype(np.float64)))) if x.size else 0.0
        src_dt = ckpt.dtypes.get(name, "F32")
        report.tensors.append(TensorReport(
            name=name, shape=tuple(x.shape), dtype_before=src_dt, dtype_after=dt,
            bytes_before=x.size * _ITEMSIZE.get(src_dt, 4), bytes_after=x.size * 2,
            max_abs_error=err, saturated=int(overflow.sum()),
        ))
        encoded[name] = back  # exactly representable in dt: save_checkpoint re-encodes losslessly
    meter.finish()
    if not dry_run:
        tok = ckpt.tokenizer_path
        with TaskMeter(on_task, f"writing the {dt} checkpoint", None):
            save_checkpoint(out, ckpt.config, encoded, dtype=dt, tokenizer_path=tok,
                            extra_files=side_files(ckpt.directory, tok.parent if tok else None),
                            metadata={"memengine.quantized_from": source_name or public_path(ckpt.path)},
                            max_shard_size=max_shard_size or DEFAULT_MAX_SHARD_SIZE)
    return report
