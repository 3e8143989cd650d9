"""Compile mamba-ssm's Triton kernels (the Mamba2 peer's SSD) ahead, in parallel.

mamba-ssm's Mamba2 autotunes its Triton kernels on first use: about 200 configurations, each
compiled one after the other (several minutes), then timed.  Here W worker processes each
keep every W-th configuration of each autotuned kernel and run one training step of the
bench shape (fp32, then bf16 autocast) at batch 2, which compiles the same kernels as batch 8
(the autotune keys hold chunk size, head_dim, state size and heads, not batch; 2 and 8 are
both neither 1 nor a multiple of 16, so Triton specializes them alike).  The compiled kernels
land in Triton's cache; bench.py's peer then finds every configuration compiled and only
times them.  On the device machine, with the peer's sources on PYTHONPATH:

    python3 benchmarks/peer_precompile.py --shape mamba2-130m --workers 12 --seq 2048

(`PRECOMPILE=1 bash benchmarks/mamba2_h200.sh` runs it before the bench.)  On an H100 with 14
workers it took 205 s (benchmarks/results/h100/sgmat_interior/precompile.txt); five workers
exited with status 1 and the bench's peer rows still ran in the time left.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path


def worker(shape: str, seq: int, batch: int, w: int, n: int) -> None:
    import triton.runtime.autotuner as at

    init = at.Autotuner.__init__

    def share(self, fn, arg_names, configs, *args, **kw):
        mine = [c for i, c in enumerate(configs) if i % n == w] or configs[:1]
        init(self, fn, arg_names, mine, *args, **kw)

    at.Autotuner.__init__ = share
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench

    bench.peer_mamba_ssm(compiled=False)
    for prec in ("fp32", "bf16"):
        t0 = time.time()
        r = bench.bench_peer_train(torch, shape, batch, seq, prec, steps=1)
        print(f"worker {w}/{n} {prec}: {time.time() - t0:.0f} s {r.get('error', '')}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="mamba2-130m")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--worker", type=int, default=-1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker >= 0:
        worker(a.shape, a.seq, a.batch, a.worker, a.workers)
        return
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, __file__, "--shape", a.shape, "--seq", str(a.seq), "--batch",
                               str(a.batch), "--workers", str(a.workers), "--worker", str(w)])
             for w in range(a.workers)]
    codes = [p.wait() for p in procs]
    print(f"precompiled in {time.time() - t0:.0f} s, worker exit codes {codes}", flush=True)


if __name__ == "__main__":
    main()
