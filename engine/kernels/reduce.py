"""Deterministic GPU reductions (shaders/reduce.wgsl).

Two stages, no atomics, no racing writes:

1. ``reduce_partial``: workgroup ``w`` reduces a fixed chunk of ``256 * per_thread`` elements
   and writes its own slot ``partials[pbase + w]`` (a persistent ``rt.scratch`` buffer);
   ``reduce_partial4`` the same chunks as vec4 where the count and offset are multiples of 4.
2. ``reduce_finish``: one workgroup folds all partials and one thread does ``out[i] += ...``.

The chunking depends only on the element count, so a given input always produces the same
bits.  Inputs may be views at any 4-byte offset: they are bound from the offset rounded
down to the adapter's storage-offset alignment and the remainder is passed as an element
index.  Inputs larger than one storage binding are reduced in several stage-1 dispatches
that write disjoint partial ranges; each binds only its own slots of the partials buffer,
and stage 2 binds the slots written (so tiny forced binding limits work too).

API::

    sum_into(rec, out, x, *, scale=1.0, scale_tensor=None)  # out[0] += scale * scale_tensor[0] * sum(x)
    sumsq_into(rec, out, x)                                 # out[0] += sum(x * x)

Lower-level pieces (used by the gradient clipper): ``plan``, ``record_partials``,
``partials_scratch``.
"""

from __future__ import annotations

from memengine.engine.kernels.lanes import is_cpu
from memengine.engine.runtime import Tensor, bound, cdiv, grid, pack, span, split

SHADER = "reduce"
WG = 256
MIN_PER_THREAD = 8
MAX_PARTIALS = 32768  # per reduction; stage 2 folds at most this many per 256 threads


# On a CPU adapter a workgroup's fold costs more than its loads (lavapipe runs the 256
# invocations as 32 coroutines switched at each of its 9 barriers): fewer, longer chunks.
# A small step's gradient norm: 7.6 ms at 8 per thread, 3.0 at 64, 1.8 at 256 (each
# thread's serial sum stays at 256 terms, the row reductions' bound, see ops/lanes.py).
CPU_MIN_PER_THREAD = 256


def min_per_thread(rt) -> int:
    return CPU_MIN_PER_THREAD if is_cpu(rt) else MIN_PER_THREAD


def plan(n: int, least: int = MIN_PER_THREAD) -> tuple[int, int]:
    """(per_thread, groups) of stage 1 for n elements (`least`: min_per_thread(rt));
    groups <= MAX_PARTIALS; per_thread a multiple of 4 (reduce_partial4)."""
    per_thread = cdiv(max(least, cdiv(n, WG * MAX_PARTIALS)), 4) * 4
    return per_thread, cdiv(n, WG * per_thread)


def _pieces(rt, x: Tensor):
    """Split x into (element_start, count) pieces that each fit one storage binding."""
    n = x.numel
    al = rt.storage_align
    cap = ((rt.max_binding - al) // (4 * WG)) * WG  # elements per piece, multiple of 256
    cap = max(WG, cap)
    return [(s, min(cap, n - s)) for s in range(0, n, cap)]


def count_partials(rt, x: Tensor) -> int:
    return sum(plan(c, min_per_thread(rt))[1] for _, c in _pieces(rt, x))


def finish_window(rt, partials: Tensor, k: int) -> Tensor:
    """The partials buffer for the stage-2 kernels: whole when it fits one binding, else
    its first k slots (the ones written)."""
    if partials.nbytes <= rt.max_binding:
        return partials
    split(rt, 1, lambda _: (4 * k,), unit=f"the {k} partial sums of a reduction")
    return span(partials, 0, k)


def partials_scratch(rt, count: int, key: str = "reduce.partials") -> Tensor:
    """Persistent partials buffer with at least `count` slots (sized to a power of two)."""
    cap = 1024
    while cap < count:
        cap *= 2
    return rt.scratch(key, (cap,))


def record_partials(rec, x: Tensor, partials: Tensor, pbase: int, *, square: bool) -> int:
    """Stage 1 over all of x, writing partials[pbase : pbase + k]; returns k."""
    rt = rec.rt
    written = 0
    for s, c in _pieces(rt, x):
        per_thread, groups = plan(c, min_per_thread(rt))
        view = Tensor(x.buffer, (c,), x.dtype, x.offset + 4 * s)
        xb, base = bound(rt, view, c)
        if partials.nbytes <= rt.max_binding:
            pb, po = partials, pbase + written
        else:  # bind only this dispatch's slots
            pb, po = bound(rt, span(partials, pbase + written, groups))
        u = rt.uniform(pack("IIIIIIIIffff", c, base, per_thread, po,
                            1 if square else 0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0))
        entry = "reduce_partial4" if c % 4 == 0 and base % 4 == 0 else "reduce_partial"
        rec.dispatch(SHADER, entry, {0: xb, 1: pb, 2: u}, grid(groups))
        written += groups
    return written


def _reduce_into(rec, out: Tensor, x: Tensor, *, square: bool, scale: float = 1.0,
                 scale_tensor: Tensor | None = None) -> None:
    rt = rec.rt
    if x.numel == 0:
        return
    if out.numel < 1:
        raise ValueError("out must hold at least one element")
    partials = partials_scratch(rt, count_partials(rt, x))
    k = record_partials(rec, x, partials, 0, square=square)
    ob, oi = bound(rt, out, 1)
    bindings = {1: finish_window(rt, partials, k), 3: ob}
    si = 0
    if scale_tensor is not None:
        sb, si = bound(rt, scale_tensor, 1)
        bindings[4] = sb
    u = rt.uniform(pack("IIIIIIIIffff", k, 0, 0, 0, 0, oi, si, 0, float(scale), 0.0, 0.0, 0.0))
    bindings[2] = u
    entry = "reduce_finish" if scale_tensor is None else "reduce_finish_scaled"
    rec.dispatch(SHADER, entry, bindings, 1)


def sum_into(rec, out: Tensor, x: Tensor, *, scale: float = 1.0, scale_tensor: Tensor | None = None) -> None:
    """ACC: out[0] += scale * (scale_tensor[0] if given) * sum(x).  Deterministic."""
    _reduce_into(rec, out, x, square=False, scale=scale, scale_tensor=scale_tensor)


def sumsq_into(rec, out: Tensor, x: Tensor) -> None:
    """ACC: out[0] += sum(x * x).  Deterministic."""
    _reduce_into(rec, out, x, square=True)
