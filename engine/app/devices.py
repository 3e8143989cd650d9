"""`memengine devices`: the GPU adapters each backend sees (wgpu-native and Dawn), with the
limits and features a run depends on (what `--device` and `--backend` choose among)."""

from __future__ import annotations

from memengine.engine.backend import REGISTRY, adapter_kind, get_backend, open_adapter, silence_fd2
from memengine.engine.errors import MemengineError

# the limits a run's plan and kernels read (WebGPU's names)
LIMITS = ("max-buffer-size", "max-storage-buffer-binding-size", "max-compute-workgroup-storage-size",
          "max-compute-invocations-per-workgroup", "max-storage-buffers-per-shader-stage")


def list_devices(verbose: bool = False, backend: str | None = None) -> list[dict]:
    """One dict per adapter of every backend that can be loaded: backend, name, type
    ("DiscreteGPU", "CPU", ...), driver, whether `--device auto` with `--backend` (None:
    MEMENGINE_BACKEND, else auto) takes it, whether it has f16 subgroup matrices, its
    features and limits.  A backend that cannot be loaded, or sees no adapter, is one entry
    with its `error`."""
    try:
        b, a = open_adapter(backend, "auto", verbose)
        info = b.adapter_info(a)
        chosen = (b.name, info.get("device"), info.get("backend_type"))
    except MemengineError:
        chosen = None
    out = []
    for name in sorted(REGISTRY, key=lambda n: (n != "wgpu", n)):
        try:
            b = get_backend(name)
            b.quiet(verbose)
            with silence_fd2(not verbose):
                adapters = b.adapters()
            if not adapters:
                raise MemengineError(b.NO_ADAPTER_HINT)
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
                "auto": (name, info.get("device"), info.get("backend_type")) == chosen,
                "subgroup_matrices": b.has_f16_subgroup_matrices(a),
                "features": sorted(str(f) for f in b.adapter_features(a)),
                "limits": {k: int(limits[k]) for k in LIMITS if k in limits},
            })
    return out
