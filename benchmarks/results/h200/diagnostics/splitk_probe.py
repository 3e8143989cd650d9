# occupancy staircase and split-K sweep of matmul_fast on the H200 (timing only)
import json
import os
import sys

sys.path.insert(0, "benchmarks")
import bench
import numpy as np
from memengine.engine.kernels import matmul as mm
from memengine.engine.runtime import get_runtime

rt = get_runtime(None)
out = {"stair": [], "split": {}}
rng = np.random.default_rng(0)

def setup(kw):
    sa, sb, sc = bench._stored(kw)
    A = rt.upload(rng.random(sa, dtype=np.float32) - 0.5)
    B = rt.upload(rng.random(sb, dtype=np.float32) - 0.5)
    C = rt.upload(np.zeros(sc, np.float32))
    return A, B, C

def t(kw, A, B, C):
    r = bench._gpu_ms(rt, lambda rec: mm.matmul(rec, C, A, B, **kw), reps=5)
    return r["ms"]

# warm up the clocks
kw = dict(M=4096, N=4096, K=4096, trans_b=True)
A, B, C = setup(kw)
import time

t_end = time.time() + 2
while time.time() < t_end:
    t(kw, A, B, C)
for x in (A, B, C): rt.free(x)

# staircase: a 128 x (128*11) strip, rows of tiles 1..60 (11 .. 660 workgroups), K 4096, no split
old = rt.kernels.matmul
rt.kernels.matmul = "nosplit"
K = 4096
for ty in list(range(2, 62, 2)):
    kw = dict(M=128 * ty, N=128 * 11, K=K, trans_b=True)
    A, B, C = setup(kw)
    ms = t(kw, A, B, C)
    out["stair"].append((ty * 11, ms))
    print(f"stair tiles {ty*11:4d} ms {ms:.3f} per-wave-of-264 {ms / -(-ty*11 // 264):.3f}", flush=True)
    for x in (A, B, C): rt.free(x)
rt.kernels.matmul = old

cases = {c[0]: c[2] for c in bench.step_matmuls(8, 2048, "mamba-130m")}
orig = mm._split_k
for name in ("lm_head dX", "out_proj dW", "in_proj dW", "dt_proj dW", "x_proj dW", "x_proj fwd", "dt_proj dX"):
    kw = cases[name]
    A, B, C = setup(kw)
    rows = []
    for s in [1, 2, 3, 4, 6, 8, 9, 10, 11, 12, 13, 14, 15, 16, 18, 20, 22, 24, 26, 28, 30, 32, 33, 36, 40, 44, 48]:
        if kw["K"] // s < 256:
            continue
        mm._split_k = lambda *a, s=s, **k: s
        ms = t(kw, A, B, C)
        sl, ks = mm.splitk_slices(rt, kw["M"], kw["N"], kw["K"])
        rows.append((s, sl, ks, ms))
    mm._split_k = orig
    sl, ks = mm.splitk_slices(rt, kw["M"], kw["N"], kw["K"])
    best = min(rows, key=lambda r: r[3])
    print(f"{name}: current slices {sl} | " + " ".join(f"{r[1]}:{r[3]:.3f}" for r in rows) + f" | best {best[1]} {best[3]:.3f}", flush=True)
    out["split"][name] = dict(current=sl, rows=rows)
    for x in (A, B, C): rt.free(x)
json.dump(out, open(os.environ.get("OUT", ".") + "/probe.json", "w"))
