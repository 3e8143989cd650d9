"""Switches of the kernels' choices, one object per runtime (`Runtime.kernels`): read from
the environment when the runtime is made; tests and benchmarks set them on it to run every
kernel a call may take (the defaults choose by the adapter)."""

from __future__ import annotations

import os
from dataclasses import dataclass

# "reference" forces the plain matmul kernel everywhere (the fast ones must match it);
# "nosplit" turns split-K off; "tiles" keeps matmul_fast where matmul_lanes would run
ENV_MATMUL = "MEMENGINE_MATMUL"
MATMUL_CHOICES = ("auto", "reference", "nosplit", "tiles")


@dataclass
class KernelSettings:
    matmul: str = "auto"   # MEMENGINE_MATMUL: "auto" | "reference" | "nosplit" | "tiles"
    # a dict or a function (rt, M, N, K) -> dict forcing matmul_fast's tile configuration
    matmul_tiles: object = None
    # False: --precision mixed's products on matmul_f16 even where the adapter has f16
    # subgroup matrices (matmul_sgmat, the default there)
    sgmat: bool = True
    # False: the scan backward's channel sums go through workgroup memory even where the
    # adapter has subgroups
    scan_subgroups: bool = True
    # False: the parallel scan kernels even where the 8-lane scan runs (kernels/scan.py)
    scan_lanes: bool = True
    # False: Mamba-2's chunked SSD kernels even where its 8-lane scan runs (kernels/ssd.py)
    ssd_lanes: bool = True
    # None: lanes.row_workgroup decides by the adapter; "cpu" / "gpu" force either choice
    row_workgroup: str | None = None
    # None: 8-invocation rows sum by subgroup shuffles where cpu_lanes; False: through
    # workgroup memory
    row_subgroups: bool | None = None

    @classmethod
    def from_env(cls) -> "KernelSettings":
        v = os.environ.get(ENV_MATMUL, "").strip() or "auto"
        if v not in MATMUL_CHOICES:
            from memengine.engine.errors import MemengineError

            raise MemengineError(f"{ENV_MATMUL}={v!r}: must be one of {', '.join(MATMUL_CHOICES)}")
        return cls(matmul=v)
