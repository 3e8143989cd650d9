"""The optimizer-state file beside a checkpoint (optimizer.safetensors): AdamW's moments by
parameter name ("<name>.exp_avg", "<name>.exp_avg_sq") and its step count ("__step__").

A later train or adapt on that checkpoint resumes the moments (SPEC section 4).  A file
that does not fit the model (a moment for a tensor the model lacks, or of another shape)
is one clear error naming the tensor, before any training.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
from memengine.engine.errors import MemengineError

OPTIMIZER_FILE = "optimizer.safetensors"
FORMAT = "memengine-adamw"


def load(path: Path, model, rows: dict | None = None) -> dict | None:
    """The state in `path` (None when there is no file), checked against the model's tensor
    shapes (`model`: name -> shape, or a model with `.shapes`; `rows`: name -> the shape of
    the rows an adapt run trains of it, which its moments may have too): names, pairs, shapes
    and dtypes from the header (strict, engine/safetensors_io.py) before any data is read,
    then the values, all before any use."""
    p = Path(path)
    if not os.path.lexists(p):
        return None
    from memengine.engine.io.safetensors_io import read_header, read_safetensors

    try:
        hdr = read_header(p)  # a FIFO, a device or a malformed header is refused here
    except MemengineError as e:
        raise MemengineError(f"{p}: cannot read optimizer state ({e}){HINT}") from None
    check_header({k: (i.shape, i.dtype) for k, i in hdr.tensors.items()}, model, str(p), rows)
    try:
        state, _, _ = read_safetensors(p)
    except MemengineError as e:
        raise MemengineError(f"{p}: cannot read optimizer state ({e}){HINT}") from None
    check(state, model, str(p), rows)
    return state


# the loss scaler's (scale, finite steps in a row, skipped steps) of a --precision mixed run
LOSS_SCALE_KEY = "__loss_scale__"
# --precision mixed: the f16 operands' per-tensor scale table, [7, slots] int32
# (engine/kernels/matmul.py F16Scales: exponents, amax, changes, least/greatest exponent, last amax,
# committed exponents)
F16_SCALES_KEY = "__f16_scales__"
F16_EXP_RANGE = (-115, 60)   # (F16_EXP_MIN, F16_EXP_MAX) of engine/kernels/matmul.py


HINT = "; delete it to start the moments from zero"
_NUMBERS = {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8"}


def _bad(where: str, key: str, why: str) -> MemengineError:
    return MemengineError(f"{where}: optimizer state entry '{key}' {why}{HINT}")


def _shapes(model) -> dict:
    shapes = getattr(model, "shapes", model) or {}
    return {n: tuple(int(d) for d in s) for n, s in dict(shapes).items()}


def _gpu_shape(name: str, shape: tuple) -> tuple:
    # conv1d weight is stored [Di, 1, K] in a checkpoint, [Di, K] on the GPU (older states)
    return tuple(shape[:1]) + tuple(shape[2:]) if name.endswith("conv1d.weight") else tuple(shape)


def check_header(entries: dict, model, where: str, rows: dict | None = None) -> None:
    """Every entry (name -> (shape, safetensors dtype)) is '__step__' (one number),
    '__loss_scale__' (--precision mixed: three F32 numbers), '__f16_scales__' (--precision
    mixed: an I32 table [7, slots]) or one of
    a pair of F32 moments ('<tensor>.exp_avg', '<tensor>.exp_avg_sq') of a tensor of the
    model, of that tensor's shape.  The first problem is one MemengineError naming the entry."""
    shapes = _shapes(model)
    moments = 0
    for key in sorted(entries):
        shape, dtype = entries[key]
        shape = tuple(int(d) for d in shape)
        if key == "__step__":
            if math.prod(shape) != 1:
                raise _bad(where, key, f"holds {math.prod(shape)} values, not one step count")
            if str(dtype).upper() not in _NUMBERS:
                raise _bad(where, key, f"is {dtype}, not a number")
            continue
        if key == LOSS_SCALE_KEY:
            if shape != (3,) or str(dtype).upper() != "F32":
                raise _bad(where, key, "is not three float32 numbers (scale, good steps, skipped steps)")
            continue
        if key == F16_SCALES_KEY:
            if len(shape) != 2 or shape[0] != 7 or shape[1] < 1 or str(dtype).upper() != "I32":
                raise _bad(where, key, "is not an int32 table of 7 rows (the f16 scales)")
            continue
        if key.endswith(".exp_avg_sq"):
            name, other = key[: -len(".exp_avg_sq")], "exp_avg"
        elif key.endswith(".exp_avg"):
            name, other = key[: -len(".exp_avg")], "exp_avg_sq"
        else:
            raise _bad(where, key, "is not an AdamW moment ('<tensor>.exp_avg' / '<tensor>.exp_avg_sq') or "
                                   "'__step__'")
        if f"{name}.{other}" not in entries:
            raise _bad(where, key, f"has no pair '{name}.{other}'")
        if name not in shapes:
            raise _bad(where, key, f"is for tensor '{name}', which this model does not have (the state belongs "
                                   "to another model)")
        want = shapes[name]
        part = tuple(int(d) for d in (rows or {}).get(name, want))
        if shape not in (want, _gpu_shape(name, want), part):
            raise _bad(where, key, f"has shape {list(shape)}; the model's tensor '{name}' has {list(want)} (the "
                                   "state belongs to another model)")
        if str(dtype).upper() not in ("F32", "FLOAT32"):
            raise _bad(where, key, f"is {dtype}, not float32 (F32)")
        moments += 1
    if moments and "__step__" not in entries:
        raise MemengineError(f"{where}: optimizer state has moments but no '__step__' entry (the step count the "
                             f"bias correction needs){HINT}")


