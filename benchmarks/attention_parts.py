"""Where the subgroup-matrix attention's time goes (shaders/attention_sgmat.wgsl): its forward
and backward timed alone (the f16 copies cast once, before), at the hybrids' real head shapes
and L 4096, B 1, then again with one part of the kernel taken out of its text each time:

    no_exp       the probabilities' exp (p = its argument)
    no_scores    the score products (q.k, dO.v: zero matrices instead)
    no_accum     the products into the accumulators (p.v, ds.k, ds^T.q, p^T.dO)
    no_barrier   the workgroup barriers (those of workgroupUniformLoad stay)

Results without a part are wrong; only their times mean something: what is left when the part
is gone.  Run on the device machine under Dawn (`source benchmarks/device_setup.sh;
MEMENGINE_BACKEND=dawn python3 benchmarks/attention_parts.py`); one JSON line per shape and
variant (and to $OUT/attention_parts.jsonl).  Needs an adapter with f16 subgroup matrices."""

from __future__ import annotations

import json
import os
import re
import sys
import time

import numpy as np

from memengine.engine.kernels import attention
from memengine.engine.kernels.matmul import F16Scales, cast_f16
from memengine.engine.runtime import get_runtime

SHAPES = [("granite-4.0-h-350m", 12, 4, 64, 0.015625), ("bamba-9b", 32, 8, 128, 128 ** -0.5)]
B, L, REPS = 1, int(os.environ.get("ATTENTION_L", "4096")), 5

ZERO = "\nfn zero_result() -> subgroup_matrix_result<f32, 16, 16> {\n" \
       "    var r: subgroup_matrix_result<f32, 16, 16>;\n    return r;\n}\n"


def variant(src: str, name: str) -> str:
    if name == "base":
        return src
    if name == "no_exp":
        return re.sub(r"\bp = exp\(", "p = (", src)
    if name == "no_scores":
        src = re.sub(r"\bdots_staged\(&\w+, \w+, \w+\)", "zero_result()", src)
        return re.sub(r"\bdots\(&\w+, \w+, [^;]*?, u\.ld[qk]\)", "zero_result()", src) + ZERO
    if name == "no_accum":
        return re.sub(r"^(\s*)accum(_staged)?\(&.*;$", r"\1// (accum)", src, flags=re.M)
    if name == "no_barrier":
        return re.sub(r"\bworkgroupBarrier\(\);", "", src)
    raise ValueError(name)


def use(rt, name: str) -> None:
    """The runtime compiling attention_sgmat as `name` from now on (its caches dropped)."""
    if not hasattr(rt, "_parts_source"):   # the source before any variant (an emulation's, in tests)
        rt._parts_source = rt.module_source
    base = rt._parts_source

    def source(shader, subgroups=None):
        code = base(shader, subgroups)
        return variant(code, name) if shader == attention.SG_SHADER else code

    rt.module_source = source
    rt._modules.pop(attention.SG_SHADER, None)
    for k in [k for k in rt._pipelines if k[0] == attention.SG_SHADER]:
        del rt._pipelines[k]


def timed(rt, f) -> float:
    f()
    rt.sync()
    ts = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        f()
        rt.sync()
        ts.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(ts))


def main(variants):
    rt = get_runtime()
    if not attention.takes_subgroup_matrices(rt, 64):
        sys.exit("error: the adapter has no f16 subgroup matrices (run under Dawn on a GPU that has them)")
    lines = []
    for shape, Hq, Hkv, D, s in SHAPES:
        M, P = B * L, attention.SG_PAD_ROWS
        rng = np.random.default_rng(0)
        t = {n: rt.upload(rng.standard_normal((M, c)).astype(np.float32))
             for n, c in (("q", Hq * D), ("k", Hkv * D), ("v", Hkv * D), ("do", Hq * D))}
        sc = F16Scales(rt, ["q", "k", "v", "do"])
        c16 = {}
        rec = rt.recorder()
        for n, c in (("q", Hq * D), ("k", Hkv * D), ("v", Hkv * D), ("do", Hq * D)):
            c16[n] = cast_f16(rec, rt.zeros((M + P, c), "f16"), t[n], scale=sc[n])
        rec.submit()
        o, lse, delta = rt.empty((M, Hq * D)), rt.empty((M, Hq)), rt.empty((M, Hq))
        dq, dk, dv = rt.empty((M, Hq * D)), rt.empty((M, Hkv * D)), rt.empty((M, Hkv * D))
        kw = dict(B=B, L=L, Hq=Hq, Hkv=Hkv, D=D, scale=s)

        def fwd():
            rec = rt.recorder()
            attention.attention_forward_f16(rec, o, lse, c16["q"], c16["k"], c16["v"], **kw)
            rec.submit()

        def bwd():
            rec = rt.recorder()
            attention.attention_backward_f16(rec, dq, dk, dv, delta, t["do"], o, lse, c16["q"], c16["k"], c16["v"],
                                             c16["do"], **kw)
            rec.submit()

        for name in variants:
            use(rt, name)
            row = {"shape": shape, "variant": name, "L": L, "Hq": Hq, "Hkv": Hkv, "D": D}
            try:
                row["forward_ms"] = timed(rt, fwd)
                row["backward_ms"] = timed(rt, bwd)
            except Exception as e:   # a variant that does not compile: say so, go on
                row["error"] = str(e)[:300]
            print(json.dumps(row), flush=True)
            lines.append(row)
        use(rt, "base")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "attention_parts.jsonl"), "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in lines))


if __name__ == "__main__":
    main(sys.argv[1:] or ["base", "no_exp", "no_scores", "no_accum", "no_barrier"])
