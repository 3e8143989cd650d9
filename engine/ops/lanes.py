"""Adapter choice for the 8-lane kernels (shaders/matmul_lanes.wgsl,
shaders/selective_scan_lanes.wgsl): CPU adapters such as lavapipe run a workgroup as SIMD
vectors, so a load whose address differs between lanes is a gather and a barrier switches
coroutines; kernels made of one 8-lane subgroup that share operands by subgroup operations
run several times faster there than the GPU kernels (benchmarks/README.md)."""

from __future__ import annotations

import weakref

_OK: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def cpu_lanes(rt) -> bool:
    """Whether this runtime takes the 8-lane kernels: a CPU adapter with subgroups whose
    subgroup is exactly a workgroup of 8 invocations (probed once per runtime)."""
    ok = _OK.get(rt)
    if ok is None:
        ok = False
        if getattr(rt, "has_subgroups", False) and "cpu" in str(getattr(rt, "adapter_type", "")).lower():
            out = rt.zeros((4,))
            rec = rt.recorder()
            rec.dispatch("lanes", "lanes_probe", {0: out}, 1)
            rec.submit()
            got = rt.read(out)
            rt.free(out)
            ok = bool(got[0] == 8 and got[1] == 8)
        _OK[rt] = ok
    return ok
