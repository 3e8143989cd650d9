# Per-step loss / pre-clip grad norm / loss scale of the bench's training setting (random init,
# one random batch repeated), fp32 and --precision mixed; with DIG=1, at the first non-finite
# loss: per layer, the largest finite |value| of each saved activation and (!n) how many are
# not finite.  python3 mixed_overflow.py mamba-130m 8 2048 7 mixed,fp32
import os
import sys

import numpy as np

sys.path.insert(0, os.environ.get("BENCHDIR", "benchmarks"))
import bench
from memengine.engine.app.options import TrainOptions
from memengine.engine.models.mamba1.config import MambaConfig
from memengine.engine.models.mamba1.init import init_weights
from memengine.engine.models.lm import LanguageModel
from memengine.engine.runtime import get_runtime
from memengine.engine.train.trainer import Trainer

rt = get_runtime(None)
shape, B, L, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
tag = os.environ.get("TAG", "")
for prec in sys.argv[5].split(","):
    cfg = MambaConfig(**bench.SHAPES[shape])
    model = LanguageModel(rt, cfg, init_weights(cfg, 0)); model.set_precision(prec)
    batch = bench._batch(cfg, B, L)
    o = TrainOptions(batch_size=B, seq_len=L, precision=prec)
    tr = Trainer(model, o, trace_capacity=1)
    out = []
    for s in range(steps):
        tr.step([batch], o.lr)
        losses, norms = tr.read_trace()
        sc = tr.scaler.read() if tr.scaler else {}
        out.append(f"{losses[0]:.5f}/{norms[0]:.3g}/{sc.get('loss_scale', '')}")
        if (not np.isfinite(losses[0])) and os.environ.get("DIG"):
            ws = model.workspace(B, L)
            for i in range(cfg.num_hidden_layers):
                row = []
                for n in ("un", "xz", "xc", "xdbl", "delta", "y", "states") + (("un16", "xc16", "xdbl16", "y16") if prec == "mixed" else ()):
                    a = rt.read(getattr(ws, n)[i]).astype(np.float32)
                    fin = np.isfinite(a)
                    row.append(f"{n}:{np.abs(a[fin]).max() if fin.any() else -1:.3g}" + (f"!{(~fin).sum()}" if not fin.all() else ""))
                print(tag, prec, "step", s, "layer", i, " ".join(row), flush=True)
            for n in ("hf",) + (("hf16",) if prec == "mixed" else ()):
                a = rt.read(getattr(ws, n)).astype(np.float32); fin = np.isfinite(a)
                print(tag, n, np.abs(a[fin]).max(), (~fin).sum())
            P = [rt.read(seg) for seg in model.P.segments] if hasattr(model.P, "segments") else []
            print(tag, "params finite", all(np.isfinite(p).all() for p in P))
            break
    print(tag, prec, " ".join(out), flush=True)
