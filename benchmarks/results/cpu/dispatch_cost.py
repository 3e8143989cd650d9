# Timing only: a tiny B 1 L 256 step with one extra (one-workgroup) dispatch after each of its
# dispatches, against the plain step, interleaved (7 rounds, medians): 12.56 -> 15.07 ms on this
# 2-core machine, about 37 us per dispatch.  python benchmarks/results/cpu/dispatch_cost.py
import os
import sys

sys.path.insert(0, "benchmarks")
import bench
from memengine.engine.runtime import Recorder, get_runtime

rt = get_runtime(None)
out = rt.zeros((4,))
orig = Recorder.dispatch
def extra(self, sh, en, *a, **k):
    r = orig(self, sh, en, *a, **k)
    if sh != "lanes":
        orig(self, "lanes", "lanes_probe", {0: out}, 1)
    return r
res = {0: [], 1: []}
for r in range(7):
    for mode in (0, 1):
        Recorder.dispatch = extra if mode else orig
        o = bench.bench_memengine_train(rt, "tiny", 1, 256, 5)
        res[mode].append(o["step_s"] * 1e3)
Recorder.dispatch = orig
med = lambda x: sorted(x)[len(x) // 2]
print("step ms plain %.2f, with one extra dispatch per dispatch %.2f" % (med(res[0]), med(res[1])), res)
