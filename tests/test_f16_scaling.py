"""--precision mixed's per-tensor f16 scales (engine/kernels/matmul.py F16Scales): operands of
any f32 magnitude through the f16 products, the rescale rule, its record in memengine.json,
and exact resume of a mixed run.

The rule, restated here from the issue (not from the code): a tensor whose casts saw amax A
is cast next as x * 2^e with e = 12 - floor(log2 A), at most 60, so that the scaled amax
lies in [2^12, 2^13) (any finite f32 amax: e >= 12 - 127); a zero or non-finite amax keeps
e; the first step (or a model without a trainer) takes each tensor's own amax.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from memengine.engine.kernels import matmul as mm
from test_mixed import ACC_FACTOR, _need_f16, f16_kernel  # noqa: F401  (f16_kernel: the fixture)

U16 = 2.0 ** -11
U32 = 2.0 ** -24


def rule(amax: float, old: int = 0) -> int:
    """The exponent the rule gives (frexp: amax = m 2^x, m in [0.5, 1), so floor(log2) = x - 1)."""
    a = abs(float(np.float32(amax)))
    if a == 0.0 or not math.isfinite(a):
        return old
    return min(60, 12 - (math.frexp(a)[1] - 1))




# ------------------------------------------------------------------ (a) one product
@pytest.mark.parametrize("M,N,K", [(132, 76, 68), (8, 128, 1536)])   # the second splits K
@pytest.mark.parametrize("ta,tb", [(False, True), (True, False)])
@pytest.mark.parametrize("delayed", [False, True])
def test_activations_of_1e6_through_a_mixed_product_within_the_f16_bound(rt, f16_kernel, M, N, K, ta, tb,
                                                                       delayed):
    """A of magnitude 1e6 (15x beyond f16's largest value) times B of 1e-3: the product, its
    bias and accumulate, within tests/test_mixed.py's bound of the exact one; unscaled, the
    cast would be inf.  `delayed`: the scales from an earlier cast of the same tensors (a
    step's from the step before), else calibrated on the cast itself."""
    rng = np.random.default_rng(M + K)
    a = (rng.standard_normal((K, M) if ta else (M, K)) * 1e6).astype(np.float32)
    b = (rng.standard_normal((N, K) if tb else (K, N)) * 1e-3).astype(np.float32)
    c0 = (rng.standard_normal((M, N)) * 1e3).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    A, B, C, Bi = rt.upload(a), rt.upload(b), rt.upload(c0), rt.upload(bias)
    A16, B16 = rt.empty(a.shape, "f16"), rt.empty(b.shape, "f16")
    scales = mm.F16Scales(rt, ["a", "b"])
    rec = rt.recorder()
    if delayed:   # an earlier "step": record the amax, rescale at its end
        scales.calibrate = False
        mm.cast_f16(rec, A16, A, scale=scales["a"])
        mm.cast_f16(rec, B16, B, scale=scales["b"])
        scales.record_rescale(rec)
    mm.cast_f16(rec, A16, A, scale=scales["a"])
    mm.cast_f16(rec, B16, B, scale=scales["b"])
    mm.matmul(rec, C, A, B, M=M, N=N, K=K, trans_a=ta, trans_b=tb, acc=True, bias=Bi, A16=A16, B16=B16)
    rec.submit()
    ea, eb = rule(np.abs(a).max()), rule(np.abs(b).max())
    np.testing.assert_array_equal(scales.state()[0], [0, ea, eb])
    # the f16 copies are the scaled operands, rounded once
    np.testing.assert_array_equal(rt.read(A16), (a.astype(np.float64) * 2.0 ** ea).astype(np.float16))
    np.testing.assert_array_equal(rt.read(B16), (b.astype(np.float64) * 2.0 ** eb).astype(np.float16))
    a64, b64 = (a.T if ta else a).astype(np.float64), (b.T if tb else b).astype(np.float64)
    ref = a64 @ b64 + bias + c0
    absprod = np.abs(a64) @ np.abs(b64)
    bound32 = ACC_FACTOR[f16_kernel] * (K + 2) * U32 * (absprod + np.abs(bias) + np.abs(c0))
    bound16 = (2 * U16 + U16 ** 2) * absprod + bound32
    got = rt.read(C)
    assert np.all(np.isfinite(got))
    assert np.all(np.abs(got - ref) <= bound16)
    # unscaled, the same cast overflows
    rec = rt.recorder()
    mm.cast_f16(rec, A16, A)
    rec.submit()
    assert np.isinf(rt.read(A16)).any()


def test_scales_beyond_one_f32_factor_are_undone_in_two(rt, f16_kernel):
    """Operands of amax 2^100 and 2^60 (scales 2^-88 and 2^-48: 2^136 to undo, beyond f32):
    the epilogue undoes the scales one after the other, so the one product that is an f32,
    2^80 * 2^40, comes out exact, and the others overflow to inf as f32 products would.  (One
    product an output: tensor cores align a sum's terms to its largest before adding, so a
    sum that cancels is not exact there.)"""
    a = np.zeros((4, 4), np.float32)
    b = np.zeros((4, 4), np.float32)
    a[0, 0], a[1, 0] = 2.0 ** 100, 2.0 ** 80
    b[0, 0], b[0, 1] = 2.0 ** 60, 2.0 ** 40
    A, B, C = rt.upload(a), rt.upload(b), rt.zeros((4, 4))
    A16, B16 = rt.empty((4, 4), "f16"), rt.empty((4, 4), "f16")
    scales = mm.F16Scales(rt, ["a", "b"])
    rec = rt.recorder()
    mm.cast_f16(rec, A16, A, scale=scales["a"])
    mm.cast_f16(rec, B16, B, scale=scales["b"])
    mm.matmul(rec, C, A, B, M=4, N=4, K=4, A16=A16, B16=B16)
    rec.submit()
    np.testing.assert_array_equal(scales.state()[0], [0, 12 - 100, 12 - 60])
    with np.errstate(over="ignore"):
        want = (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)
    assert want[1, 1] == 2.0 ** 120 and np.isinf(want[0, 0])
    np.testing.assert_array_equal(rt.read(C), want)


def test_unit_scales_are_bit_identical_to_the_unscaled_path(rt, f16_kernel):
    """Scales of 2^0 (a table whose slots are all 1, the state before any rescale) give the
    bytes of casts and products without scales, split-K included."""
    rng = np.random.default_rng(3)
    for M, N, K in ((132, 76, 68), (8, 128, 1536)):
        a = rng.standard_normal((M, K)).astype(np.float32)
        b = rng.standard_normal((N, K)).astype(np.float32)
        A, B = rt.upload(a), rt.upload(b)
        out = []
        for scaled in (False, True):
            scales = mm.F16Scales(rt, ["a", "b"])
            scales.calibrate = False
            A16, B16, C = rt.empty(a.shape, "f16"), rt.empty(b.shape, "f16"), rt.zeros((M, N))
            rec = rt.recorder()
            mm.cast_f16(rec, A16, A, scale=scales["a"] if scaled else None)
            mm.cast_f16(rec, B16, B, scale=scales["b"] if scaled else None)
            mm.matmul(rec, C, A, B, M=M, N=N, K=K, trans_b=True, A16=A16, B16=B16)
            rec.submit()
            out.append((rt.read(A16).tobytes(), rt.read(C).tobytes()))
        assert out[0] == out[1]


# ------------------------------------------------------------------ (c) the rule
@pytest.mark.parametrize("n,peak", [(100_003, 72_000), (100_003, 100_002), (9, 8)])
@pytest.mark.parametrize("per", [1, 3, 8])
def test_a_cast_over_many_workgroups_rounds_each_element_once_and_records_the_amax(rt, monkeypatch, n, peak, per):
    """cast_f16 over n elements (several workgroups of `per` vec4 an invocation, which the
    wrapper picks by size: each of them forced here; n no multiple of 4), from an offset that
    is no multiple of 4 in its buffer: every element is numpy's f16 of x * 2^e, the f16 tail
    past n is zeros, and the slot records the bits of the largest |x|, wherever it lies."""
    if not rt.has_f16:
        pytest.skip(f"{rt.adapter_name} has no shader-f16")
    monkeypatch.setattr(mm, "_cast_per", lambda n4: per)
    rng = np.random.default_rng(n + peak)
    x = rng.uniform(-3.0, 3.0, n + 5).astype(np.float32)
    x[5 + peak] = np.float32(-1234.5)
    src = rt.upload(x)
    dst = rt.upload(np.full(n + 7, 7.0, np.float16))
    scales = mm.F16Scales(rt, ["t"])
    scales.calibrate = False
    rt.write(scales.region(0), np.array([0, 3], np.int32))   # the slot's exponent: 3 (x 8)
    rec = rt.recorder()
    from memengine.engine.runtime.tensor import Tensor
    mm.cast_f16(rec, dst, Tensor(src.buffer, (n,), "f32", src.offset + 4 * 5), n, scale=scales["t"])
    rec.submit()
    got = rt.read(dst)
    np.testing.assert_array_equal(got[:n], (x[5:].astype(np.float64) * 8.0).astype(np.float16))
    np.testing.assert_array_equal(got[n:-(-n // 4) * 4], 0)
    st = scales.state()
    assert st[1][1] == np.array(1234.5, np.float32).view(np.int32)


def test_rescale_follows_the_rule_for_known_amaxes_and_keeps_its_history(rt):
    _need_f16(rt)
    amaxes = [1e6, 3.0, 65504.0 * 4, 1e-3, 0.0, 2.0 ** -20, 4096.0, 8191.0, 1e30, 1e-40]
    names = [f"t{k}" for k in range(len(amaxes))] + ["nan"]
    scales = mm.F16Scales(rt, names)
    scales.calibrate = False
    rng = np.random.default_rng(0)
    srcs = []
    for a in amaxes:
        x = (rng.uniform(-1, 1, 37) * a).astype(np.float32)
        x[5] = -np.float32(a)   # |x| reaches a exactly (negative: the amax is of |x|)
        srcs.append(rt.upload(x))
    bad = rt.upload(np.array([1.0, np.nan, 2.0, np.inf], np.float32))
    dst = rt.empty((40,), "f16")
    expect = np.zeros(len(names) + 1, np.int64)
    changes = np.zeros_like(expect)
    lo, hi = np.zeros_like(expect), np.zeros_like(expect)
    for rnd, factor in enumerate((1.0, 1.0, 16.0)):   # a second round equal, a third 16x larger
        rec = rt.recorder()
        for k, (a, src) in enumerate(zip(amaxes, srcs)):
            if factor != 1.0:
                x = rt.read(src) * np.float32(factor)
                rt.write(src, x)
            mm.cast_f16(rec, dst.view((37,)), src, scale=scales[f"t{k}"])
        mm.cast_f16(rec, dst.view((4,)), bad, scale=scales["nan"])
        scales.record_rescale(rec)
        rec.submit()
        for k, a in enumerate(amaxes):
            e = rule(np.float32(a) * np.float32(factor) if factor != 1.0 else a, int(expect[k + 1]))
            if e != expect[k + 1]:
                changes[k + 1] += 1
            expect[k + 1] = e
            lo[k + 1], hi[k + 1] = min(lo[k + 1], e), max(hi[k + 1], e)
        st = scales.state()
        np.testing.assert_array_equal(st[0], expect)       # exponents
        np.testing.assert_array_equal(st[1], 0)            # amax cleared by the rescale
        np.testing.assert_array_equal(st[2], changes)
        np.testing.assert_array_equal(st[3], lo)
        np.testing.assert_array_equal(st[4], hi)
    # spot checks of the rule itself
    assert rule(1e6) == 12 - 19 and rule(4096.0) == 0 and rule(8191.0) == 0 and rule(1e30) == 12 - 99
    assert rule(1e-40) == 60 and rule(0.0, 5) == 5 and rule(float("inf"), 5) == 5
    s = scales.summary()
    used = expect[1:][[k for k in range(len(names)) if names[k] != "nan" and amaxes[k] != 0.0]]
    assert s == {"min": 2.0 ** int(used.min()), "max": 2.0 ** int(used.max()),
                 "changes": int(changes.sum()), "tensors": len(used)}
    # the host copy of the rule agrees
    for a in amaxes + [65504.0, 2.0 ** 12, 2.0 ** 13 - 1]:
        assert mm.f16_exponent(a) == rule(a), a


# ------------------------------------------------------------------ (b) training
from memengine.engine.app.options import TrainOptions  # noqa: E402
from memengine.engine.models.lm import LanguageModel  # noqa: E402
from memengine.engine.models.mamba1.init import init_weights  # noqa: E402
from memengine.engine.train.loop import fit  # noqa: E402
from test_mixed import CURVE_CFG as CFG, _demo_windows  # noqa: E402


def test_training_with_activations_beyond_f16_stays_finite_and_near_fp32(rt):
    """Layer 0's skip weight D of 3e5 makes its scan output (y, out_proj's operand) reach
    about 1e5, beyond f16's 65504 (as the H200 bench's 67,500): unscaled, its f16 copy is inf
    and the loss non-finite at step 1.  Scaled, mixed trains finite, no step skipped, each
    logged loss within 2% of fp32's from the same weights and batches (tests/test_mixed.py's
    curve bound)."""
    _need_f16(rt)
    w = init_weights(CFG, 0)
    w["backbone.layers.0.mixer.D"] = np.full_like(w["backbone.layers.0.mixer.D"], 3e5)
    ws = _demo_windows(16)[:40]
    o = dict(max_steps=20, lr=1e-3, batch_size=2, seq_len=16, log_every=2)
    curves, hist = {}, None
    for precision in ("fp32", "mixed"):
        model = LanguageModel(rt, CFG, w)
        model.set_precision(precision)
        loop = fit(model, ws, TrainOptions(**o, precision=precision))
        steps = [e for e in loop.state.history if e["event"] == "step"]
        curves[precision] = np.array([e["loss"] for e in steps])
        if precision == "mixed":
            hist = steps
            y0 = model.half.scales.index["layers.0.y16"]
            st = model.half.scales.state()
    a, b = curves["fp32"], curves["mixed"]
    print(f"\nfp32  {np.round(a, 4)}\nmixed {np.round(b, 4)}")
    assert np.all(np.isfinite(b)) and len(a) == len(b) == 10
    assert np.all(np.abs(b - a) <= 0.02 * a)
    assert all(e["skipped_steps"] == 0 for e in hist)
    # the amax of layer 0's y is beyond f16's range, and its scale is what the rule gives it
    amax = float(np.array(st[5, y0], np.int32).view(np.float32))
    assert amax > 65504.0 and st[0, y0] == rule(amax) < 0
    assert hist[-1]["f16_scales"]["min"] <= 2.0 ** rule(amax)


# ------------------------------------------------------------------ memengine.json, resume
from conftest import SAMPLE_TEXT  # noqa: E402
from test_cli import run  # noqa: E402


def _tensors_equal(a, b) -> None:
    from safetensors.numpy import load_file
    ta, tb = load_file(str(a)), load_file(str(b))
    assert set(ta) == set(tb)
    for k in ta:
        assert ta[k].tobytes() == tb[k].tobytes(), k


def test_memengine_json_records_the_scales_and_a_resumed_mixed_run_is_bit_identical(rt, tiny_ckpt_ro, tmp_path):
    """A mixed run straight for 4 steps and one stopped after 2 and resumed: the same bytes
    (weights, moments, loss scale and f16 scales); each step event of memengine.json carries
    the f16 scales' summary, which is what the rule gives the amaxes the saved table holds."""
    _need_f16(rt)
    from safetensors.numpy import load_file
    text = tmp_path / "text.txt"
    text.write_text(SAMPLE_TEXT * 2)
    common = ["--data", text, "--seq-len", "32", "--batch-size", "2", "--lr", "3e-3", "--precision", "mixed",
              "--log-every", "1"]
    straight = tmp_path / "straight"
    r = run("train", tiny_ckpt_ro, "-o", straight, "--max-steps", "4", *common)
    assert r.exit_code == 0, r.stderr
    out = tmp_path / "out"
    r = run("train", tiny_ckpt_ro, "-o", out, "--max-steps", "2", *common)
    assert r.exit_code == 0, r.stderr
    r = run("train", "--resume", out, "--max-steps", "4")
    assert r.exit_code == 0, r.stderr
    _tensors_equal(straight / "model.safetensors", out / "model.safetensors")
    _tensors_equal(straight / "optimizer.safetensors", out / "optimizer.safetensors")
    rec = json.loads((straight / "memengine.json").read_text())
    steps = [e for e in rec["history"] if e["event"] == "step"]
    assert len(steps) == 4 and all("f16_scales" in e for e in steps)
    resumed = [e for e in json.loads((out / "memengine.json").read_text())["history"] if e["event"] == "step"]
    assert [e["f16_scales"] for e in resumed] == [e["f16_scales"] for e in steps]
    table = load_file(str(straight / "optimizer.safetensors"))["__f16_scales__"]
    last = table[5].view(np.float32)
    used = [k for k in range(1, table.shape[1]) if table[5, k] != 0]
    assert used and all(table[0, k] == rule(last[k]) for k in used)
    want = [rule(last[k]) for k in used]
    s = steps[-1]["f16_scales"]
    assert s["min"] == 2.0 ** min(want) and s["max"] == 2.0 ** max(want) and s["tensors"] == len(used)
    assert s["changes"] == int(table[2].sum()) >= len([e for e in want if e != 0])
