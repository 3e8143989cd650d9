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

from .errors import MemengineError

OPTIMIZER_FILE = "optimizer.safetensors"
FORMAT = "memengine-adamw"


def path_beside(checkpoint: Path) -> Path:
    p = Path(checkpoint)
    return (p if p.is_dir() else p.parent) / OPTIMIZER_FILE


def load(path: Path, model) -> dict | None:
    """The state in `path` (None when there is no file), checked against `model`: names,
    shapes and dtypes from the header (strict, engine/safetensors_io.py) before any data is
    read, then the values."""
    p = Path(path)
    if not os.path.lexists(p):
        return None
    from .safetensors_io import read_header, read_safetensors

    try:
        hdr = read_header(p)  # a FIFO, a device or a malformed header is refused here
    except MemengineError as e:
        raise MemengineError(f"{p}: cannot read optimizer state ({e})") from None
    check_header({k: (i.shape, i.dtype) for k, i in hdr.tensors.items()}, model, str(p))
    try:
        state, _, _ = read_safetensors(p)
    except MemengineError as e:
        raise MemengineError(f"{p}: cannot read optimizer state ({e})") from None
    check(state, model, str(p))
    return state


def check_header(entries: dict, model, where: str) -> None:
    """Every entry (name -> (shape, safetensors dtype)) names a tensor of `model` with an F32
    moment of that tensor's shape; '__step__' is one number."""
    for key, (shape, dtype) in entries.items():
        shape = tuple(int(d) for d in shape)
        if key == "__step__":
            if math.prod(shape) != 1:
                raise MemengineError(f"{where}: optimizer state entry '__step__' is not one number")
            continue
        if key.endswith(".exp_avg_sq"):
            name, other = key[: -len(".exp_avg_sq")], "exp_avg"
        elif key.endswith(".exp_avg"):
            name, other = key[: -len(".exp_avg")], "exp_avg_sq"
        else:
            raise MemengineError(f"{where}: unexpected optimizer state entry '{key}'")
        if f"{name}.{other}" not in entries:
            raise MemengineError(f"{where}: optimizer state for tensor '{name}' has no {other}")
        if name not in model.shapes:
            raise MemengineError(f"{where}: optimizer state for tensor '{name}', which this model does not have "
                                 "(the state belongs to another model)")
        want = (tuple(model.shapes[name]), tuple(model.gpu_shapes[name]))
        if shape not in want:
            raise MemengineError(f"{where}: optimizer state for tensor '{name}' has shape {list(shape)}, the "
                                 f"model's tensor has {list(want[0])} (the state belongs to another model)")
        if dtype != "F32":
            raise MemengineError(f"{where}: optimizer state for tensor '{name}' is not finite float32")


def check(state: dict, model, where: str) -> None:
    """Every entry names a tensor of `model` with a finite float32 moment of that tensor's
    shape."""
    check_header({k: (np.shape(a), "F32" if np.asarray(a).dtype == np.float32 else str(np.asarray(a).dtype))
                  for k, a in state.items()}, model, where)
    for key, arr in state.items():
        if key != "__step__" and not np.isfinite(arr).all():
            name = key.rsplit(".", 1)[0]
            raise MemengineError(f"{where}: optimizer state for tensor '{name}' is not finite float32")


def save(directory: Path, state: dict | None) -> None:
    """Write `state` (AdamW.state_dict()) as optimizer.safetensors in `directory`."""
    if not state:
        return
    from safetensors.numpy import save_file

    arrays = {k: np.ascontiguousarray(v) for k, v in state.items()}
    save_file(arrays, str(Path(directory) / OPTIMIZER_FILE), metadata={"format": FORMAT})


def step_count(state: dict | None) -> int:
    if not state or "__step__" not in state:
        return 0
    v = float(np.asarray(state["__step__"]).reshape(-1)[0])
    return int(v) if math.isfinite(v) else 0
