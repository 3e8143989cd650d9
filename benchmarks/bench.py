"""memengine against its peers, measured in the same run on the same device; every figure a ratio.

    python benchmarks/bench.py --suite scan,matmul,train --out results.json        # on a GPU machine
    python benchmarks/bench.py --suite train --shapes tiny --seq 128 --batch 1     # anywhere
    python benchmarks/bench.py --suite matmul,train --precision fp32,mixed          # f16 matmul path too

The peer is mamba-ssm (the authors' fused CUDA kernels) where it can be imported: build it
with ../shared/peers/build_peers.sh and put /tmp/peers/mamba_ssm-2.3.2.post1 on PYTHONPATH
(--peer-wait waits for a build running in the background).  transformers' MambaForCausalLM
(its pure-PyTorch loop over time steps, the slow path) is a secondary row (--slow-path).

Suites:
  scan    selective-scan forward + backward at B 8, L 2048, Di 1536, N 16 (ms, GPU time by
          timestamp queries) vs mamba-ssm's selective_scan_fn forward + backward (CUDA events)
  matmul  every matrix product of a training step of the model shape (in_proj, x_proj,
          dt_proj, out_proj, LM head: forward, input gradient, weight gradient, with the
          step's transposes and strides) vs torch.matmul fp32 with TF32 off (cuBLAS)
  train   tokens/s and peak memory of a training step (forward, backward, clip, AdamW) vs
          mamba-ssm's MambaLMHeadModel + torch.optim.AdamW in fp32 (TF32 off) and bf16
          autocast; --slow-path adds transformers' MambaForCausalLM (fp32); beside each full
          step a LoRA step (--lora-rank, 8 by default: the adapter trained, the base frozen)
  decode  generation: time to the first token after a --prompt-len prompt and decode
          tokens/s over --new-tokens, greedy and sampling (T 0.8, top-k 50, top-p 0.95), per
          --shapes, vs transformers' generate (greedy, fp32, same weights' shape and prompt)
          and, on CUDA, mamba-ssm's MambaLMHeadModel.generate with CUDA graphs (cg=True)

--variants also times the kernel configurations that are not the default; --profile times
one training step kernel by kernel.  Prints a table last and writes every number to --out.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import platform
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# the peers' fp32 rows run with TF32 off: torch's flags (set per row) and, for mamba-ssm's
# Triton kernels (Mamba-2's SSD), Triton's default precision of an f32 dot, read at import
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

import numpy as np

SHAPES = {
    # name: (vocab, E, N, layers)
    "tiny": dict(vocab_size=256, hidden_size=64, state_size=8, num_hidden_layers=2),
    "small": dict(vocab_size=256, hidden_size=256, state_size=16, num_hidden_layers=4),
    "mamba-130m": dict(vocab_size=50280, hidden_size=768, state_size=16, num_hidden_layers=24),
    "mamba-1.4b": dict(vocab_size=50280, hidden_size=2048, state_size=16, num_hidden_layers=48),
    # the 130m layer stack with a byte vocabulary: the per-token cost of the layers
    # without the 50280-row LM head
    "mamba-130m-bytes": dict(vocab_size=256, hidden_size=768, state_size=16, num_hidden_layers=24),
    # Mamba-2 (transformers' Mamba2Config fields; Di = 2E = num_heads * head_dim)
    "mamba2-130m": dict(model_type="mamba2", vocab_size=50288, hidden_size=768, num_heads=24, head_dim=64,
                        n_groups=1, state_size=128, num_hidden_layers=24, chunk_size=256),
    "mamba-codestral-7b": dict(model_type="mamba2", vocab_size=32768, hidden_size=4096, num_heads=128, head_dim=64,
                               n_groups=8, state_size=128, num_hidden_layers=64, chunk_size=256,
                               tie_word_embeddings=False),
    "mamba2-tiny": dict(model_type="mamba2", vocab_size=256, hidden_size=64, num_heads=4, head_dim=32,
                        n_groups=1, state_size=16, num_hidden_layers=2, chunk_size=64),
    "mamba2-small": dict(model_type="mamba2", vocab_size=256, hidden_size=256, num_heads=8, head_dim=64,
                         n_groups=2, state_size=64, num_hidden_layers=4, chunk_size=128),
}


def _config_json(name: str) -> dict:
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", f"{name}.json")) as f:
        return json.load(f)


# the hybrids (Mamba-2 layers and GQA attention; the config.json transformers reads)
HYBRIDS = ("granite-4.0-h-350m",)
SHAPES.update({name: _config_json(name) for name in HYBRIDS})


def is_mamba2(shape: str) -> bool:
    return SHAPES[shape].get("model_type") == "mamba2"


def is_hybrid(shape: str) -> bool:
    return SHAPES[shape].get("model_type") in ("granitemoehybrid", "bamba")


def _fields(shape: str) -> dict:
    return {k: v for k, v in SHAPES[shape].items() if k != "model_type"}

# configurations compared by --variants (benchmarks/README.md has what earlier ones gave)
MATMUL_VARIANTS = {
    "default": {},
    "no-split-K": {"mode": "nosplit"},
    "128x128": {"force": dict(BM=128, BN=128)},   # one tile shape for every product
    "tiles": {"mode": "tiles"},   # matmul_fast where matmul_lanes runs (CPU adapters)
}


# the runtime's scan switches per variant (rt.kernels, engine/runtime/settings.py; parallel:
# the GPU kernels where the 8-lane scan would run)
SCAN_VARIANTS = {"default": {}, "workgroup-memory": {"scan_subgroups": False}, "parallel": {"scan_lanes": False}}


def _rate(tflops):
    """TFLOP/s, or GFLOP/s below 0.1 TFLOP/s (a CPU)."""
    return f"{tflops:6.2f}" if tflops >= 0.1 else f"{tflops * 1e3:5.1f}G"


def _median(xs):
    return float(np.median(np.asarray(xs)))


def _torch():
    """(torch, device): CUDA when it is there, else the CPU; (None, None) without torch."""
    try:
        import torch

        return torch, ("cuda" if torch.cuda.is_available() else "cpu")
    except Exception:
        return None, None


def _gpu_ms(rt, fn, reps=5, warmup=2):
    """Median GPU time (timestamp queries, ms) of the dispatches fn(rec) records, and the
    median wall time of the same (submit + wait).  Kernel names -> ms of the median run."""
    for _ in range(warmup):
        rec = rt.recorder(); fn(rec); rec.submit()
    rt.sync()
    walls = []
    for _ in range(reps):
        rec = rt.recorder()
        fn(rec)
        t0 = time.perf_counter()
        rec.submit()
        rt.sync()
        walls.append(time.perf_counter() - t0)
    gpu, parts = None, {}
    if rt.enable_profiling():
        runs = []
        for _ in range(reps):
            rec = rt.recorder(); fn(rec); rec.submit()
            rows = rt.profile_report()
            runs.append((sum(r[2] for r in rows), {r[0]: r[2] for r in rows}))
        rt.profiler = None
        runs.sort(key=lambda r: r[0])
        gpu, parts = runs[len(runs) // 2]
    return dict(ms=gpu if gpu is not None else _median(walls) * 1e3, wall_ms=_median(walls) * 1e3,
                kernels=parts)


def _torch_ms(torch, fn, reps=10, warmup=3):
    """Median ms of fn(): CUDA events on a GPU, the wall clock on the CPU."""
    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available()
    ts = []
    if cuda:
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        if cuda:
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    return _median(ts)


# ---------------------------------------------------------------------------- peer import
def peer_mamba_ssm(wait_s: float = 0.0, ready: str = "", compiled: bool = True):
    """The mamba_ssm package if it imports (waiting up to wait_s for a background build,
    until the file `ready` exists when one is named).  compiled=False: Mamba-2 rows only,
    whose Triton kernels need none of its CUDA extensions; its unbuilt sources do (the
    Mamba-1 scan's module, imported by the package, is stood in for)."""
    if not compiled:
        import types

        sys.modules.setdefault("selective_scan_cuda", types.ModuleType("selective_scan_cuda"))
        ready, wait_s = "", 0.0
    t_end = time.time() + wait_s
    while ready and not os.path.exists(ready) and time.time() < t_end:
        time.sleep(2)
    while True:
        importlib.invalidate_caches()
        try:
            import mamba_ssm  # noqa: F401
            import selective_scan_cuda  # noqa: F401  (the compiled extension)

            return mamba_ssm
        except Exception as e:
            err = e
        if time.time() >= t_end:
            print(f"mamba-ssm not available: {str(err)[:120]}", file=sys.stderr, flush=True)
            return None
        time.sleep(5)


# ---------------------------------------------------------------------------- scan
def bench_scan(rt, B, L, Di, N, R, variants=("default",)):
    from memengine.engine.kernels import scan as scan_mod
    from memengine.engine.kernels.scan import scan_state_shape, selective_scan_backward, selective_scan_forward

    rng = np.random.default_rng(0)
    M = B * L
    f32 = np.float32
    up = lambda a: rt.upload(np.asarray(a, f32))  # noqa: E731
    u, delta = up(rng.standard_normal((M, Di), f32)), up(rng.standard_normal((M, Di), f32) - 2)
    xdbl, xz = up(rng.standard_normal((M, R + 2 * N), f32)), up(rng.standard_normal((M, 2 * Di), f32))
    dt_bias, A_log, D = up(rng.standard_normal(Di) * 0.1), up(np.log(np.tile(np.arange(1, N + 1), (Di, 1)))), up(np.ones(Di))
    y, states = rt.empty((M, Di)), rt.empty(scan_state_shape(B, L, Di, N))
    dy = up(rng.standard_normal((M, Di), f32))
    du, ddelta = rt.empty((M, Di)), rt.empty((M, Di))
    ddt, dA, dD = rt.zeros((Di,)), rt.zeros((Di, N)), rt.zeros((Di,))
    dxdbl, dxz = rt.empty((M, R + 2 * N)), rt.empty((M, 2 * Di))

    def fwd(rec):
        selective_scan_forward(rec, y, states, u, delta, dt_bias, A_log, D, xdbl, xz, B=B, L=L, Di=Di, N=N, R=R)

    def bwd(rec):
        selective_scan_backward(rec, du, ddelta, ddt, dA, dD, dxdbl, dxz, dy, states, u, delta, dt_bias, A_log, D,
                                xdbl, xz, B=B, L=L, Di=Di, N=N, R=R)

    out = {}
    # bytes each input is read and each output written once
    nbytes = {"forward": 4 * M * (Di * 4 + 2 * N), "backward": 4 * M * (Di * 8 + 4 * N)}
    t_end = time.perf_counter() + 1.0   # an idle GPU clocks up first (seen: 3.5x on the first timing)
    while time.perf_counter() < t_end:
        rec = rt.recorder(); fwd(rec); bwd(rec); rec.submit(); rt.sync()
    saved = {k: getattr(rt.kernels, k) for k in ("scan_subgroups", "scan_lanes")}
    for v in variants:
        for k, val in {**saved, **SCAN_VARIANTS[v]}.items():
            setattr(rt.kernels, k, val)
        out[v] = {}
        for name, fn in (("forward", fwd), ("backward", bwd)):
            r = _gpu_ms(rt, fn)
            r["gbps"] = nbytes[name] / (r["ms"] * 1e-3) / 1e9
            out[v][name] = r
        # (the 8-lane scan has no butterfly: None)
        out[v]["butterfly_lanes"] = None if scan_mod._lanes(rt, N, R, 0) else scan_mod.butterfly_lanes(rt, B, L, Di, N)
    for k, val in saved.items():
        setattr(rt.kernels, k, val)
    for t in (u, delta, xdbl, xz, dt_bias, A_log, D, y, states, dy, du, ddelta, ddt, dA, dD, dxdbl, dxz):
        rt.free(t)
    rt.trim()
    return out


def bench_scan_peer(torch, B, L, Di, N):
    """mamba-ssm's selective_scan_fn (fp32, delta_softplus, D and z) forward and backward."""
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn

    g = torch.Generator(device="cuda").manual_seed(0)
    dev = "cuda"

    def r(*s):
        return torch.randn(*s, device=dev, generator=g, dtype=torch.float32)

    u = r(B, Di, L).requires_grad_()
    delta = (r(B, Di, L) - 2).requires_grad_()
    A = (-torch.arange(1, N + 1, device=dev, dtype=torch.float32).repeat(Di, 1)).requires_grad_()
    Bm = r(B, N, L).requires_grad_()
    Cm = r(B, N, L).requires_grad_()
    D = torch.ones(Di, device=dev).requires_grad_()
    z = r(B, Di, L).requires_grad_()
    bias = (0.1 * r(Di)).requires_grad_()
    dout = r(B, Di, L)
    holder = {}

    def f():
        holder["y"] = selective_scan_fn(u, delta, A, Bm, Cm, D, z, bias, delta_softplus=True)

    def b():
        holder["y"].backward(dout)

    def fb():
        f(); b()

    fwd_ms = _torch_ms(torch, f)
    fb_ms = _torch_ms(torch, fb)
    del holder
    torch.cuda.empty_cache()
    return dict(forward=dict(ms=fwd_ms), backward=dict(ms=fb_ms - fwd_ms), total_ms=fb_ms)


# ---------------------------------------------------------------------------- matmul
def step_matmuls(B, L, shape):
    """Every distinct matrix product of one training step: (name, calls per step, args)."""
    c = SHAPES[shape]
    E, N, V, nl = c["hidden_size"], c["state_size"], c["vocab_size"], c["num_hidden_layers"]
    Di, R = 2 * E, -(-E // 16)
    W = R + 2 * N
    M = B * L
    rows = max(1, min(2**28, 2**31) // (4 * V))                 # the model's LM-head row chunk
    mc = min(M, rows // 128 * 128 if rows >= 128 else rows)
    heads = M / mc
    T = dict(trans_a=False, trans_b=False)
    return [
        ("in_proj fwd", nl, dict(M=M, N=2 * Di, K=E, trans_b=True)),
        ("x_proj fwd", nl, dict(M=M, N=W, K=Di, trans_b=True)),
        ("dt_proj fwd", nl, dict(M=M, N=Di, K=R, trans_b=True, lda=W)),
        ("out_proj fwd", nl, dict(M=M, N=E, K=Di, trans_b=True, acc=True)),
        ("lm_head fwd", heads, dict(M=mc, N=V, K=E, trans_b=True)),
        ("lm_head dX", heads, dict(M=mc, N=E, K=V, **T)),
        ("lm_head dW", heads, dict(M=V, N=E, K=mc, trans_a=True, acc=True)),
        ("out_proj dX", nl, dict(M=M, N=Di, K=E, **T)),
        ("out_proj dW", nl, dict(M=E, N=Di, K=M, trans_a=True, acc=True)),
        ("dt_proj dX", nl, dict(M=M, N=R, K=Di, ldc=W)),
        ("dt_proj dW", nl, dict(M=Di, N=R, K=M, trans_a=True, ldb=W, acc=True)),
        ("x_proj dX", nl, dict(M=M, N=Di, K=W, acc=True)),
        ("x_proj dW", nl, dict(M=W, N=Di, K=M, trans_a=True, acc=True)),
        ("in_proj dX", nl, dict(M=M, N=E, K=2 * Di)),
        ("in_proj dW", nl, dict(M=2 * Di, N=E, K=M, trans_a=True, acc=True)),
    ]


def _stored(kw):
    """Stored shapes of A, B, C for a matmul() call (row-major, leading dimensions)."""
    M, N, K = kw["M"], kw["N"], kw["K"]
    ta, tb = kw.get("trans_a", False), kw.get("trans_b", False)
    lda = kw.get("lda") or (M if ta else K)
    ldb = kw.get("ldb") or (K if tb else N)
    ldc = kw.get("ldc") or N
    return ((K, lda) if ta else (M, lda)), ((N, ldb) if tb else (K, ldb)), (M, ldc)


def bench_matmul(rt, cases, torch, variants=("default",)):
    from memengine.engine.kernels import matmul as mm

    rows = []
    rng = np.random.default_rng(0)
    warm = True
    for name, calls, kw in cases:
        sa, sb, sc = _stored(kw)
        a = rng.random(sa, dtype=np.float32) - 0.5
        b = rng.random(sb, dtype=np.float32) - 0.5
        A, Bt, C = rt.upload(a), rt.upload(b), rt.upload(np.zeros(sc, np.float32))
        flops = 2.0 * kw["M"] * kw["N"] * kw["K"]
        row = dict(name=name, calls=calls, flops=flops, **{k: v for k, v in kw.items()})
        # correctness of the default configuration: a few rows against numpy (float64)
        rec = rt.recorder(); mm.matmul(rec, C, A, Bt, **{**kw, "acc": False}); rec.submit()
        got = rt.read(C)
        M_, N_, K_ = kw["M"], kw["N"], kw["K"]
        am = a[:K_, :M_].T if kw.get("trans_a") else a[:, :K_]     # op(A) [M, K]
        bm = b[:N_, :K_].T if kw.get("trans_b") else b[:K_, :N_]   # op(B) [K, N]
        pick = np.linspace(0, kw["M"] - 1, 8).astype(int)
        want = am[pick].astype(np.float64) @ bm.astype(np.float64)
        row["rel_err"] = float(np.abs(got[pick, :kw["N"]] - want).max() / np.abs(want).max())
        t_end = time.perf_counter() + (1.0 if warm else 0.0)   # an idle GPU clocks up first
        while warm and time.perf_counter() < t_end:
            rec = rt.recorder(); mm.matmul(rec, C, A, Bt, **kw); rec.submit(); rt.sync()
        warm = False
        for v in variants:
            old_mode, old_force = rt.kernels.matmul, rt.kernels.matmul_tiles
            rt.kernels.matmul = MATMUL_VARIANTS[v].get("mode", old_mode)
            rt.kernels.matmul_tiles = MATMUL_VARIANTS[v].get("force", old_force)
            try:
                r = _gpu_ms(rt, lambda rec: mm.matmul(rec, C, A, Bt, **kw), reps=5)
                if v != "default":   # each variant's result checked too
                    rec = rt.recorder(); mm.matmul(rec, C, A, Bt, **{**kw, "acc": False}); rec.submit()
                    r["rel_err"] = float(np.abs(rt.read(C)[pick, :kw["N"]] - want).max() / np.abs(want).max())
            finally:
                rt.kernels.matmul, rt.kernels.matmul_tiles = old_mode, old_force
            r["tflops"] = flops / (r["ms"] * 1e-3) / 1e12
            row[v] = r
        if rt.has_f16:   # --precision mixed's kernel: the same product from f16 copies
            A16, B16 = rt.empty(sa, "f16"), rt.empty(sb, "f16")
            rec = rt.recorder(); mm.cast_f16(rec, A16, A); mm.cast_f16(rec, B16, Bt); rec.submit()
            # on subgroup matrices where the adapter has them ("f16"; "f16_simt": matmul_f16 there)
            for key, sg in (("f16", True), ("f16_simt", False)):
                if not sg and not rt.has_subgroup_matrix:
                    continue
                saved, rt.kernels.sgmat = rt.kernels.sgmat, sg
                try:
                    rec = rt.recorder(); mm.matmul(rec, C, A, Bt, **{**kw, "acc": False}, A16=A16, B16=B16); rec.submit()
                    err = float(np.abs(rt.read(C)[pick, :kw["N"]] - want).max() / np.abs(want).max())
                    r = _gpu_ms(rt, lambda rec: mm.matmul(rec, C, A, Bt, **kw, A16=A16, B16=B16), reps=5)
                finally:
                    rt.kernels.sgmat = saved
                r["tflops"] = flops / (r["ms"] * 1e-3) / 1e12
                r["rel_err"] = err
                r["kernel"] = "matmul_sgmat" if sg and rt.has_subgroup_matrix else "matmul_f16"
                row[key] = r
            rt.free(A16)
            rt.free(B16)
        for t in (A, Bt, C):
            rt.free(t)
        if torch is not None:
            dev = "cuda" if torch.cuda.is_available() else "cpu"
            torch.backends.cuda.matmul.allow_tf32 = False
            ta = torch.from_numpy(a).to(dev)
            tb = torch.from_numpy(b).to(dev)
            # the same transposes and input strides; the output contiguous (cuBLAS's best case)
            av = ta[:kw["K"], :kw["M"]].t() if kw.get("trans_a") else ta[:, :kw["K"]]
            bv = tb[:kw["N"], :kw["K"]].t() if kw.get("trans_b") else tb[:kw["K"], :kw["N"]]
            tc = torch.zeros((kw["M"], kw["N"]), device=dev)
            if kw.get("acc"):
                fn = lambda: tc.addmm_(av, bv)  # noqa: E731
            else:
                fn = lambda: torch.mm(av, bv, out=tc)  # noqa: E731
            ms = _torch_ms(torch, fn)
            row["cublas" if dev == "cuda" else "torch_cpu"] = dict(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
            if dev == "cuda":   # the same product in bf16 (tensor cores; fp32 accumulation)
                ah, bh, ch = av.bfloat16(), bv.bfloat16(), tc.bfloat16()
                fn = (lambda: ch.addmm_(ah, bh)) if kw.get("acc") else (lambda: torch.mm(ah, bh, out=ch))  # noqa: E731
                ms = _torch_ms(torch, fn)
                row["cublas_bf16"] = dict(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
                del ah, bh, ch
            del ta, tb, tc, av, bv
            if dev == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
        line = f"  {name:13s} {kw['M']:6d}x{kw['N']:5d}x{kw['K']:5d}"
        for v in variants:
            line += f"  {v} {_rate(row[v]['tflops'])}"
        for key in ("f16", "f16_simt"):
            if key in row:
                line += f"  {key} {_rate(row[key]['tflops'])} (err {row[key]['rel_err']:.1e})"
        for key in ("cublas", "torch_cpu"):
            if key in row:
                line += f"  {key} {_rate(row[key]['tflops'])} TFLOP/s ({row['default']['tflops'] / row[key]['tflops']:.2f}x)"
        if "cublas_bf16" in row:
            f16 = f" (f16 {row['f16']['tflops'] / row['cublas_bf16']['tflops']:.2f}x)" if "f16" in row else ""
            line += f"  cublas_bf16 {_rate(row['cublas_bf16']['tflops'])}{f16}"
        err = max([row["rel_err"]] + [row[v].get("rel_err", 0.0) for v in variants])
        print(line + f"  err {err:.1e}", flush=True)
    rt.trim()
    return rows


# ---------------------------------------------------------------------------- train
def _batch(cfg, B, L):
    from memengine.engine.io.data import Batch

    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, size=(B, L)).astype(np.int32)
    tg = rng.integers(0, cfg.vocab_size, size=(B, L)).astype(np.int32)
    return Batch(ids=ids, targets=tg, n_targets=B * L, n_tokens=B * L)


def bench_memengine_train(rt, shape, B, L, steps, warmup=3, profile=False, precision="fp32", lora_rank=0):
    """A full training step, or (lora_rank > 0) a LoRA step: an adapter of that rank on
    in_proj and x_proj, alpha 2r, the base frozen (no gradient buffer for it).

    `warmup` steps first: a trainer submits its steps in pieces (engine/runtime/pacing.py)
    until it has timed one under pacing.BOUNDED_STEP_S, which takes two or three; the timed
    steps are its steady state, and `paced_pieces` says how many pieces they still went in
    (steps slower than that bound always go in pieces).  On an H100 (mamba-130m, L 2048,
    --precision mixed, results/h100/sgmat_wg128/) one warm-up step left the first timed step
    in pieces: B 1 17,901 tokens/s over 3 steps, against 36,737 over 10 after two."""
    from memengine.engine import lora
    from memengine.engine.app.options import TrainOptions
    from memengine.engine.models.mamba1.config import MambaConfig
    from memengine.engine.models.mamba1.init import init_weights
    from memengine.engine.models.lm import LanguageModel
    from memengine.engine.train.trainer import Trainer

    if is_mamba2(shape) or is_hybrid(shape):
        from memengine.engine import models

        cfg = models.config_from_dict(dict(SHAPES[shape]), "bench")
        weights = models.of(cfg).init_weights(cfg, 0)
    else:
        cfg = MambaConfig(**SHAPES[shape])
        weights = init_weights(cfg, 0)
    rt.trim()
    rt.peak_bytes = 0   # this row's high-water mark, not the process's
    adapter = None
    if lora_rank:
        spec = lora.LoraSpec(r=lora_rank, alpha=2 * lora_rank, targets=models_of(cfg).lora_targets)
        adapter = lora.LoraAdapter(rt, cfg, spec, lora.init_tensors(cfg, spec, 0), train=True)
    model = LanguageModel(rt, cfg, weights, lora=adapter)
    model.set_precision(precision)
    batch = _batch(cfg, B, L)
    o = TrainOptions(batch_size=B, seq_len=L, precision=precision)
    tr = Trainer(model, o, trace_capacity=max(steps, warmup))
    for _ in range(warmup):
        tr.step([batch], o.lr)
    tr.read_trace()  # a sync point: the timing starts on an idle GPU
    pieces0 = tr.pacer.pieces
    t0 = time.perf_counter()
    host = []   # each step() call: recording and submitting (the first fence.depth after the sync wait for nothing)
    for _ in range(steps):
        th = time.perf_counter()
        tr.step([batch], o.lr)
        host.append(time.perf_counter() - th)
    losses, _ = tr.read_trace()  # waits for the last step
    dt = time.perf_counter() - t0
    out = dict(tokens_per_s=B * L * steps / dt, step_s=dt / steps, loss=float(losses[-1]),
               host_step_s=min(host),   # the host's own time a step, where the queue did not make it wait
               peak_bytes=rt.peak_bytes, precision=precision,   # (the parameter, gradient and f16 stores included)
               warmup=warmup, paced_pieces=tr.pacer.pieces - pieces0)
    if tr.scaler is not None:
        out.update(tr.scaler.read())
    if profile and rt.enable_profiling():
        tr.step([batch], o.lr)
        tr.read_trace()
        out["profile"] = [list(r) for r in rt.profile_report()]
        rt.profiler = None
    del tr, model
    gc.collect()
    rt.trim()
    return out


def _torch_step(torch, model, fwd, V, ids, tg, prec, steps, warmup=2):
    """tokens/s of a training step (forward, cross-entropy, backward, clip 1.0, AdamW)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    cuda = ids.is_cuda

    def step():
        opt.zero_grad(set_to_none=True)
        if prec == "bf16":
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = fwd(ids)
        else:
            logits = fwd(ids)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1])[:, :V], tg.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.detach()

    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    if cuda:
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    B, L = ids.shape
    return dict(tokens_per_s=B * L / dt, step_s=dt, loss=float(loss),
                peak_bytes=torch.cuda.max_memory_allocated() if cuda else None)


def models_of(cfg):
    from memengine.engine import models

    return models.of(cfg)


def _has_causal_conv1d() -> bool:
    try:
        import causal_conv1d_cuda  # noqa: F401

        return True
    except ImportError:
        return False


def _mamba_ssm_model(torch, shape):
    """mamba-ssm's MambaLMHeadModel of a bench shape, fp32 on CUDA, weights from seed 0.
    Mamba-2 shapes take its Mamba2 layer (Triton SSD kernels; the fused conv path only with
    causal-conv1d, else torch's conv1d: use_mem_eff_path=False)."""
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

    c = SHAPES[shape]
    if is_mamba2(shape):
        ssm = {"layer": "Mamba2", "d_state": c["state_size"], "headdim": c["head_dim"], "ngroups": c["n_groups"],
               "chunk_size": c["chunk_size"], "use_mem_eff_path": _has_causal_conv1d()}
    else:
        ssm = {"layer": "Mamba1", "d_state": c["state_size"]}
    cfg = MambaConfig(d_model=c["hidden_size"], n_layer=c["num_hidden_layers"], vocab_size=c["vocab_size"],
                      ssm_cfg=ssm, rms_norm=True, residual_in_fp32=True, fused_add_norm=True,
                      pad_vocab_size_multiple=16 if is_mamba2(shape) else 8)
    torch.manual_seed(0)
    return MambaLMHeadModel(cfg, device="cuda", dtype=torch.float32)


def bench_peer_train(torch, shape, B, L, prec, steps):
    """mamba-ssm's MambaLMHeadModel (selective-scan CUDA kernel; causal-conv1d's kernel when
    it is installed, else torch's conv1d), fp32 with TF32 off, or bf16 autocast."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    c = SHAPES[shape]
    model = _mamba_ssm_model(torch, shape).train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c["vocab_size"], (B, L), generator=g).cuda()
    tg = torch.randint(0, c["vocab_size"], (B, L), generator=g).cuda()
    try:
        out = _torch_step(torch, model, lambda x: model(x).logits, c["vocab_size"], ids, tg, prec, steps)
    except torch.OutOfMemoryError as e:
        out = dict(error="CUDA out of memory: " + str(e)[:120])
    out["conv"] = "causal-conv1d" if _has_causal_conv1d() else "torch conv1d"
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _hybrid_fast_path() -> dict:
    """Whether transformers' hybrid takes its fused Mamba-2 kernels (mamba-ssm's and
    causal-conv1d's) or its torch path: the module's is_fast_path_available where the
    installed transformers has one, else whether both packages import (transformers 5.2x
    binds them in place of its torch functions at import time)."""
    import importlib

    mod = importlib.import_module("transformers.models.granitemoehybrid.modeling_granitemoehybrid")
    if hasattr(mod, "is_fast_path_available"):
        return dict(fast_path=bool(mod.is_fast_path_available), fast_path_from="is_fast_path_available")
    ok = {}
    for name in ("mamba_ssm", "causal_conv1d"):
        try:
            importlib.import_module(name)
            ok[name] = True
        except Exception:
            ok[name] = False
    return dict(fast_path=all(ok.values()), fast_path_from="mamba_ssm and causal_conv1d import", **ok)


def bench_hybrid_peer_train(torch, shape, B, L, steps):
    """transformers' GraniteMoeHybridForCausalLM from the shape's config on CUDA: fp32
    weights, bf16 autocast, attn_implementation='sdpa', the AdamW step included."""
    import transformers

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = transformers.GraniteMoeHybridConfig(**{k: v for k, v in SHAPES[shape].items() if k != "architectures"})
    torch.manual_seed(0)
    m = transformers.GraniteMoeHybridForCausalLM._from_config(cfg, attn_implementation="sdpa")
    m = m.to("cuda", dtype=torch.float32).train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (B, L), generator=g).cuda()
    tg = torch.randint(0, cfg.vocab_size, (B, L), generator=g).cuda()
    try:
        out = _torch_step(torch, m, lambda x: m(input_ids=x).logits, cfg.vocab_size, ids, tg, "bf16", steps)
    except torch.OutOfMemoryError as e:
        out = dict(error="CUDA out of memory: " + str(e)[:120])
    out.update(_hybrid_fast_path(), attn_implementation=m.config._attn_implementation, precision="bf16 autocast",
               transformers=transformers.__version__)
    del m
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _mambapy_calls():
    """Patch mambapy's parallel scan with a call counter (transformers imports it at each
    call and silently falls back to its loop when mambapy is missing); None without it."""
    try:
        import mambapy.pscan as ps
        from transformers.utils.import_utils import is_mambapy_available
    except ImportError:
        return None
    if not is_mambapy_available():
        return None
    if not hasattr(ps, "_memengine_calls"):
        inner = ps.pscan
        ps._memengine_calls = [0]

        def counted(*a, **k):
            ps._memengine_calls[0] += 1
            return inner(*a, **k)

        ps.pscan = counted
    return ps._memengine_calls


def _slow_path_class():
    """transformers' MambaForCausalLM on its own PyTorch code.  modeling_mamba binds
    mamba-ssm's fused functions at import time when mamba_ssm imports (a peer build that
    finished meanwhile), and those then need causal-conv1d; so it is imported afresh with
    mamba_ssm hidden."""
    import importlib

    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[0] == "mamba_ssm"}
    sys.modules["mamba_ssm"] = None     # import mamba_ssm -> ImportError while modeling_mamba loads
    try:
        import transformers.models.mamba.modeling_mamba as mm

        mm = importlib.reload(mm)
    finally:
        del sys.modules["mamba_ssm"]
        sys.modules.update(saved)
    return mm.MambaForCausalLM


def bench_torch_train(torch, shape, B, L, steps, device, warmup=1, mambapy=False):
    """transformers' MambaForCausalLM as installed, fp32 (TF32 off): without mamba-ssm
    (and on the CPU) that is its pure-PyTorch loop over time steps, the slow path; with
    mambapy=True its parallel scan from the mambapy package (the fastest CPU path)."""
    import transformers

    torch.backends.cuda.matmul.allow_tf32 = False
    calls = None
    if mambapy:
        calls = _mambapy_calls()
        if calls is None:
            return dict(error="mambapy not installed (pip install -e '.[bench]')")
        calls[0] = 0
    if is_mamba2(shape):   # Mamba2ForCausalLM's torch_forward: its naive chunked SSD
        cfg = transformers.Mamba2Config(**_fields(shape))
        model_class = transformers.Mamba2ForCausalLM
    else:
        cfg = transformers.MambaConfig(**SHAPES[shape], use_mambapy=mambapy)
        model_class = _slow_path_class() if device == "cuda" else transformers.MambaForCausalLM
    torch.manual_seed(0)
    m = model_class(cfg).to(device).train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (B, L), generator=g).to(device)
    tg = torch.randint(0, cfg.vocab_size, (B, L), generator=g).to(device)
    try:
        out = _torch_step(torch, m, lambda x: m(input_ids=x).logits, cfg.vocab_size, ids, tg, "fp32", steps, warmup)
    except torch.OutOfMemoryError as e:
        out = dict(error="CUDA out of memory: " + str(e)[:120])
    if calls is not None:
        out["pscan_calls"] = calls[0]
        if calls[0] == 0:
            out = dict(error="transformers did not call mambapy's pscan")
    del m
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def _cpu_rounds(rt, torch, row, shape, B, L, steps, rounds, threads):
    """CPU: memengine and transformers + mambapy in alternating rounds, the peer at each
    torch thread count in `threads` and the fastest taken (on a loaded machine one thread
    can beat all cores by 5x); the medians and the median of the per-round ratios."""
    ours, peer, ratios, per_threads = [], [], [], {t: [] for t in threads}
    for _ in range(max(1, rounds)):
        me = bench_memengine_train(rt, shape, B, L, steps)
        best = 0.0
        for t in threads:
            torch.set_num_threads(t)
            pp = bench_torch_train(torch, shape, B, L, steps, "cpu", mambapy=not is_mamba2(shape))
            if "error" in pp:
                row["mambapy"] = pp
                return
            per_threads[t].append(pp["tokens_per_s"])
            best = max(best, pp["tokens_per_s"])
        ours.append(me["tokens_per_s"])
        peer.append(best)
        ratios.append(ours[-1] / peer[-1])
    torch.set_num_threads(max(threads))
    row["memengine"].update(tokens_per_s=_median(ours), rounds=ours)
    row["torch_path" if is_mamba2(shape) else "mambapy"] = dict(tokens_per_s=_median(peer), rounds=peer, ratio=_median(ratios),
                          by_threads={str(t): v for t, v in per_threads.items()},
                          pscan_calls=pp.get("pscan_calls"))


# ---------------------------------------------------------------------------- decode
def _decode_stats(runs):
    """runs: [(ttft_s, [host arrival time of each new token])] -> medians over the runs.
    tokens_per_s is 1 / the median gap between consecutive tokens (robust to a machine shared
    with other work); tokens_per_s_mean is (n-1) / (last - first) of the median run."""
    ttft = _median([r[0] for r in runs])
    gaps = np.concatenate([np.diff(r[1]) for r in runs if len(r[1]) > 1])
    means = [(len(r[1]) - 1) / max(r[1][-1] - r[1][0], 1e-9) for r in runs if len(r[1]) > 1]
    return dict(ttft_s=ttft, tokens_per_s=1.0 / max(float(np.median(gaps)), 1e-12),
                tokens_per_s_mean=_median(means), tokens=len(runs[0][1]), runs=len(runs))


class _Clock:
    """A streamer for transformers' and mamba-ssm's generate: put() gets the prompt, then
    each new token; it records when each arrives on the host (after a CUDA sync)."""

    def __init__(self, torch):
        self.torch, self.times = torch, []

    def put(self, value):
        if self.torch.cuda.is_available():
            self.torch.cuda.synchronize()
        self.times.append(time.perf_counter())

    def end(self):
        pass


def _decode_ids(shape, prompt_len):
    return np.random.default_rng(0).integers(0, SHAPES[shape]["vocab_size"], prompt_len)


def bench_decode(rt, shape, prompt_len, new_tokens, reps=3):
    """memengine's generation at one shape (random weights, random prompt, no EOS), greedy
    and sampling (T 0.8, top-k 50, top-p 0.95): one run to warm up, then `reps`; the host's
    arrival time of every token from the on_token callback."""
    from memengine.engine.app.generate import Decoder, generate
    from memengine.engine.app.options import SamplingOptions
    from memengine.engine.models.mamba1.config import MambaConfig
    from memengine.engine.models.mamba1.init import init_weights
    from memengine.engine.models.lm import LanguageModel

    cfg = MambaConfig(**SHAPES[shape])
    ids = _decode_ids(shape, prompt_len)
    out = {}
    rt.trim()
    model = LanguageModel(rt, cfg, init_weights(cfg, 0))
    dec = Decoder(model)
    for name, kw in (("greedy", dict(temperature=0)), ("sample", dict(temperature=0.8, top_k=50, top_p=0.95))):
        o = SamplingOptions(max_new_tokens=new_tokens, **kw)
        runs = []
        for rep in range(reps + 1):
            times = []
            r = generate(model, ids, o, decode=lambda x: "", decoder=dec,
                         on_token=lambda _t: times.append(time.perf_counter()))
            if rep:                                        # run 0 warms up (pipelines)
                runs.append((r.ttft_s, times))
        out[name] = _decode_stats(runs)
    dec.close()
    del model, dec
    gc.collect()
    rt.trim()
    return out


def bench_decode_transformers(torch, device, shape, prompt_len, new_tokens, reps=3):
    """transformers' MambaForCausalLM.generate (greedy, fp32) as installed: on the CPU its
    PyTorch path; on CUDA the mamba-ssm kernels where they import, else the slow path."""
    import transformers

    torch.manual_seed(0)
    m = transformers.MambaForCausalLM(transformers.MambaConfig(**SHAPES[shape])).to(device).eval()
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    ids = torch.tensor(_decode_ids(shape, prompt_len)[None], dtype=torch.long, device=device)
    runs = []
    for rep in range(reps + 1):
        clock = _Clock(torch)
        t0 = time.perf_counter()
        with torch.no_grad():
            m.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, streamer=clock)
        if rep:
            runs.append((clock.times[1] - t0, clock.times[1:]))   # times[0]: the prompt
    del m
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return _decode_stats(runs)


def bench_decode_peer(torch, shape, prompt_len, new_tokens, reps=3):
    """mamba-ssm's MambaLMHeadModel.generate with CUDA graphs (cg=True), greedy (top_k 1),
    fp32; per-token times from its streamer."""
    m = _mamba_ssm_model(torch, shape).eval()
    ids = torch.tensor(_decode_ids(shape, prompt_len)[None], dtype=torch.long, device="cuda")
    runs = []
    for rep in range(reps + 1):
        clock = _Clock(torch)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        m.generate(ids, max_length=prompt_len + new_tokens, cg=True, top_k=1, streamer=clock)
        if rep:
            runs.append((clock.times[1] - t0, clock.times[1:]))
    out = _decode_stats(runs)
    del m
    gc.collect()
    torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------- report
def _fmt_ratio(x):
    return f"{x:.2f}x" if x is not None else "-"


def summary(res) -> list:
    lines = []
    sc = res.get("scan") or {}
    if sc:
        lines.append("selective scan (B, L, Di, N = %s)" % (sc.get("shape"),))
        peer = sc.get("mamba_ssm")
        for v, r in sc.items():
            if not isinstance(r, dict) or "forward" not in r or v == "mamba_ssm":
                continue
            tot = r["forward"]["ms"] + r["backward"]["ms"]
            line = f"  memengine {v:16s} fwd {r['forward']['ms']:7.3f} ms  bwd {r['backward']['ms']:7.3f} ms  total {tot:7.3f} ms"
            if peer:
                line += f"   peer/ours {peer['total_ms'] / tot:.2f}x"
            lines.append(line)
        if peer:
            lines.append(f"  mamba-ssm selective_scan_fn  fwd {peer['forward']['ms']:7.3f} ms  bwd {peer['backward']['ms']:7.3f} ms  total {peer['total_ms']:7.3f} ms")
    mm = res.get("matmul") or []
    if mm:
        variants = [v for v in MATMUL_VARIANTS if v in mm[0]]
        lines.append("matmul (TFLOP/s, G = GFLOP/s; ratio = ours / torch fp32: cuBLAS with TF32 off, or torch on the CPU)")
        for r in mm:
            line = f"  {r['name']:13s} " + " ".join(f"{v}={_rate(r[v]['tflops'])}" for v in variants)
            if "f16" in r:
                line += f" f16={_rate(r['f16']['tflops'])}"
            for key in ("cublas", "torch_cpu"):
                if key in r:
                    line += f"  {key}={_rate(r[key]['tflops'])}  {r['default']['tflops'] / r[key]['tflops']:.2f}x"
            lines.append(line)
        tot = {v: sum(r["calls"] * r[v]["ms"] for r in mm) for v in variants}
        line = "  step total ms: " + " ".join(f"{v}={tot[v]:.1f}" for v in variants)
        if all("f16" in r for r in mm):
            line += f" f16={sum(r['calls'] * r['f16']['ms'] for r in mm):.1f}"
        for key in ("cublas", "torch_cpu"):
            if all(key in r for r in mm):
                cbt = sum(r["calls"] * r[key]["ms"] for r in mm)
                line += f"  {key}={cbt:.1f}  {key}/ours time {cbt / tot['default']:.2f}x"
        lines.append(line)
    for row in res.get("train", []):
        me = row.get("memengine", {})
        line = f"train {row['shape']} B={row['B']} L={row['L']}: memengine {me.get('tokens_per_s', 0):8.0f} tok/s"
        if me.get("peak_bytes"):
            line += f" ({me['peak_bytes'] / 2**30:.1f} GiB)"
        mx = row.get("memengine_mixed")
        if mx and mx.get("tokens_per_s") and me is not mx:
            line += (f"  mixed {mx['tokens_per_s']:8.0f} tok/s ({mx['peak_bytes'] / 2**30:.1f} GiB, "
                     f"{mx['tokens_per_s'] / max(me.get('tokens_per_s', 0), 1e-9):.2f}x fp32)")
        for key in ("mamba_ssm_fp32", "mamba_ssm_bf16", "mambapy", "torch_path", "slow_path", "torch_cpu",
                    "transformers_bf16"):
            p = row.get(key)
            if not p:
                continue
            if p.get("tokens_per_s"):
                ratio = p.get("ratio") or me.get("tokens_per_s", 0) / p["tokens_per_s"]
                line += f" | {key} {p['tokens_per_s']:8.0f} ({ratio:.2f}x"
                if mx and mx.get("tokens_per_s") and me is not mx:   # and the mixed step's ratio
                    line += f", mixed {mx['tokens_per_s'] / p['tokens_per_s']:.2f}x"
                line += f", {p['peak_bytes'] / 2**30:.1f} GiB)" if p.get("peak_bytes") else ")"
            else:
                line += f" | {key}: {p.get('error', '?')[:50]}"
            if "fast_path" in p:
                line += f" fast path {p['fast_path']}"
        if "error" in me:
            line += f" | memengine error: {me['error'][:80]}"
        lines.append(line)
        lo = row.get("memengine_lora")
        if lo:
            line = f"  LoRA r={lo.get('rank', '?')} step: {lo.get('tokens_per_s', 0):8.0f} tok/s"
            if lo.get("peak_bytes"):
                line += f" ({lo['peak_bytes'] / 2**30:.2f} GiB)"
            if lo.get("tokens_per_s") and me.get("tokens_per_s"):
                line += f" | {lo['tokens_per_s'] / me['tokens_per_s']:.2f}x the full step's speed"
            if lo.get("peak_bytes") and me.get("peak_bytes"):
                line += f", {lo['peak_bytes'] / me['peak_bytes']:.2f}x its memory"
            if "error" in lo:
                line += f" | error: {lo['error'][:80]}"
            lines.append(line)
    for row in res.get("decode", []):
        head = f"decode {row['shape']} prompt {row['prompt_len']} + {row['new_tokens']} new:"
        base = (row.get("memengine") or {}).get("greedy", {}).get("tokens_per_s")
        for key, v in [(f"memengine {k}", x) for k, x in (row.get("memengine") or {}).items()] + \
                [(k, row[k]) for k in ("transformers", "mamba_ssm") if k in row]:
            if "error" in v:
                lines.append(f"{head} {key:18s} error: {v['error'][:100]}")
                continue
            ratio = f"  ours/peer {base / v['tokens_per_s']:.2f}x" if base and not key.startswith("memengine") else ""
            lines.append(f"{head} {key:18s} {v['tokens_per_s']:9.1f} tok/s (mean {v['tokens_per_s_mean']:.1f}), "
                         f"first token {1e3 * v['ttft_s']:8.1f} ms{ratio}")
    prof = res.get("profile")
    if prof:
        total = sum(r[2] for r in prof)
        lines.append(f"profile of one step ({res.get('profile_of')}): {total:.1f} ms of kernel time")
        for k, n, ms in prof[:14]:
            lines.append(f"  {k:45s} {n:5d} calls {ms:9.2f} ms  {100 * ms / total:5.1f}%")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="scan,matmul,train", help="scan, matmul, train, decode (comma list) or all")
    ap.add_argument("--shapes", default="mamba-130m", help="model shapes for train, matmul and decode")
    ap.add_argument("--seq", default="2048")
    ap.add_argument("--batch", default="8,1")
    ap.add_argument("--steps", type=int, default=5, help="timed training steps (after --warmup steps)")
    ap.add_argument("--warmup", type=int, default=3,
                    help="memengine's untimed steps before them (its first steps go in pieces until one is timed)")
    ap.add_argument("--peer-steps", type=int, default=None,
                    help="timed steps of the PyTorch peers (default: --steps, so both sides average as many)")
    ap.add_argument("--device", default=None, help="memengine --device (auto|gpu|cpu|NAME)")
    ap.add_argument("--peer-wait", type=float, default=0.0,
                    help="seconds to wait for mamba-ssm to become importable (a build in the background)")
    ap.add_argument("--peer-ready", default="", help="a file the background build creates when it is done")
    ap.add_argument("--bf16-batches", default="8", help="batch sizes at which mamba-ssm bf16 runs too")
    ap.add_argument("--slow-path", default="", help="CUDA: B,L at which to time transformers' slow path too (e.g. 1,512)")
    ap.add_argument("--no-torch", action="store_true", help="no PyTorch peer at all")
    ap.add_argument("--rounds", type=int, default=3,
                    help="CPU: rounds of memengine and the mambapy peer, interleaved (a shared machine's load hits both)")
    ap.add_argument("--torch-threads", default="",
                    help="CPU: torch thread counts tried for the mambapy peer, fastest kept (default: 1 and all cores)")
    ap.add_argument("--no-slow-path", action="store_true", help="CPU: skip transformers' loop over time steps")
    ap.add_argument("--prompt-len", type=int, default=128, help="decode: prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=128, help="decode: tokens generated")
    ap.add_argument("--out", default="bench-results.json")
    ap.add_argument("--variants", action="store_true", help="also time the kernel configurations that are not the default")
    ap.add_argument("--profile", action="store_true", help="time the first train row's step kernel by kernel")
    ap.add_argument("--precision", default="fp32",
                    help="train suite: fp32, mixed or both (fp32,mixed: a memengine_mixed entry per row)")
    ap.add_argument("--lora-rank", type=int, default=8,
                    help="train: also time a LoRA step (an adapter of this rank on in_proj and x_proj); 0 = off")
    a = ap.parse_args(argv)
    if a.peer_steps is None:
        a.peer_steps = a.steps

    from memengine.engine.runtime import get_runtime

    rt = get_runtime(a.device)
    torch, tdev = (None, None) if a.no_torch else _torch()
    cuda = tdev == "cuda"
    if tdev == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    suites = {"scan", "matmul", "train", "decode"} if a.suite == "all" else set(a.suite.split(","))
    res = dict(adapter=rt.describe(), host=platform.node(), cpus=os.cpu_count(), features=rt.capabilities()["features"],
               torch_device=torch.cuda.get_device_name() if cuda else tdev, train=[], matmul=[], scan={})
    print(f"adapter: {rt.describe()}  features: {res['features']}  torch: {res['torch_device']}", flush=True)
    cpu = rt.adapter_type.lower() == "cpu"
    shapes = a.shapes.split(",")
    shape = shapes[-1]

    def save():   # after every suite: a run cut short keeps what it measured
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)

    if "scan" in suites:
        sshape = (1, 256, 64, 8, 4) if cpu else (8, 2048, 1536, 16, 48)
        variants = list(SCAN_VARIANTS) if a.variants else ["default"]
        res["scan"] = dict(shape=list(sshape[:4]), **bench_scan(rt, *sshape, variants=variants))
        for v in variants:
            r = res["scan"][v]
            print(f"scan {v}: forward {r['forward']['ms']:.3f} ms ({r['forward']['gbps']:.0f} GB/s), "
                  f"backward {r['backward']['ms']:.3f} ms ({r['backward']['gbps']:.0f} GB/s), "
                  + ("the 8-lane kernel" if r["butterfly_lanes"] is None
                     else f"butterfly over {r['butterfly_lanes']} subgroup lanes"), flush=True)
        save()

    if "matmul" in suites:
        if cpu:   # the step's products at B 1 and the first --seq
            cases = step_matmuls(1, int(a.seq.split(",")[0]), shape)
        else:
            cases = step_matmuls(8, 2048, shape)
        variants = list(MATMUL_VARIANTS) if a.variants else ["default"]
        print("matmul (TFLOP/s):", flush=True)
        res["matmul"] = bench_matmul(rt, cases, torch, variants)
        save()

    if "train" in suites:
        for sh in shapes:
            for L in [int(x) for x in a.seq.split(",")]:
                for B in [int(x) for x in a.batch.split(",")]:
                    row = dict(shape=sh, B=B, L=L)
                    for prec in a.precision.split(","):
                        key = "memengine" if prec == "fp32" else f"memengine_{prec}"
                        prof = a.profile and not res.get(f"profile_{prec}" if prec != "fp32" else "profile")
                        try:
                            row[key] = bench_memengine_train(rt, sh, B, L, a.steps, a.warmup, profile=prof, precision=prec)
                        except Exception as e:
                            row[key] = dict(error=str(e)[:300])
                        if prof and "profile" in row[key]:
                            pk = "profile" if prec == "fp32" else f"profile_{prec}"
                            res[pk] = row[key].pop("profile")
                            res[pk + "_of"] = f"{sh} B={B} L={L}"
                    row.setdefault("memengine", row.get("memengine_mixed", {}))
                    if a.lora_rank:
                        try:
                            row["memengine_lora"] = bench_memengine_train(rt, sh, B, L, a.steps, lora_rank=a.lora_rank)
                            row["memengine_lora"]["rank"] = a.lora_rank
                        except Exception as e:
                            row["memengine_lora"] = dict(error=str(e)[:300])
                    if is_hybrid(sh):
                        print(f"train {sh}: the transformers peer runs only on CUDA"
                              + ("" if cuda else f" (torch: {tdev or 'not importable'}); no peer row"), flush=True)
                    elif tdev == "cpu":   # the CPU peers: always
                        threads = sorted({int(x) for x in a.torch_threads.split(",")} if a.torch_threads
                                         else {1, os.cpu_count() or 1})
                        _cpu_rounds(rt, torch, row, sh, B, L, a.steps, a.rounds, threads)
                        if not a.no_slow_path and not is_mamba2(sh):
                            row["torch_cpu"] = bench_torch_train(torch, sh, B, L, a.steps, "cpu")
                    res["train"].append(row)
                    line = f"train {sh} B={B} L={L}: memengine {row['memengine'].get('tokens_per_s', 0):.0f} tok/s"
                    if "memengine_mixed" in row:
                        line += f", mixed {row['memengine_mixed'].get('tokens_per_s', 0):.0f} tok/s"
                    if row.get("mambapy", {}).get("ratio"):
                        line += f", transformers+mambapy {row['mambapy']['tokens_per_s']:.0f} ({row['mambapy']['ratio']:.2f}x)"
                    if row.get("torch_path", {}).get("ratio"):
                        line += (f", transformers' torch path {row['torch_path']['tokens_per_s']:.0f} "
                                 f"({row['torch_path']['ratio']:.2f}x)")
                    print(line, flush=True)
                    save()
        if a.slow_path and cuda:
            B, L = (int(x) for x in a.slow_path.split(","))
            row = dict(shape=shape, B=B, L=L, memengine=bench_memengine_train(rt, shape, B, L, a.steps))
            row["slow_path"] = bench_torch_train(torch, shape, B, L, 1, "cuda")
            res["train"].append(row)

    if "decode" in suites:
        res["decode"] = []
        for sh in shapes:
            row = dict(shape=sh, prompt_len=a.prompt_len, new_tokens=a.new_tokens)
            try:
                row["memengine"] = bench_decode(rt, sh, a.prompt_len, a.new_tokens)
            except Exception as e:
                row["memengine"] = dict(greedy=dict(error=str(e)[:300]))
            if torch is not None:
                try:
                    row["transformers"] = bench_decode_transformers(torch, tdev, sh, a.prompt_len, a.new_tokens)
                except Exception as e:
                    row["transformers"] = dict(error=str(e)[:300])
            res["decode"].append(row)
            print("\n".join(summary(dict(decode=[row]))), flush=True)
            save()

    # the peer last: it may still be building in the background
    if cuda and suites & {"train", "scan", "decode"}:
        rt.trim()
        gc.collect()
        for row in res["train"]:
            if is_hybrid(row["shape"]):
                try:
                    row["transformers_bf16"] = bench_hybrid_peer_train(torch, row["shape"], row["B"], row["L"],
                                                                       a.peer_steps)
                except Exception as e:
                    row["transformers_bf16"] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
                save()
        compiled = "scan" in suites or any(not is_mamba2(sh) for sh in shapes)
        if peer_mamba_ssm(a.peer_wait, a.peer_ready, compiled) is not None:
            if "scan" in suites and not cpu:
                B, L, Di, N = res["scan"]["shape"]
                res["scan"]["mamba_ssm"] = bench_scan_peer(torch, B, L, Di, N)
            for row in res["train"]:
                if "slow_path" in row or is_hybrid(row["shape"]):
                    continue
                row["mamba_ssm_fp32"] = bench_peer_train(torch, row["shape"], row["B"], row["L"], "fp32", a.peer_steps)
                if str(row["B"]) in a.bf16_batches.split(","):
                    row["mamba_ssm_bf16"] = bench_peer_train(torch, row["shape"], row["B"], row["L"], "bf16", a.peer_steps)
            for row in res.get("decode", []):
                try:
                    row["mamba_ssm"] = bench_decode_peer(torch, row["shape"], row["prompt_len"], row["new_tokens"])
                except Exception as e:
                    row["mamba_ssm"] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        elif "decode" in suites:
            print("decode: no mamba-ssm row (it does not import; see above)", flush=True)

    save()
    print("\n".join(summary(res)))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
