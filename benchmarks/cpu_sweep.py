"""The CPU kernels' shape sweep (issue 33 item 5): a Mamba-1 model of 2 layers, vocabulary
256, hidden size E and state size N (time_step_rank "auto" = ceil(E/16)), one B 1 training
step at --seq, for every E and N asked; tokens/s, the step's FLOPs and the time per FLOP,
and its ratio to the nearest tuned shape's (E a multiple of 64, the same N: the shapes the
8-lane kernels were tuned on).  At the sweep's corners (the smallest and largest E and N)
transformers + mambapy + AdamW runs too, interleaved with ours (--rounds).

    python benchmarks/cpu_sweep.py --E 32:256:8 --N 4,8,12,16 --out benchmarks/results/cpu/sweep.json

FLOPs of a step: 2 M n k for every matrix product (forward, input and weight gradients,
the LM head's included) and 20 M Di N for the scan (forward 6, backward 14 per state and
step), M = B L.  A step is the median of --rounds rounds of --steps steps after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import bench  # noqa: E402


def _range(s: str) -> list:
    if ":" in s:
        a, b, c = (int(x) for x in s.split(":"))
        return list(range(a, b + 1, c))
    return [int(x) for x in s.split(",")]


def step_flops(E: int, N: int, L: int, layers: int = 2, V: int = 256, B: int = 1) -> float:
    Di, R = 2 * E, math.ceil(E / 16)
    M = B * L
    lin = [(2 * Di, E), (R + 2 * N, Di), (Di, R), (E, Di)]   # in_proj, x_proj, dt_proj, out_proj
    per = sum(3 * 2 * M * o * i for o, i in lin)
    return layers * (per + 20 * M * Di * N) + 3 * 2 * M * V * E


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--E", default="32:256:8")
    ap.add_argument("--N", default="4,8,12,16")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-torch", action="store_true", help="no peer at the corners")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    Es, Ns, L = _range(a.E), _range(a.N), a.seq
    from memengine.engine.runtime import get_runtime

    rt = get_runtime("auto")
    torch = None if a.no_torch else bench._torch()[0]
    corners = {(e, n) for e in (min(Es), max(Es)) for n in (min(Ns), max(Ns))}
    rows = []
    for N in Ns:
        for E in Es:
            name = f"e{E}n{N}"
            bench.SHAPES[name] = dict(vocab_size=256, hidden_size=E, state_size=N, num_hidden_layers=2)
            ours, peer, peer_error = [], [], ""
            for _ in range(max(1, a.rounds)):
                ours.append(bench.bench_memengine_train(rt, name, 1, L, a.steps)["tokens_per_s"])
                if torch is not None and (E, N) in corners and not peer_error:
                    best = 0.0
                    for t in (1, 2):
                        torch.set_num_threads(t)
                        pp = bench.bench_torch_train(torch, name, 1, L, a.steps, "cpu", mambapy=True)
                        best = max(best, pp.get("tokens_per_s", 0.0))
                        peer_error = pp.get("error", "") if not best else ""
                    if peer_error:   # no ratio without the peer (mambapy missing, say): its error instead
                        peer = []
                    else:
                        peer.append(best)
            tps = bench._median(ours)
            fl = step_flops(E, N, L)
            row = dict(E=E, N=N, L=L, tokens_per_s=tps, rounds=ours, flops=fl, ms_per_gflop=1e12 * L / tps / fl)
            if peer:
                row["mambapy"] = dict(tokens_per_s=bench._median(peer), rounds=peer,
                                      ratio=bench._median([o / p for o, p in zip(ours, peer)]))
            elif peer_error:
                row["mambapy"] = dict(error=peer_error)
            rows.append(row)
            msg = f"E {E:3d} N {N:2d}: {tps:8.0f} tokens/s  {row['ms_per_gflop']:7.2f} ms/GFLOP"
            if peer:
                msg += f"  mambapy {row['mambapy']['tokens_per_s']:8.0f} ({row['mambapy']['ratio']:.2f}x)"
            elif peer_error:
                msg += f"  mambapy: {peer_error}"
            print(msg, flush=True)
    tuned = {(r["E"], r["N"]): r["ms_per_gflop"] for r in rows if r["E"] % 64 == 0}
    worst = 0.0
    for r in rows:
        near = [e for e, n in tuned if n == r["N"]]
        if not near:
            continue
        e = min(near, key=lambda x: (abs(x - r["E"]), x))
        r["nearest_tuned_E"] = e
        r["vs_tuned"] = r["ms_per_gflop"] / tuned[(e, r["N"])]
        worst = max(worst, r["vs_tuned"])
    print("time per FLOP / the nearest tuned shape's (E % 64 == 0, same N):")
    for N in Ns:
        print(f"  N {N:2d}: " + " ".join(f"{r['E']}:{r['vs_tuned']:.2f}" for r in rows if r["N"] == N and "vs_tuned" in r))
    print(f"worst {worst:.2f}x")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(adapter=rt.describe(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           argv=sys.argv[1:], rows=rows, worst_vs_tuned=worst), f, indent=1)
        print("wrote", a.out)


if __name__ == "__main__":
    main()
