"""`memengine devices`: the GPU adapters each backend sees, with the limits and features
a run depends on (what `--device` chooses among)."""

from __future__ import annotations

from memengine.engine.backend import REGISTRY, adapter_kind, get_backend, silence_fd2
from memengine.engine.errors import MemengineError

# the limits a run's plan and kernels read (WebGPU's names)
LIMITS = ("max-buffer-size", "max-storage-buffer-binding-size", "max-compute-workgroup-storage-size",
          "max-compute-invocations-per-workgroup", "max-storage-buffers-per-shader-stage")


def list_devices(verbose: bool = False) -> list[dict]:
    """One dict per adapter of every backend that can be loaded: backend, name, type
    ("DiscreteGPU", "CPU", ...), driver, whether `--device auto` takes it, its features
    and limits.  A backend that cannot be loaded is one entry with its `error`."""
    out = []
    for name in sorted(REGISTRY):
        try:
            b = get_backend(name)
            b.quiet(verbose)
            with silence_fd2(not verbose):
                adapters = b.adapters()
            try:
                pick = b.adapter_info(b.choose_adapter("auto", verbose))
                chosen = (pick.get("device"), pick.get("backend_type"))
            except MemengineError:
                chosen = None
        except MemengineError as e:
            out.append({"backend": name, "error": str(e)})
            continue
        for a in adapters:
            info = b.adapter_info(a)
            limits = b.adapter_limits(a)
            out.append({
                "backend": name, "name": str(info.get("device", "?")), "type": str(info.get("adapter_type", "?")),
                "api": str(info.get("backend_type", "?")), "driver": str(info.get("description", "")),
                "software": adapter_kind(info) == "cpu",
                "auto": (info.get("device"), info.get("backend_type")) == chosen,
                "features": sorted(str(f) for f in b.adapter_features(a)),
                "limits": {k: int(limits[k]) for k in LIMITS if k in limits},
            })
    return out
