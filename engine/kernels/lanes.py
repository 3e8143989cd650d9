"""Kernel choices for CPU adapters.  lavapipe (llvmpipe) runs a workgroup on one CPU thread
as SIMD vectors of 8 invocations: a load whose address differs between lanes is a gather,
and a barrier switches coroutines, one per vector.  So there the 8-lane kernels
(matmul_lanes in shaders/matmul.wgsl, scan_lanes_* in shaders/selective_scan.wgsl: one
8-lane subgroup per workgroup, operands shared by subgroup operations) replace the GPU
kernels, the row reductions run with few invocations per row, and conv1d's workgroups are
one vector of 8 lanes (ops/conv1d.py; benchmarks/README.md)."""

from __future__ import annotations

import weakref

from memengine.engine.runtime import STORAGE_BUFFERS  # the most a kernel binds: scan_lanes_backward's

_OK: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def is_cpu(rt) -> bool:
    return "cpu" in str(getattr(rt, "adapter_type", "")).lower()


def cpu_lanes(rt) -> bool:
    """Whether this runtime takes the 8-lane kernels: a CPU adapter with subgroups whose
    subgroup is exactly a workgroup of 8 invocations (probed once per runtime), on a device
    that lets an entry point bind STORAGE_BUFFERS storage buffers."""
    ok = _OK.get(rt)
    if ok is None:
        ok = False
        if (getattr(rt, "has_subgroups", False) and is_cpu(rt)
                and rt.limit("max-storage-buffers-per-shader-stage", 8) >= STORAGE_BUFFERS):
            out = rt.zeros((4,))
            rec = rt.recorder()
            rec.dispatch("lanes", "lanes_probe", {0: out}, 1)
            rec.submit()
            got = rt.read(out)
            rt.free(out)
            ok = bool(got[0] == 8 and got[1] == 8)
        _OK[rt] = ok
    return ok


def row_workgroup(rt, n: int, default: int) -> dict | None:
    """Pipeline constants of the kernels that reduce one row of `n` values per workgroup
    (rmsnorm, cross entropy; `default` invocations otherwise).  On a CPU adapter as few
    invocations as keep each one's serial sum at 256 terms or less (the default's precision
    at n = 65536), at least 8 (one SIMD vector, whose barriers switch no coroutines:
    rmsnorm at E 64 3.7x faster on lavapipe than with 128)."""
    force = rt.kernels.row_workgroup  # None: by the adapter; "cpu" / "gpu" force either choice (tests)
    cpu = is_cpu(rt) if force is None else force == "cpu"
    if not cpu:
        return None
    wg = 8
    while wg < default and wg * 256 < n:
        wg *= 2
    # 8 invocations that are one subgroup sum by shuffles instead of barriers (the same
    # pairing, so the same bits)
    return {"WG": wg, "SG8": int(wg == 8 and rt.kernels.row_subgroups is not False and cpu_lanes(rt))}
