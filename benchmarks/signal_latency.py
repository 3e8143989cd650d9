"""How long a Ctrl-C / SIGTERM takes to end a training run on a large model (the time from
the signal to the process's exit), and that it leaves nothing behind.

    python benchmarks/signal_latency.py [--hidden 768 --layers 24 --vocab 256]
        [--seq-len 64,256] [--after 20,45] [--signal SIGINT,SIGTERM] [--twice]
        [--extra "--lora-rank 768"]

The model is initialised once in --workdir (default: a temporary directory).  Each case
starts `memengine train`, waits until the training loop has started plus --after seconds,
sends the signal (with --twice a second one 0.3 s later) and measures until exit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEXT = "The quick brown fox jumps over the lazy dog. " * 200


def cli(*args) -> list[str]:
    return [sys.executable, "-m", "memengine.cli", *[str(a) for a in args]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq-len", default="64,256")
    ap.add_argument("--after", default="20", help="seconds after the loop started (comma list)")
    ap.add_argument("--signal", default="SIGINT,SIGTERM")
    ap.add_argument("--twice", action="store_true")
    ap.add_argument("--extra", default="", help="more train options, e.g. '--lora-rank 768'")
    ap.add_argument("--workdir", type=Path, default=None)
    a = ap.parse_args()
    env = dict(os.environ)
    env.pop("MEMENGINE_DEBUG", None)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="memengine-latency-"))
    work.mkdir(parents=True, exist_ok=True)
    model = work / f"model-{a.hidden}x{a.layers}"
    if not model.exists():
        cfg = work / "config.json"
        cfg.write_text(json.dumps({"vocab_size": a.vocab, "hidden_size": a.hidden, "num_hidden_layers": a.layers,
                                   "state_size": 16, "expand": 2, "intermediate_size": 2 * a.hidden,
                                   "conv_kernel": 4, "time_step_rank": "auto", "tie_word_embeddings": True}))
        subprocess.run(cli("init", cfg, "-o", model), check=True, env=env)
    text = work / "text.txt"
    text.write_text(TEXT)
    rows = []
    for seq in a.seq_len.split(","):
        for after in a.after.split(","):
            for name in a.signal.split(","):
                sig = getattr(signal, name)
                out = work / "out"
                shutil.rmtree(out, ignore_errors=True)
                p = subprocess.Popen(cli("train", model, "--data", text, "-o", out, "--seq-len", seq, "--epochs",
                                         "100", *a.extra.split()), stderr=subprocess.PIPE, text=True, env=env)
                while True:
                    line = p.stderr.readline()
                    if not line or line.startswith(("train ", "training ", "adapting ")):  # the plan line: steps start
                        break
                time.sleep(float(after))
                t0 = time.monotonic()
                p.send_signal(sig)
                if a.twice:
                    time.sleep(0.3)
                    if p.poll() is None:
                        p.send_signal(sig)
                err = p.stderr.read()
                p.wait()
                took = time.monotonic() - t0
                last = [ln for ln in err.splitlines() if ln.startswith("error:")]
                left = [q.name for q in work.iterdir() if q.name.startswith(".")]
                rows.append((seq, after, name + (" x2" if a.twice else "") + (f" {a.extra}" if a.extra else ""), took,
                             p.returncode, out.exists(), left, last[-1] if last else ""))
                print(f"seq {seq:>5}  after {after:>4}s  {rows[-1][2]:10s}  exit after {took:6.2f}s  status "
                      f"{p.returncode}  OUT exists {out.exists()}  leftovers {left}  {rows[-1][-1]}", flush=True)
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
