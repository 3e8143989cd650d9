"""Causal GQA attention, forward + backward, at the hybrids' real head shapes and L 4096:
memengine's kernels (engine/kernels/attention.py: the f32 ones and, where the adapter has f16
subgroup matrices, those --precision mixed takes, shaders/attention_sgmat.wgsl, their times
including the casts of q, k, v and dO to f16) against torch's scaled_dot_product_attention
(flash, bf16) on the same device, and first a check of our results against an fp32 torch
reference (max abs error of o, dq, dk, dv at a small L that is no multiple of the kernels'
blocks, B 2).  Run on the device machine after `source
benchmarks/device_setup.sh`; writes one JSON line per shape (and to $OUT).  Without CUDA
the reference runs on torch's CPU and the SDPA timing is skipped (ATTENTION_L=256 checks
the script on a software adapter); without torch only our timings are printed."""

from __future__ import annotations

import json
import os
import time

import numpy as np

from memengine.engine.kernels import attention
from memengine.engine.runtime import get_runtime

SHAPES = [("granite-4.0-h-350m", 12, 4, 64, 0.015625), ("bamba-9b", 32, 8, 128, 128 ** -0.5)]
B, REPS = 1, 5
L = int(os.environ.get("ATTENTION_L", "4096"))   # (a smaller L checks the script on a software adapter)
CHECK_B, CHECK_L = 2, int(os.environ.get("ATTENTION_CHECK_L", "333"))


def _buffers(rt, B_, L_, Hq, Hkv, D, seed=0):
    M = B_ * L_
    rng = np.random.default_rng(seed)
    host = {n: rng.standard_normal((M, c)).astype(np.float32)
            for n, c in (("q", Hq * D), ("k", Hkv * D), ("v", Hkv * D), ("do", Hq * D))}
    t = {n: rt.upload(x) for n, x in host.items()}
    t.update(o=rt.empty((M, Hq * D)), lse=rt.empty((M, Hq)), lsum=rt.empty((M, Hq)), delta=rt.empty((M, Hq)),
             dq=rt.empty((M, Hq * D)), dk=rt.empty((M, Hkv * D)), dv=rt.empty((M, Hkv * D)))
    return host, t


def _fwd(rt, t, B_, L_, Hq, Hkv, D, s):
    rec = rt.recorder()
    attention.attention_forward(rec, t["o"], t["lse"], t["q"], t["k"], t["v"], t["lsum"], B=B_, L=L_, Hq=Hq,
                                Hkv=Hkv, D=D, scale=s)
    rec.submit()


def _bwd(rt, t, B_, L_, Hq, Hkv, D, s):
    rec = rt.recorder()
    attention.attention_backward(rec, t["dq"], t["dk"], t["dv"], t["delta"], t["do"], t["o"], t["lse"], t["q"],
                                 t["k"], t["v"], B=B_, L=L_, Hq=Hq, Hkv=Hkv, D=D, scale=s)
    rec.submit()


def _f16(rt, t, B_, L_, Hq, Hkv, D):
    """The f16 copies (with their padding rows) and a scale table for the subgroup-matrix kernels."""
    from memengine.engine.kernels.matmul import F16Scales
    M, P = B_ * L_, attention.SG_PAD_ROWS
    t.update(q16=rt.zeros((M + P, Hq * D), "f16"), k16=rt.zeros((M + P, Hkv * D), "f16"),
             v16=rt.zeros((M + P, Hkv * D), "f16"), do16=rt.zeros((M + P, Hq * D), "f16"))
    return F16Scales(rt, ["q", "k", "v", "do"])


def _fwd16(rt, t, B_, L_, Hq, Hkv, D, s, sc):
    from memengine.engine.kernels.matmul import cast_f16
    rec = rt.recorder()
    q16, k16, v16 = (cast_f16(rec, t[n + "16"], t[n], scale=sc[n]) for n in ("q", "k", "v"))
    attention.attention_forward_f16(rec, t["o"], t["lse"], q16, k16, v16, B=B_, L=L_, Hq=Hq, Hkv=Hkv, D=D, scale=s)
    rec.submit()


def _bwd16(rt, t, B_, L_, Hq, Hkv, D, s, sc):
    from memengine.engine.kernels.matmul import cast_f16
    rec = rt.recorder()
    do16 = cast_f16(rec, t["do16"], t["do"], scale=sc["do"])
    attention.attention_backward_f16(rec, t["dq"], t["dk"], t["dv"], t["delta"], t["do"], t["o"], t["lse"], t["q16"],
                                     t["k16"], t["v16"], do16, B=B_, L=L_, Hq=Hq, Hkv=Hkv, D=D, scale=s)
    rec.submit()


def _free(rt, t):
    for x in t.values():
        rt.free(x)


