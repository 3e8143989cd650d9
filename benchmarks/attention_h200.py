"""Causal GQA attention, forward + backward, at the hybrids' real head shapes and L 4096:
memengine's kernels (engine/kernels/attention.py, f32) against torch's
scaled_dot_product_attention (flash, bf16) on the same device.  Run on the device machine
after `source benchmarks/device_setup.sh`; writes one JSON line per shape (and to $OUT)."""

from __future__ import annotations

import json
import os
import time

import numpy as np

from memengine.engine.kernels import attention
from memengine.engine.runtime import get_runtime

SHAPES = [("granite-4.0-h-350m", 12, 4, 64), ("bamba-9b", 32, 8, 128)]
B, REPS = 1, 5
L = int(os.environ.get("ATTENTION_L", "4096"))   # (a smaller L checks the script on a software adapter)


def ours(rt, Hq, Hkv, D):
    M = B * L
    rng = np.random.default_rng(0)
    up = lambda *s: rt.upload(rng.standard_normal(s).astype(np.float32))
    q, k, v, do = up(M, Hq * D), up(M, Hkv * D), up(M, Hkv * D), up(M, Hq * D)
    o, lse, lsum, delta = rt.empty((M, Hq * D)), rt.empty((M, Hq)), rt.empty((M, Hq)), rt.empty((M, Hq))
    dq, dk, dv = rt.empty((M, Hq * D)), rt.empty((M, Hkv * D)), rt.empty((M, Hkv * D))
    s = 1.0 / D ** 0.5

    def fwd():
        rec = rt.recorder()
        attention.attention_forward(rec, o, lse, q, k, v, lsum, B=B, L=L, Hq=Hq, Hkv=Hkv, D=D, scale=s)
        rec.submit()

    def bwd():
        rec = rt.recorder()
        attention.attention_backward(rec, dq, dk, dv, delta, do, o, lse, q, k, v, B=B, L=L, Hq=Hq, Hkv=Hkv, D=D,
                                     scale=s)
        rec.submit()

    out = {}
    for name, f in (("forward", fwd), ("backward", bwd)):
        f()
        rt.sync()
        t = time.perf_counter()
        for _ in range(REPS):
            f()
        rt.sync()
        out[name] = (time.perf_counter() - t) / REPS * 1e3
    return out


def sdpa(Hq, Hkv, D):
    import torch

    dev = "cuda"
    q = torch.randn(B, Hq, L, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, Hkv, L, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, Hkv, L, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(B, Hq, L, D, device=dev, dtype=torch.bfloat16)
    f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = {}
    for _ in range(3):
        f().backward(do)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(REPS * 4):
        y = f()
    torch.cuda.synchronize()
    out["forward"] = (time.perf_counter() - t) / (REPS * 4) * 1e3
    t = time.perf_counter()
    for _ in range(REPS * 4):
        f().backward(do)
    torch.cuda.synchronize()
    out["forward+backward"] = (time.perf_counter() - t) / (REPS * 4) * 1e3
    del y
    return out


def main():
    rt = get_runtime()
    lines = []
    for name, Hq, Hkv, D in SHAPES:
        m = ours(rt, Hq, Hkv, D)
        try:
            t = sdpa(Hq, Hkv, D)
        except Exception as e:  # no torch / CUDA on this machine
            t = {"error": str(e)[:200]}
        row = {"shape": name, "B": B, "L": L, "Hq": Hq, "Hkv": Hkv, "D": D, "device": rt.describe(),
               "memengine_ms": m, "sdpa_bf16_ms": t}
        if "forward+backward" in t:
            row["ratio_fwd_bwd"] = (m["forward"] + m["backward"]) / t["forward+backward"]
        print(json.dumps(row), flush=True)
        lines.append(row)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "attention.jsonl"), "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in lines))


if __name__ == "__main__":
    main()
