"""`memengine info`: what a checkpoint holds (config, tensors, dtypes, size), the GPU adapter
and its features, and the memory plan of eval, train and adapt at --batch-size x --seq-len
(engine/app/plan.py); or what a LoRA adapter is (rank, alpha, targets, base).  Nothing is
printed here: `info_report` returns what the command line renders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from memengine.engine.app.options import InfoOptions
from memengine.engine.errors import MemengineError


@dataclass
class InfoReport:
    """`data` is the JSON object `info --json` prints; the other fields are what the human
    table shows beside it.  For a LoRA adapter only `lora` (and `data`, the same) is set."""

    data: dict
    lora: Optional[dict] = None
    config: Any = None              # the checkpoint's model config
    weight_files: tuple = ()        # names of the weight files
    model_file: Optional[str] = None  # the file a shard set is opened by (its index)
    local_path: Optional[str] = None  # where a model id is cached (None for a path)
    remote: bool = False            # the weights stayed on the Hub (their headers were read)
    optimizer_state: bool = False


def info_report(o: InfoOptions, warn: Optional[Callable[[str], None]] = None, *,
                verbose: bool = False) -> InfoReport:
    """What `memengine info` shows for `o.ckpt` (no weight is read: the headers only)."""
    from memengine.engine import lora
    from memengine.engine.app import plan as mplan
    from memengine.engine.app.setup import open_checkpoint
    from memengine.engine.io.resolve import resolve_checkpoint

    o.check_inputs()
    if lora.is_adapter(o.ckpt):
        d = lora.describe(o.ckpt)
        return InfoReport(data=d, lora=d)
    named = _named_shape(o.ckpt)
    if named is not None:   # a built-in shape of configs/ (as `init` takes): its config and plan, no files
        return _shape_report(o, named, verbose)
    ref = resolve_checkpoint(o.ckpt, o.revision, o.model_type, weights=False)   # an uncached id: headers from the Hub
    c = open_checkpoint(ref, warn, read_tensors=False)   # the headers: no weight is read
    cfg = c.config
    n_params = c.n_params
    dtypes: dict[str, int] = {}
    for name in c.shapes:
        dt = str(c.dtypes.get(name, "F32")) if getattr(c, "dtypes", None) else "F32"
        dtypes[dt] = dtypes.get(dt, 0) + 1
    weight_files = c.extra.get("weight_files", [])
    files = weight_files if ref.path.is_file() else sorted(p for p in ref.path.iterdir() if p.is_file())
    nbytes = int(sum(p.stat().st_size for p in files))
    if ref.headers:   # the weights stayed on the Hub: their tensor data, by the headers
        nbytes += sum(h.file_size for h in ref.headers)
    device, caps, plan, backend = _device_and_plan(o, cfg, verbose)
    tok = getattr(c, "tokenizer_path", None)
    data = {
        "path": str(o.ckpt),
        "local_path": str(ref.path),
        "model_type": cfg.model_type,
        "weight_files": [p.name for p in weight_files],
        "config": cfg.to_hf_dict(),
        "parameters": n_params,
        "tensors": {n: {"shape": list(shape), "dtype": str(c.dtypes.get(n, "F32")) if c.dtypes else "F32"}
                    for n, shape in c.shapes.items()},
        "dtypes": dtypes,
        "bytes": nbytes,
        "weights_downloaded": not ref.headers,
        "tokenizer": str(tok) if tok else None,
        "adapter": device,   # the GPU adapter
        "backend": backend,  # the WebGPU implementation (wgpu, dawn)
        "gpu": caps,
        "plan": plan,
    }
    model_file = c.extra.get("model_file")
    return InfoReport(data=data, config=cfg, weight_files=tuple(p.name for p in weight_files),
                      model_file=None if model_file is None else model_file.name,
                      local_path=str(ref.path) if ref.repo_id else None, remote=bool(ref.headers),
                      optimizer_state=bool(c.extra.get("optimizer_path")))


def _device_and_plan(o: InfoOptions, cfg, verbose: bool):
    """(the adapter's description, its capabilities, the memory plan, the backend) or, with
    no adapter, (none and why, None, None, None)."""
    from memengine.engine.app import plan as mplan

    try:
        from memengine.engine.runtime import get_runtime

        rt = get_runtime(o.device or None, verbose=verbose, backend=o.backend, precision=o.precision)
        return (rt.describe(), rt.capabilities(),
                mplan.report(cfg, o.batch_size, o.seq_len, mplan.Limits.of(rt), lora=_lora_column(cfg),
                             mixed=o.precision == "mixed"),
                rt.backend_name)
    except MemengineError as e:
        if o.device not in (None, "", "auto") or o.backend not in (None, "", "auto"):
            raise   # a device or a backend asked for by name that is not there: as eval says
        return f"none ({e})", None, None, None


LORA_RANK = 8   # the adapter of the plan's LoRA column: rank 8 on the architecture's default targets


def _lora_column(cfg) -> tuple:
    """(rank, plan sizes) of the adapter the plan's LoRA column trains."""
    from memengine.engine import lora, models

    spec = lora.LoraSpec(r=LORA_RANK, alpha=2 * LORA_RANK, targets=models.of(cfg).lora_targets)
    return LORA_RANK, lora.plan_sizes(cfg, spec, lora.init_tensors(cfg, spec, 0), train=True)


def _named_shape(name) -> Optional[str]:
    """`name` when it is no path but one of configs/' built-in shapes (mamba2-130m,
    mamba-codestral-7b, ...), else None."""
    from pathlib import Path

    from memengine.engine import models

    s = str(name)
    if "/" in s or Path(s).exists() or s not in models.available_configs():
        return None
    return s


def _shape_report(o: InfoOptions, name: str, verbose: bool) -> InfoReport:
    import math

    from memengine.engine import models

    cfg = models.load_config(name)
    shapes = {n: tuple(shape) for n, shape in models.of(cfg).iter_shapes(cfg)}
    device, caps, plan, backend = _device_and_plan(o, cfg, verbose)
    data = {
        "path": name, "shape": name, "backend": backend, "local_path": None, "model_type": cfg.model_type,
        "weight_files": [],
        "config": cfg.to_hf_dict(), "parameters": int(sum(math.prod(s) for s in shapes.values())),
        "tensors": {n: {"shape": list(s), "dtype": "F32"} for n, s in shapes.items()}, "dtypes": {"F32": len(shapes)},
        "bytes": 0, "weights_downloaded": False, "tokenizer": None, "adapter": device, "gpu": caps, "plan": plan,
    }
    return InfoReport(data=data, config=cfg)