def ours(rt, Hq, Hkv, D, s, f16=False):
    _, t = _buffers(rt, B, L, Hq, Hkv, D)
    out = {}
    fns = (("forward", _fwd), ("backward", _bwd))
    extra = ()
    if f16:
        fns, extra = (("forward", _fwd16), ("backward", _bwd16)), (_f16(rt, t, B, L, Hq, Hkv, D),)
    for name, f in fns:
        f(rt, t, B, L, Hq, Hkv, D, s, *extra)
        rt.sync()
        ts = []
        for _ in range(REPS):
            t0 = time.perf_counter()
            f(rt, t, B, L, Hq, Hkv, D, s, *extra)
            rt.sync()
            ts.append((time.perf_counter() - t0) * 1e3)
        out[name] = float(np.median(ts))
    _free(rt, t)
    return out


def check(rt, torch, dev, Hq, Hkv, D, s, f16=False):
    """Max abs errors of ours against torch's SDPA in fp32 (math kernel) on `dev`."""
    host, t = _buffers(rt, CHECK_B, CHECK_L, Hq, Hkv, D, seed=1)
    if f16:
        sc = _f16(rt, t, CHECK_B, CHECK_L, Hq, Hkv, D)
        _fwd16(rt, t, CHECK_B, CHECK_L, Hq, Hkv, D, s, sc)
        _bwd16(rt, t, CHECK_B, CHECK_L, Hq, Hkv, D, s, sc)
    else:
        _fwd(rt, t, CHECK_B, CHECK_L, Hq, Hkv, D, s)
        _bwd(rt, t, CHECK_B, CHECK_L, Hq, Hkv, D, s)
    got = {n: rt.read(t[n]) for n in ("o", "dq", "dk", "dv")}
    _free(rt, t)

    def heads(x, H):
        return torch.tensor(x, device=dev).reshape(CHECK_B, CHECK_L, H, D).transpose(1, 2).contiguous()

    q, k, v = (heads(host[n], h).requires_grad_() for n, h in (("q", Hq), ("k", Hkv), ("v", Hkv)))
    do = heads(host["do"], Hq)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=s, enable_gqa=True)
    o.backward(do)
    flat = lambda x: x.detach().transpose(1, 2).reshape(CHECK_B * CHECK_L, -1).cpu().numpy()
    ref = {"o": flat(o), "dq": flat(q.grad), "dk": flat(k.grad), "dv": flat(v.grad)}
    return {f"{n}_max_abs_err": float(np.abs(got[n].reshape(ref[n].shape) - ref[n]).max()) for n in ref} | \
        {f"{n}_max_abs": float(np.abs(ref[n]).max()) for n in ref}


def sdpa(torch, Hq, Hkv, D, s):
    dev = "cuda"
    q = torch.randn(B, Hq, L, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, Hkv, L, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, Hkv, L, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(B, Hq, L, D, device=dev, dtype=torch.bfloat16)
    f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=s, enable_gqa=True)
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
    try:
        import torch

        dev = "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError as e:
        torch, dev = None, str(e)
    lines = []
    for name, Hq, Hkv, D, s in SHAPES:
        row = {"shape": name, "B": B, "L": L, "Hq": Hq, "Hkv": Hkv, "D": D, "scale": s, "device": rt.describe()}
        if torch is not None:
            row["check"] = dict(B=CHECK_B, L=CHECK_L, against=f"torch SDPA fp32 (math) on {dev}",
                                **check(rt, torch, dev, Hq, Hkv, D, s))
        else:
            row["check"] = f"skipped: no torch ({dev})"
        f16 = attention.takes_subgroup_matrices(rt, D)
        if f16:   # the mixed kernels first (the f32 ones take longer: the script's time limit)
            if torch is not None:
                row["check_f16"] = check(rt, torch, dev, Hq, Hkv, D, s, f16=True)
            row["memengine_f16_ms"] = ours(rt, Hq, Hkv, D, s, f16=True)
            print(json.dumps({k: row[k] for k in row if "f16" in k or k == "shape"}), flush=True)
        row["memengine_ms"] = m = ours(rt, Hq, Hkv, D, s)
        if dev == "cuda":
            try:
                t = sdpa(torch, Hq, Hkv, D, s)
            except Exception as e:
                t = {"error": str(e)[:200]}
        else:
            t = {"error": "no CUDA: SDPA not timed"}
        row["sdpa_bf16_ms"] = t
        if "forward+backward" in t:
            row["ratio_fwd_bwd"] = (m["forward"] + m["backward"]) / t["forward+backward"]
            row["sdpa_over_ours"] = 1.0 / row["ratio_fwd_bwd"]
            if f16:
                m16 = row["memengine_f16_ms"]
                row["sdpa_over_ours_f16"] = t["forward+backward"] / (m16["forward"] + m16["backward"])
        print(json.dumps(row), flush=True)
        lines.append(row)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "attention.jsonl"), "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in lines))


if __name__ == "__main__":
    main()
