"""Host memory: refuse work whose arrays cannot fit before allocating them.

`available_bytes` is `MemAvailable` from /proc/meminfo where the kernel gives it (Linux),
else the physical memory size (`sysconf`), else unknown. `check_fits` turns an estimate
that exceeds it into one `MemengineError` line (instead of a MemoryError, or the OOM killer
part-way through).
"""

from __future__ import annotations

import os

from memengine.engine.errors import MemengineError

MEMINFO = "/proc/meminfo"


def fmt_bytes(n: int | float) -> str:
    n = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if n < 1024 or unit == "EiB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:.3g} bytes"  # pragma: no cover


def available_bytes(meminfo: str | None = None) -> tuple[int | None, str]:
    """(bytes this process can allocate, where the figure comes from); (None, ...) if unknown."""
    meminfo = meminfo or MEMINFO
    try:
        with open(meminfo, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    parts = line.split()
                    return int(parts[1]) * (1024 if parts[2:3] == ["kB"] else 1), f"MemAvailable in {meminfo}"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "the physical memory size"
    except (AttributeError, ValueError, OSError):
        return None, "unknown"


def check_fits(nbytes: int, what: str, fix: str) -> None:
    """Refuse `what` when it needs more than the available host memory (`fix` says what
    would help)."""
    avail, source = available_bytes()
    if avail is not None and nbytes > avail:
        raise MemengineError(f"{what} needs about {fmt_bytes(nbytes)} of host memory, but only "
                             f"{fmt_bytes(avail)} is available ({source}); {fix}")
