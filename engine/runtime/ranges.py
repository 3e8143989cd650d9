"""Calls over tensors larger than one storage binding: cutting them into ranges whose
bindings fit (`split`), the refusal when one unit alone does not fit, and the binary
search both this and the memory plan's advice use (`largest`)."""

from __future__ import annotations

from memengine.engine.errors import MemengineError
from memengine.engine.hostmem import fmt_bytes


class BindingError(MemengineError):
    """A single unit of work (a row, a sequence) does not fit one storage binding.  `plain`:
    the message without the advice it carries (`split`'s `advice`), for a caller whose
    user has no such flag (a prompt has no --seq-len)."""

    def __init__(self, message: str, plain: str | None = None):
        super().__init__(message)
        self.plain = message if plain is None else plain


def _unit_text(unit: str, detail: str | None, advice: str | None) -> str:
    """'<unit> (<detail>; <advice>)', the parts given."""
    parts = [p for p in (detail, advice) if p]
    return f"{unit} ({'; '.join(parts)})" if parts else unit


def largest(ok, hi: int, lo: int = 0) -> int:
    """The largest n in [lo, hi] with ok(n), where ok holds up to some n and fails above it
    and ok(lo) is taken to hold (lo = 0: 0 when ok(1) fails); lo when hi <= lo."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def split(rt, total: int, windows, *, step: int = 1, unit: str = "unit",
          scratch=None, detail: str | None = None, advice: str | None = None) -> list[tuple[int, int]]:
    """Cut `total` units of a call into consecutive (start, count) ranges whose bindings fit.

    `windows(n)` gives the byte sizes of the tensor windows a call over n units binds
    (monotone in n); each must fit `rt.max_binding` after `bound()` moves its start down to
    the offset alignment.  `scratch(n)`, if given, sizes the op's own scratch buffers for n
    units, checked against the adapter's limit (a forced lower limit is for model tensors).
    When the whole call fits this is ``[(0, total)]``, so the caller records exactly what it
    would without splitting.  Counts are multiples of `step` (the last one excepted) where a
    step fits, else any count.  When one unit alone does not fit, BindingError names it
    (`unit`, with `detail` and what would help, `advice`, in parentheses) and the sizes.
    """
    total = int(total)
    slack = rt.storage_align - 4
    if scratch is None and total > 0 and fits_all(rt):
        return [(0, total)]

    def over(n: int):
        """The first (bytes, limit) that does not fit, else None."""
        for b in windows(n):
            if int(b) > rt.max_binding - slack:
                return int(b), rt.max_binding
        for b in (scratch(n) if scratch is not None else ()):
            if int(b) > rt.adapter_max_binding - slack:
                return int(b), rt.adapter_max_binding
        return None

    if total <= 0:
        return []
    if over(total) is None:
        return [(0, total)]
    bad = over(1)
    if bad is not None:
        raise BindingError(binding_refusal(_unit_text(unit, detail, advice), bad[0], bad[1], slack),
                           binding_refusal(_unit_text(unit, detail, None), bad[0], bad[1], slack))
    g = step if step > 1 and over(step) is None else 1
    # in units of g: 1 fits; (total - 1) // g * g < total
    n = largest(lambda m: over(m * g) is None, (total - 1) // g, lo=1) * g
    return [(s, min(n, total - s)) for s in range(0, total, n)]


def fits_all(rt) -> bool:
    """True while every storage buffer made so far fits one binding: then no window of any
    of them can exceed it and nothing needs splitting (the fast path of `split`)."""
    return getattr(rt, "unsplit", False)


def binding_refusal(what: str, need: int, limit: int, slack: int) -> str:
    """'<what> needs N in one storage binding but the adapter allows M per binding' (exact
    bytes when the rounded figures would look equal: a binding starts on the offset
    alignment, so `slack` bytes of the limit may be lost)."""
    a, b = fmt_bytes(need), fmt_bytes(limit)
    if a == b:
        a, b = f"{need:,} bytes", f"{limit - slack:,} bytes (its {b} limit less the offset alignment)"
    return f"{what} needs {a} in one storage binding but the adapter allows {b} per binding"

