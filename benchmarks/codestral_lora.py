# One LoRA step (r 8 on in_proj, fp32) of a built-in shape at B 1, timed, with its peak memory as the
# runtime counts it (beside `memengine info`'s plan), the weights random (bench.py's init):
#   python3 benchmarks/codestral_lora.py OUT.json [SHAPE L]     (default mamba-codestral-7b, 2048)
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402
from memengine.engine.runtime import get_runtime  # noqa: E402

t0 = time.time()
rt = get_runtime(None)
print("adapter:", rt.describe(), flush=True)
shape, L = (sys.argv[2], int(sys.argv[3])) if len(sys.argv) > 2 else ("mamba-codestral-7b", 2048)
r = bench.bench_memengine_train(rt, shape, 1, L, steps=2, warmup=2, lora_rank=8)
r["wall_s"] = time.time() - t0
print(json.dumps(r), flush=True)
json.dump(dict(adapter=rt.describe(), lora=r), open(sys.argv[1], "w"), indent=1)
