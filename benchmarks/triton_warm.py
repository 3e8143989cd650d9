"""Compile mamba-ssm's Triton kernels of a Mamba-2 bench shape ahead of the bench, in
parallel, into Triton's on-disk cache, so that bench.py's peer rows (whose autotuner then
still times every configuration, as it would unwarmed) do not spend minutes compiling them
one after the other.

Worker i of n sees every n-th configuration of each `triton.autotune` (the decorator is
wrapped before mamba_ssm is imported) and runs one training step of a one-layer model of the
shape, fp32 and bf16 autocast, at batch 2 (the kernels' autotune keys and specialisations
do not depend on the layer count or the batch, and batch 1 would specialise on the value 1).
The bench's own process, run afterwards with the same TRITON_CACHE_DIR, finds every
configuration compiled.

    PYTHONPATH=<mamba_ssm sources>:$PYTHONPATH python3 benchmarks/triton_warm.py \\
        --shape mamba2-130m --seq 2048 --workers 12
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(i: int, n: int, shape: str, L: int) -> None:
    import triton

    inner = triton.autotune

    def sliced(*args, **kw):
        if "configs" in kw:
            kw["configs"] = kw["configs"][i::n] or kw["configs"][:1]
        elif args:
            args = (args[0][i::n] or args[0][:1],) + args[1:]
        return inner(*args, **kw)

    triton.autotune = sliced
    sys.path.insert(0, HERE)
    import bench
    import torch

    bench.SHAPES[shape] = dict(bench.SHAPES[shape], num_hidden_layers=1)
    if bench.peer_mamba_ssm(compiled=False) is None:
        raise SystemExit(f"worker {i}: mamba_ssm does not import")
    for prec in ("fp32", "bf16"):
        out = bench.bench_peer_train(torch, shape, 2, L, prec, 1)
        if "error" in out:
            raise SystemExit(f"worker {i}: {prec}: {out['error']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="mamba2-130m")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker is not None:
        worker(a.worker, a.workers, a.shape, a.seq)
        return
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, __file__, "--shape", a.shape, "--seq", str(a.seq),
                               "--workers", str(a.workers), "--worker", str(i)]) for i in range(a.workers)]
    codes = [p.wait() for p in procs]
    print(f"triton_warm: {a.workers} workers, {time.time() - t0:.0f} s, exit codes {codes}", flush=True)
    sys.exit(0 if not any(codes) else 1)


if __name__ == "__main__":
    main()