def check(state: dict, model, where: str, rows: dict | None = None) -> None:
    """`check_header` on the arrays, then the values: '__step__' a finite integer >= 0,
    moments finite, second moments >= 0."""
    def st_dtype(a) -> str:  # numpy's dtype under its safetensors name (F32, I64, ...)
        d = np.asarray(a).dtype
        return f"{'F' if d.kind == 'f' else 'I' if d.kind == 'i' else 'U' if d.kind == 'u' else d.name}{8 * d.itemsize}"

    check_header({k: (np.shape(a), st_dtype(a)) for k, a in state.items()}, model, where, rows)
    for key in sorted(state):
        arr = np.asarray(state[key])
        if key == LOSS_SCALE_KEY:
            if not (np.isfinite(arr).all() and float(arr.reshape(-1)[0]) > 0):
                raise _bad(where, key, "is not a positive finite loss scale")
            continue
        if key == F16_SCALES_KEY:
            lo, hi = F16_EXP_RANGE
            e = arr[[0, 3, 4, 6]]
            if e.min() < lo or e.max() > hi or arr[0, 0] != 0 or (arr[2] < 0).any():
                raise _bad(where, key, f"holds exponents outside [{lo}, {hi}], a unit slot that is not 1 or "
                                       "negative counts")
            continue
        if key == "__step__":
            v = float(arr.reshape(-1)[0])
            if not math.isfinite(v) or v < 0 or v != int(v) or v >= 2 ** 53:
                raise _bad(where, key, f"is {v!r}, not a step count (an integer >= 0)")
            continue
        if not np.isfinite(arr).all():
            raise _bad(where, key, "holds NaN or infinite values")
        if key.endswith(".exp_avg_sq") and (arr < 0).any():
            raise _bad(where, key, "holds negative values (a second moment is a mean of squares)")


def save(directory: Path, state: dict | None) -> None:
    """Write `state` (AdamW.state_dict()) as optimizer.safetensors in `directory`."""
    if not state:
        return
    from memengine.engine.io.safetensors_io import write_safetensors

    arrays = {k: np.ascontiguousarray(state[k]) for k in sorted(state)}
    write_safetensors(Path(directory) / OPTIMIZER_FILE, arrays, metadata={"format": FORMAT})


def step_count(state: dict | None) -> int:
    if not state or "__step__" not in state:
        return 0
    v = float(np.asarray(state["__step__"]).reshape(-1)[0])
    return int(v) if math.isfinite(v) else 0
