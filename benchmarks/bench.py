"""memengine vs PyTorch, measured in the same run on the same device.

    python benchmarks/bench.py --suite train --shapes tiny --seq 128 --batch 1
    python benchmarks/bench.py --suite all --torch-device cuda --out results.json   # on a GPU machine

Suites:
  train   tokens/s of one training step (forward + backward + AdamW): memengine (wgpu)
          vs transformers' MambaForCausalLM + torch.optim.AdamW, fp32 (TF32 off and on
          on CUDA); peak GPU memory of each.
  matmul  GFLOP/s of our matmul kernel vs torch.matmul (fp32, TF32 off).
  scan    selective-scan forward and backward effective GB/s (bytes read + written once).

Prints a table and writes every number to --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np

SHAPES = {
    # name: (vocab, E, N, layers)
    "tiny": dict(vocab_size=256, hidden_size=64, state_size=8, num_hidden_layers=2),
    "small": dict(vocab_size=256, hidden_size=256, state_size=16, num_hidden_layers=4),
    "mamba-130m": dict(vocab_size=50280, hidden_size=768, state_size=16, num_hidden_layers=24),
}


def _median(xs):
    return float(np.median(np.asarray(xs)))


def bench_memengine_train(rt, shape, B, L, steps, warmup=1):
    from memengine.engine.config import MambaConfig
    from memengine.engine.data import Batch
    from memengine.engine.init import init_weights
    from memengine.engine.model import MambaModel
    from memengine.engine.options import TrainOptions
    from memengine.engine.trainer import Trainer

    cfg = MambaConfig(**SHAPES[shape])
    model = MambaModel(rt, cfg, init_weights(cfg, 0))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, size=(B, L)).astype(np.int32)
    tg = rng.integers(0, cfg.vocab_size, size=(B, L)).astype(np.int32)
    batch = Batch(ids=ids, targets=tg, n_targets=B * L, n_tokens=B * L)
    o = TrainOptions(batch_size=B, seq_len=L)
    tr = Trainer(model, o, trace_capacity=max(steps, warmup))
    for _ in range(warmup):
        tr.step([batch], o.lr)
    tr.read_trace()  # a sync point: the timing starts on an idle GPU
    t0 = time.perf_counter()
    for _ in range(steps):
        tr.step([batch], o.lr)
    losses, _ = tr.read_trace()  # waits for the last step
    dt = time.perf_counter() - t0
    extra = 4 * (model.P.numel + model.G.numel)
    return dict(tokens_per_s=B * L * steps / dt, step_s=dt / steps, loss=float(losses[-1]),
                peak_bytes=rt.peak_bytes + extra)


def profile_step(rt, shape, B, L):
    from memengine.engine.config import MambaConfig
    from memengine.engine.data import Batch
    from memengine.engine.init import init_weights
    from memengine.engine.model import MambaModel
    from memengine.engine.options import TrainOptions
    from memengine.engine.trainer import Trainer

    cfg = MambaConfig(**SHAPES[shape])
    model = MambaModel(rt, cfg, init_weights(cfg, 0))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, size=(B, L)).astype(np.int32)
    batch = Batch(ids=ids, targets=ids, n_targets=B * L, n_tokens=B * L)
    o = TrainOptions(batch_size=B, seq_len=L)
    tr = Trainer(model, o)
    tr.step([batch], o.lr)
    tr.read_trace()
    if not rt.enable_profiling():
        print("the adapter has no timestamp queries; no profile", file=sys.stderr)
        return []
    tr.step([batch], o.lr)
    tr.read_trace()
    rows = rt.profile_report()
    rt.profiler = None
    return [list(r) for r in rows]


def bench_torch_train(shape, B, L, steps, device, tf32, warmup=1):
    import torch
    import transformers

    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    cfg = transformers.MambaConfig(**SHAPES[shape])
    torch.manual_seed(0)
    m = transformers.MambaForCausalLM(cfg).to(device).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (B, L), generator=g).to(device)
    tg = torch.randint(0, cfg.vocab_size, (B, L), generator=g).to(device)

    def step():
        opt.zero_grad(set_to_none=True)
        logits = m(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), tg.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        return loss

    for _ in range(warmup):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    if device == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    return dict(tokens_per_s=B * L * steps / dt, step_s=dt / steps, loss=float(loss), peak_bytes=peak)


def bench_matmul(rt, sizes, torch_device, reps=5, constants=None):
    from memengine.engine.ops import matmul as mm
    from memengine.engine.ops.matmul import matmul

    mm.FAST_CONSTANTS = dict(constants or {})

    rows = []
    for (M, N, K) in sizes:
        rng = np.random.default_rng(0)
        A = rt.upload(rng.standard_normal((M, K), dtype=np.float32))
        B = rt.upload(rng.standard_normal((K, N), dtype=np.float32))
        C = rt.empty((M, N))
        rec = rt.recorder()
        matmul(rec, C, A, B, M=M, N=N, K=K)
        rec.submit()
        rt.sync()
        times = []
        for _ in range(reps):
            rec = rt.recorder()
            for _ in range(4):
                matmul(rec, C, A, B, M=M, N=N, K=K)
            t0 = time.perf_counter()
            rec.submit()
            rt.sync()
            times.append((time.perf_counter() - t0) / 4)
        ours = 2 * M * N * K / _median(times) / 1e9
        # correctness spot check
        a, b = rt.read(A)[:8], rt.read(B)
        err = float(np.abs(rt.read(C)[:8] - a @ b).max() / np.abs(a @ b).max())
        theirs = None
        try:
            import torch

            torch.backends.cuda.matmul.allow_tf32 = False
            ta = torch.randn(M, K, device=torch_device)
            tb = torch.randn(K, N, device=torch_device)
            for _ in range(2):
                ta @ tb
            ts = []
            for _ in range(reps):
                if torch_device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(4):
                    ta @ tb
                if torch_device == "cuda":
                    torch.cuda.synchronize()
                ts.append((time.perf_counter() - t0) / 4)
            theirs = 2 * M * N * K / _median(ts) / 1e9
        except Exception as e:  # pragma: no cover
            print("torch matmul failed:", e, file=sys.stderr)
        for t in (A, B, C):
            rt.free(t)
        rows.append(dict(M=M, N=N, K=K, gflops=ours, torch_gflops=theirs, rel_err=err, constants=constants or {}))
    mm.FAST_CONSTANTS = {}
    return rows


def bench_scan(rt, B, L, Di, N, R, reps=3, chunked=False):
    from memengine.engine.ops import scan as scan_mod
    from memengine.engine.ops.scan import scan_state_shape, selective_scan_backward, selective_scan_forward

    scan_mod._SERIAL = not chunked

    rng = np.random.default_rng(0)
    M = B * L
    up = lambda a: rt.upload(np.asarray(a, np.float32))  # noqa: E731
    u, delta = up(rng.standard_normal((M, Di))), up(rng.standard_normal((M, Di)) - 2)
    xdbl, xz = up(rng.standard_normal((M, R + 2 * N))), up(rng.standard_normal((M, 2 * Di)))
    dt_bias, A_log, D = up(rng.standard_normal(Di) * 0.1), up(np.log(np.tile(np.arange(1, N + 1), (Di, 1)))), up(np.ones(Di))
    y, states = rt.empty((M, Di)), rt.empty(scan_state_shape(B, L, Di, N))
    dy = up(rng.standard_normal((M, Di)))
    du, ddelta = rt.empty((M, Di)), rt.empty((M, Di))
    ddt, dA, dD = rt.zeros((Di,)), rt.zeros((Di, N)), rt.zeros((Di,))
    dxdbl, dxz = rt.empty((M, R + 2 * N)), rt.empty((M, 2 * Di))

    def fwd(rec):
        selective_scan_forward(rec, y, states, u, delta, dt_bias, A_log, D, xdbl, xz, B=B, L=L, Di=Di, N=N, R=R)

    def bwd(rec):
        selective_scan_backward(rec, du, ddelta, ddt, dA, dD, dxdbl, dxz, dy, states, u, delta, dt_bias, A_log, D,
                                xdbl, xz, B=B, L=L, Di=Di, N=N, R=R)

    out = {}
    for name, fn, nbytes in (
        ("forward", fwd, 4 * M * (Di * 4 + 2 * N)),
        ("backward", bwd, 4 * M * (Di * 8 + 4 * N)),
    ):
        for _ in range(3):  # warm-up: pipelines, and a GPU that has been idle clocks up
            rec = rt.recorder(); fwd(rec); fn(rec); rec.submit(); rt.sync()
        ts = []
        for _ in range(reps):
            rec = rt.recorder()
            fn(rec)
            t0 = time.perf_counter()
            rec.submit()
            rt.sync()
            ts.append(time.perf_counter() - t0)
        out[name] = dict(ms=_median(ts) * 1e3, gbps=nbytes / _median(ts) / 1e9)
    scan_mod._SERIAL = os.environ.get("MEMENGINE_SCAN", "serial") != "chunked"
    rt.trim()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="all", help="train, matmul, scan or all (comma list)")
    ap.add_argument("--shapes", default="tiny,mamba-130m")
    ap.add_argument("--seq", default="512,2048")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--torch-steps", type=int, default=None, help="timed steps for the PyTorch peer (default --steps)")
    ap.add_argument("--device", default=None, help="memengine --device (auto|gpu|cpu|NAME)")
    ap.add_argument("--torch-device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch peer")
    ap.add_argument("--tf32", default="both", choices=["both", "off", "on"], help="PyTorch CUDA matmul modes to run")
    ap.add_argument("--out", default="bench-results.json")
    ap.add_argument("--variants", action="store_true", help="also time kernel variants (matmul PREFETCH off)")
    ap.add_argument("--profile", action="store_true",
                    help="after the train suite, time one step per kernel with timestamp queries")
    a = ap.parse_args(argv)

    from memengine.engine.gpu import get_runtime

    rt = get_runtime(a.device)
    try:
        import torch

        tdev = a.torch_device or ("cuda" if torch.cuda.is_available() else "cpu")
        if tdev == "cpu":
            torch.set_num_threads(os.cpu_count() or 1)
    except Exception:
        tdev = None
    suites = set(a.suite.split(",")) if a.suite != "all" else {"train", "matmul", "scan"}
    res = dict(adapter=rt.describe(), torch_device=tdev, host=platform.node(), cpus=os.cpu_count(), train=[],
               matmul=[], scan={})
    print(f"adapter: {rt.describe()}   torch: {tdev}", flush=True)

    if "matmul" in suites:
        sizes = [(1024, 1024, 1024), (4096, 4096, 4096), (16384, 3072, 768), (16384, 768, 1536)]
        if rt.adapter_type.lower() == "cpu":
            sizes = [(256, 256, 256), (512, 512, 512)]
        res["matmul"] = bench_matmul(rt, sizes, tdev or "cpu")
        if a.variants:
            res["matmul"] += bench_matmul(rt, sizes, tdev or "cpu", constants={"PREFETCH": 0})
        for r in res["matmul"]:
            ratio = r["gflops"] / r["torch_gflops"] if r["torch_gflops"] else float("nan")
            print(f"matmul {r['M']}x{r['N']}x{r['K']}{' ' + str(r['constants']) if r['constants'] else ''}: {r['gflops']:.0f} GFLOP/s vs torch {r['torch_gflops'] or 0:.0f}"
                  f" ({ratio:.2f}x) rel err {r['rel_err']:.1e}", flush=True)

    if "scan" in suites:
        shape = (1, 256, 64, 8, 4) if rt.adapter_type.lower() == "cpu" else (8, 2048, 1536, 16, 48)
        res["scan"] = bench_scan(rt, *shape)
        if a.variants:
            res["scan_chunked"] = bench_scan(rt, *shape, chunked=True)
        for key in ("scan", "scan_chunked"):
            for k, v in res.get(key, {}).items():
                print(f"{key} {k} (B,L,Di,N,R={shape}): {v['ms']:.2f} ms, {v['gbps']:.1f} GB/s", flush=True)

    if "train" in suites:
        for shape in a.shapes.split(","):
            for L in [int(x) for x in a.seq.split(",")]:
                for B in [int(x) for x in a.batch.split(",")]:
                    row = dict(shape=shape, B=B, L=L)
                    try:
                        row["memengine"] = bench_memengine_train(rt, shape, B, L, a.steps)
                    except Exception as e:
                        row["memengine"] = dict(error=str(e)[:300])
                    rt.trim()  # give our GPU memory back before the peer runs
                    import gc

                    gc.collect()
                    if not a.no_torch and tdev:
                        modes = {"both": [False, True], "off": [False], "on": [True]}[a.tf32]
                        for tf32 in (modes if tdev == "cuda" else [False]):
                            key = "torch_tf32" if tf32 else "torch"
                            try:
                                row[key] = bench_torch_train(shape, B, L, a.torch_steps or a.steps, tdev, tf32)
                            except Exception as e:
                                row[key] = dict(error=str(e)[:300])
                            gc.collect()
                            if tdev == "cuda":
                                torch.cuda.empty_cache()
                    res["train"].append(row)
                    me = row["memengine"].get("tokens_per_s")
                    line = f"train {shape} B={B} L={L}: memengine {me or 0:.0f} tok/s"
                    for key in ("torch", "torch_tf32"):
                        if key in row and row[key].get("tokens_per_s"):
                            line += f" | {key} {row[key]['tokens_per_s']:.0f} tok/s ({(me or 0) / row[key]['tokens_per_s']:.2f}x)"
                    for key in ("torch", "torch_tf32"):
                        if "error" in row.get(key, {}):
                            line += f" | {key}: {row[key]['error'][:60]}"
                    if "error" in row["memengine"]:
                        line += f" | memengine error: {row['memengine']['error']}"
                    print(line, flush=True)
    if a.profile and "train" in suites:
        shape = a.shapes.split(",")[-1]
        L = int(a.seq.split(",")[-1])
        B = int(a.batch.split(",")[-1])
        res["profile"] = profile_step(rt, shape, B, L)
        total = sum(r[2] for r in res["profile"])
        print(f"profile of one train step, {shape} B={B} L={L}: {total:.1f} ms of kernel time")
        for k, n, ms in res["profile"][:15]:
            print(f"  {k:45s} {n:5d} calls {ms:9.2f} ms  {100 * ms / total:5.1f}%")
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
