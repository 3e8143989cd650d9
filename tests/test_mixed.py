"""--precision mixed: the f16 matmul path, loss scaling and AdamW, against numpy / torch /
transformers' fp32 oracle.

Error model used for every bound here: rounding an operand to f16 changes it by at most
u = 2^-11 relative, so one product a*b of rounded operands is off by at most
(2u + u^2)|a||b|, and a dot product of length K accumulated in f32 (our kernel) by at most
2u * sum_k |a_k||b_k| + K * 2^-24 * sum_k |a_k||b_k| (the f32 part is the fp32 kernel's own).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from memengine.engine.kernels import matmul as mm
from sgmat_emulation import emulated

U16 = 2.0 ** -11   # f16 unit roundoff
U32 = 2.0 ** -24


def _need_f16(rt):
    if not rt.has_f16:
        pytest.skip("adapter without shader-f16")


@pytest.fixture(params=["simt", "sgmat", "sgmat-emulated"])
def f16_kernel(rt, request):
    """The kernel --precision mixed's products take: matmul_f16 (f32 arithmetic on f16
    operands, every adapter with shader-f16) or matmul_sgmat (subgroup matrices, where the
    adapter has f16 ones: Dawn on NVIDIA); the other one switched off for the test.
    sgmat-emulated: matmul_sgmat where the adapter has no subgroup matrices, its matrix
    operations emulated (tests/sgmat_emulation.py: the kernel's indexing, staging and
    epilogues, not the hardware's products)."""
    _need_f16(rt)
    if request.param == "sgmat" and not rt.has_subgroup_matrix:
        pytest.skip(f"{rt.describe()} has no f16 subgroup matrices")
    if request.param == "sgmat-emulated":
        if rt.has_subgroup_matrix:
            pytest.skip(f"{rt.describe()} runs matmul_sgmat itself (the sgmat cases)")
        with emulated(rt):
            yield "matmul_sgmat"
        return
    saved = rt.kernels.sgmat
    rt.kernels.sgmat = request.param == "sgmat"
    yield "matmul_sgmat" if request.param == "sgmat" else "matmul_f16"
    rt.kernels.sgmat = saved


# tensor cores add the f16 x f16 products (exact in f32) in f32 with truncation rather than
# rounding: up to 2^-23 relative an addition, twice the f32 kernels' bound
ACC_FACTOR = {"matmul_f16": 1.0, "matmul_sgmat": 2.0}   # (the emulation rounds: within either)


@pytest.mark.parametrize("M,N,K", [(132, 76, 68), (8, 128, 1536), (4, 4, 4), (200, 260, 100)])
@pytest.mark.parametrize("ta,tb", list(itertools.product([False, True], [False, True])))
def test_matmul_f16_within_the_rounding_bound(rt, f16_kernel, M, N, K, ta, tb):
    rng = np.random.default_rng(M + N + K)
    a = rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32)
    b = rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32)
    c0 = rng.standard_normal((M, N)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    A, B, C, Bi = rt.upload(a), rt.upload(b), rt.upload(c0), rt.upload(bias)
    A16, B16 = rt.empty(a.shape, "f16"), rt.empty(b.shape, "f16")
    rec = rt.recorder()
    mm.cast_f16(rec, A16, A)
    mm.cast_f16(rec, B16, B)
    mm.matmul(rec, C, A, B, M=M, N=N, K=K, trans_a=ta, trans_b=tb, acc=True, bias=Bi, A16=A16, B16=B16)
    rec.submit()
    kernel = f16_kernel if M * N * 4 >= mm.SGMAT_MIN_C_BYTES else "matmul_f16"   # a C under one 16 x 16 result
    consts = () if kernel == "matmul_f16" else (("TA", int(ta)), ("TB", int(tb)))
    assert (kernel, kernel, consts) in rt._pipelines
    np.testing.assert_array_equal(rt.read(A16), a.astype(np.float16))   # round to nearest
    a64, b64 = (a.T if ta else a).astype(np.float64), (b.T if tb else b).astype(np.float64)
    ref = a64 @ b64 + bias + c0
    # exact product of the f16-rounded operands: what remains is f32 accumulation only
    ref16 = a64.astype(np.float16).astype(np.float64) @ b64.astype(np.float16).astype(np.float64) + bias + c0
    absprod = np.abs(a64) @ np.abs(b64)
    got = rt.read(C)
    bound32 = ACC_FACTOR[f16_kernel] * (K + 2) * U32 * (absprod + np.abs(bias) + np.abs(c0))
    bound16 = (2 * U16 + U16 ** 2) * absprod + bound32
    assert np.all(np.abs(got - ref16) <= bound32)
    assert np.all(np.abs(got - ref) <= bound16)
    # and f16 rounding is really there (the path is not secretly f32)
    assert np.abs(got - ref).max() > 1e-4


# whole tiles without bias or accumulation: matmul_sgmat stores them straight from its
# subgroup matrices (the rounding-bound test above takes its guarded path), also under split-K
# (K 4096 at 256 x 256: 4 tiles split over K) and with the operands' f16 scales undone
# `acc`: into C (matmul_sgmat starts such tiles' results from C scaled by 2^(ea + eb) where
# -32 <= ea + eb <= 64, else it adds C in its guarded epilogue: (40, 30) and (-20, -15)); K of
# 1, 2, 3 and 5 K tiles of 32
@pytest.mark.parametrize("M,N,K,ea,eb", [(256, 384, 96, 0, 0), (256, 256, 4096, 0, 0), (128, 256, 160, 9, -7),
                                         (256, 128, 64, 20, 25), (128, 256, 80, 3, 5), (128, 128, 80, 40, 30),
                                         (128, 256, 48, -20, -15), (128, 128, 32, 0, 0)])
@pytest.mark.parametrize("ta,tb", [(False, True), (False, False), (True, False)])
@pytest.mark.parametrize("acc", [False, True])
def test_matmul_f16_whole_tiles_within_the_rounding_bound(rt, f16_kernel, M, N, K, ea, eb, ta, tb, acc):
    rng = np.random.default_rng(M + N + K + ea)
    # magnitudes 2^-e, so that the scaled operands are near 1
    a = (rng.standard_normal((K, M) if ta else (M, K)) * 2.0 ** -ea).astype(np.float32)
    b = (rng.standard_normal((N, K) if tb else (K, N)) * 2.0 ** -eb).astype(np.float32)
    # C before: the product's magnitude (sqrt(K) 2^-(ea + eb)), or NaN where it is overwritten
    c0 = (rng.standard_normal((M, N)) * np.sqrt(K) * 2.0 ** -(ea + eb)).astype(np.float32)
    A, B, C = rt.upload(a), rt.upload(b), rt.upload(c0 if acc else np.full((M, N), np.nan, np.float32))
    A16, B16 = rt.empty(a.shape, "f16"), rt.empty(b.shape, "f16")
    table = mm.F16Scales(rt, ["a", "b"])
    state = table.state()
    state[0, 1:3] = (ea, eb)   # the exponents: operands cast as x * 2^e, the product unscaled by 2^-(ea + eb)
    table.load(state)
    rec = rt.recorder()
    mm.cast_f16(rec, A16, A, scale=table["a"])
    mm.cast_f16(rec, B16, B, scale=table["b"])
    mm.matmul(rec, C, A, B, M=M, N=N, K=K, trans_a=ta, trans_b=tb, acc=acc, A16=A16, B16=B16)
    rec.submit()
    a64, b64 = (a.T if ta else a).astype(np.float64), (b.T if tb else b).astype(np.float64)
    # the f16-rounded scaled operands, unscaled exactly: what remains is f32 accumulation only
    a16 = (a64 * 2.0 ** ea).astype(np.float16).astype(np.float64) * 2.0 ** -ea
    b16 = (b64 * 2.0 ** eb).astype(np.float16).astype(np.float64) * 2.0 ** -eb
    c64 = c0.astype(np.float64) if acc else 0.0
    got = rt.read(C)
    bound32 = ACC_FACTOR[f16_kernel] * (K + 2) * U32 * (np.abs(a64) @ np.abs(b64) + np.abs(c64))
    assert np.all(np.abs(got - (a16 @ b16 + c64)) <= bound32)


# ------------------------------------------------------------------ the model vs the oracle
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from memengine.engine.models.mamba1.config import MambaConfig  # noqa: E402
from memengine.engine.models.lm import LanguageModel  # noqa: E402
from test_oracle import LIMITS, hf_model, limits_for, rel, tensors_of  # noqa: E402

# shapes the f16 path takes everywhere (E, Di, R + 2N, V multiples of 4)
MIXED_CASES = [
    ("tied-2layers", dict(vocab_size=256, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2,
                          conv_kernel=4, use_bias=False, use_conv_bias=True, tie_word_embeddings=True,
                          time_step_rank=4), 2, 24, False),
    ("falcon-untied-bias", dict(vocab_size=128, hidden_size=24, state_size=8, num_hidden_layers=1, expand=2,
                                conv_kernel=4, use_bias=True, use_conv_bias=True, tie_word_embeddings=False,
                                time_step_rank=8), 2, 40, True),
]


@pytest.mark.parametrize("limits", LIMITS)
@pytest.mark.parametrize("name,kw,B,L,falcon", MIXED_CASES, ids=[c[0] for c in MIXED_CASES])
def test_mixed_logits_loss_grads_within_bound_of_transformers(rt, monkeypatch, name, kw, B, L, falcon, limits):
    """`forced`: binding and buffer limits forced down so that every product and cast runs
    in pieces (f16 operands split like the f32 ones), each dispatch checked against them."""
    _need_f16(rt)
    m = hf_model(kw, falcon=falcon)
    cfg = MambaConfig.from_dict(m.config.to_dict())
    with limits_for(rt, limits, cfg, B, L, monkeypatch):
        _mixed_vs_oracle(rt, monkeypatch, m, cfg, name, kw, B, L, count=limits == "adapter")


def _mixed_vs_oracle(rt, monkeypatch, m, cfg, name, kw, B, L, count):
    ours = LanguageModel(rt, cfg, tensors_of(m))
    ours.set_precision("mixed")
    S = 1024.0
    ours.loss_scale = rt.upload(np.array([S], np.float32))
    rng = np.random.default_rng(2)
    V = kw["vocab_size"]
    ids = rng.integers(0, V, size=(B, L)).astype(np.int32)
    targets = rng.integers(0, V, size=(B, L)).astype(np.int32)
    targets[0, -1] = -1
    t_ids = torch.tensor(ids, dtype=torch.long)
    logits_ref = m(input_ids=t_ids).logits
    loss_ref = torch.nn.functional.cross_entropy(
        logits_ref.reshape(-1, V), torch.tensor(targets, dtype=torch.long).reshape(-1), ignore_index=-1)
    loss_ref.backward()
    grads_ref = {n: p.grad.numpy() for n, p in m.named_parameters()}

    from memengine.engine.runtime import Recorder
    seen = []
    orig = Recorder.dispatch
    if count:
        monkeypatch.setattr(Recorder, "dispatch",
                            lambda self, sh, en, *a, **k: (seen.append(en), orig(self, sh, en, *a, **k)))
        ours.loss_and_grads(ids, targets)
        # every product of the step is f16 (f32 products only for the bias gradients' column sums)
        n_products = 3 * (4 * cfg.num_hidden_layers + 1)
        assert sum(seen.count(e) for e in mm.F16_ENTRIES) == n_products, seen
        assert seen.count("matmul_fast") + seen.count("matmul_lanes") + seen.count("matmul_forward") == 2 * cfg.num_hidden_layers * kw["use_bias"]
        monkeypatch.setattr(Recorder, "dispatch", orig)
    logits = ours.logits(ids)
    loss = ours.loss_and_grads(ids, targets)
    grads = {n: g / S for n, g in ours.grad_dict().items()}

    # The bound: an f16 product perturbs its output by at most 2u * sum|a||b| (module doc),
    # i.e. 2u * kappa relative, kappa = sum|a||b| / |sum ab|.  Measured max-abs relative
    # (as `rel` does), kappa of these well-scaled operands stays <= 1 (the large outputs
    # that set the max are the ones without cancellation).  Each error passes through the
    # later products and elementwise steps (norms, silu, the scan: not amplifying here) and
    # the errors of successive products add up: a quantity depending on `depth` f16
    # products is within depth * 2u of the oracle.  depth: 4 products per layer + the head
    # forward; a gradient also goes back through as many.
    nl = cfg.num_hidden_layers
    depth_fwd = 4 * nl + 1
    bound_fwd = depth_fwd * 2 * U16
    bound_grad = 2 * depth_fwd * 2 * U16
    e_logits = rel(logits, logits_ref.detach().numpy())
    e_loss = abs(loss - loss_ref.item()) / abs(loss_ref.item())
    print(f"\n[{name}] mixed: logits rel err {e_logits:.2e}, loss rel err {e_loss:.2e} "
          f"(bound {bound_fwd:.2e}); gradient bound {bound_grad:.2e}")
    assert e_logits < bound_fwd and e_loss < bound_fwd
    worst = 0.0
    assert set(grads_ref) == set(grads)
    for n, g_ref in grads_ref.items():
        e = rel(grads[n], g_ref)
        worst = max(worst, e)
        print(f"  d{n:45s} max rel err {e:.2e}")
        assert e < bound_grad, n
    # f16 rounding is really in the path: well above what the fp32 path gives (< 1e-5 here)
    assert e_logits > 1e-5
    print(f"[{name}] largest gradient rel err {worst:.2e}")


# ------------------------------------------------------------------ loss scaling and AdamW
from memengine.engine.train.optim import AdamW, GradClipper, LossScaler  # noqa: E402


def _scaled_step(rt, scaler, clipper, opt, params, grads, max_norm):
    rec = rt.recorder()
    clipper.record(rec, list(grads.values()), max_norm, scaler)
    opt.record_step(rec, params, grads, clipper.factor, scaler.amp)
    rec.submit()


@pytest.mark.parametrize("max_norm", [0.0, 1.0])
def test_adamw_with_loss_scaling_equals_torch_on_unscaled_grads(rt, max_norm):
    rng = np.random.default_rng(5)
    shapes = {"a": (3000,), "b": (70, 7)}
    p0 = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    g_steps = [{k: (rng.standard_normal(s) * 0.3).astype(np.float32) for k, s in shapes.items()} for _ in range(3)]
    S = 2.0 ** 16
    scaler, clipper, opt = LossScaler(rt, S), GradClipper(rt), AdamW(rt, lr=1e-2, weight_decay=0.1)
    params = {k: rt.upload(v) for k, v in p0.items()}
    grads = {k: rt.empty(s) for k, s in shapes.items()}
    tp = {k: torch.nn.Parameter(torch.tensor(v, dtype=torch.float64)) for k, v in p0.items()}
    topt = torch.optim.AdamW(list(tp.values()), lr=1e-2, weight_decay=0.1)
    for gs in g_steps:
        for k in shapes:
            rt.write(grads[k], gs[k] * np.float32(S))  # what the scaled loss gradient gives
            tp[k].grad = torch.tensor(gs[k], dtype=torch.float64)
        _scaled_step(rt, scaler, clipper, opt, params, grads, max_norm)
        if max_norm:
            torch.nn.utils.clip_grad_norm_(list(tp.values()), max_norm)
        topt.step()
    for k in shapes:
        np.testing.assert_allclose(rt.read(params[k]), tp[k].detach().numpy(), rtol=1e-5, atol=2e-6)
    assert scaler.read() == {"loss_scale": S, "skipped_steps": 0}
    assert abs(float(rt.read(clipper.norm)[0]) - float(np.sqrt(sum((g.astype(np.float64) ** 2).sum()
                                                                    for g in g_steps[-1].values())))) < 1e-4


def test_overflow_skips_the_step_and_halves_the_scale_then_growth_doubles_it(rt):
    rng = np.random.default_rng(6)
    p0 = rng.standard_normal(1000).astype(np.float32)
    scaler, clipper, opt = LossScaler(rt, 1024.0, growth_interval=2), GradClipper(rt), AdamW(rt, lr=1e-2)
    params, grads = {"w": rt.upload(p0)}, {"w": rt.empty((1000,))}
    g = (rng.standard_normal(1000) * 1024).astype(np.float32)
    g_bad = g.copy()
    g_bad[17] = np.inf
    rt.write(grads["w"], g_bad)
    _scaled_step(rt, scaler, clipper, opt, params, grads, 1.0)
    np.testing.assert_array_equal(rt.read(params["w"]), p0)           # skipped: nothing moved
    np.testing.assert_array_equal(opt.state_dict()["w.exp_avg"], 0.0)  # nor the moments
    assert scaler.read() == {"loss_scale": 512.0, "skipped_steps": 1}
    assert rt.read(scaler.amp)[0] == 1.0
    rt.write(grads["w"], g)
    _scaled_step(rt, scaler, clipper, opt, params, grads, 1.0)
    assert rt.read(scaler.amp)[0] == 0.0
    assert scaler.read() == {"loss_scale": 512.0, "skipped_steps": 1}
    # as torch.amp.GradScaler: the skipped step never reached the optimizer, so this one is
    # torch AdamW's first step (t = 1) on the unscaled, clipped gradient
    tp = torch.nn.Parameter(torch.tensor(p0, dtype=torch.float64))
    tp.grad = torch.tensor(g / 512.0, dtype=torch.float64)
    torch.nn.utils.clip_grad_norm_([tp], 1.0)
    torch.optim.AdamW([tp], lr=1e-2).step()
    np.testing.assert_allclose(rt.read(params["w"]), tp.detach().numpy(), rtol=1e-5, atol=2e-6)
    _scaled_step(rt, scaler, clipper, opt, params, grads, 1.0)     # 2 good steps in a row: x2
    assert scaler.read() == {"loss_scale": 1024.0, "skipped_steps": 1}


def test_cast_to_f16_overflows_to_inf(rt):
    _need_f16(rt)
    x = np.array([1.0, -70000.0, 65504.0, 1e30, -1e-8, 0.5, np.nan, 3.0], np.float32)
    src, dst = rt.upload(x), rt.empty((8,), "f16")
    rec = rt.recorder()
    mm.cast_f16(rec, dst, src)
    rec.submit()
    got = rt.read(dst)
    np.testing.assert_array_equal(got[[0, 2, 4, 5, 7]], x[[0, 2, 4, 5, 7]].astype(np.float16))
    assert got[1] == -np.inf and got[3] == np.inf and np.isinf(got[6])
    # a range that is not a multiple of 4, read from a view: the last vec4 is padded with 0
    rt.write(dst, np.full(8, 7.0, np.float16))
    rec = rt.recorder()
    mm.cast_f16(rec, dst, src.view((5,), 2), 5)
    rec.submit()
    got = rt.read(dst)
    np.testing.assert_array_equal(got[[0, 2, 3]], x[[2, 4, 5]].astype(np.float16))
    assert got[1] == np.inf and np.isinf(got[4]) and np.all(got[5:] == 0)


# ------------------------------------------------------------------ training
from memengine.engine.app.options import TrainOptions  # noqa: E402
from memengine.engine.io.data import make_windows  # noqa: E402
from memengine.engine.models.mamba1.init import init_weights  # noqa: E402
from memengine.engine.train.loop import fit  # noqa: E402
from memengine.engine.train.trainer import Trainer  # noqa: E402

CURVE_CFG = MambaConfig(vocab_size=256, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
                        conv_kernel=4, time_step_rank=4)


def _demo_windows(seq_len):
    from importlib import resources
    text = resources.files("memengine.engine").joinpath("data/demo.txt").read_bytes()
    return make_windows(np.frombuffer(text, np.uint8).astype(np.int32), seq_len)


def test_forced_overflow_in_training_skips_steps_and_reports_them(rt):
    _need_f16(rt)
    model = LanguageModel(rt, CURVE_CFG, init_weights(CURVE_CFG, 0))
    model.set_precision("mixed")
    before = model.state_dict()
    o = TrainOptions(max_steps=3, lr=1e-3, batch_size=2, seq_len=16, log_every=3)
    trainer = Trainer(model, o, trace_capacity=3)
    # the gradients overflow at once: the output gradients' f16 casts take any f32 magnitude
    # (per-tensor scales), so a scale whose gradients' squared norm overflows f32
    rt.write(trainer.scaler.scale, [2.0 ** 120])
    ws = _demo_windows(16)[:6]
    from memengine.engine.io.data import make_batches
    for b in make_batches(ws, 2, 16):
        trainer.step([b], 1e-3)
    losses, norms = trainer.read_trace()
    assert list(trainer.last_skipped) == [True] * 3 and np.all(np.isfinite(losses))
    assert trainer.scaler.read() == {"loss_scale": 2.0 ** 117, "skipped_steps": 3}
    after = model.state_dict()
    for n in before:
        np.testing.assert_array_equal(after[n], before[n])
    # and through the loop: step events carry the count
    loop = fit(model, _demo_windows(16)[:8], TrainOptions(max_steps=2, lr=1e-3, batch_size=2, seq_len=16,
                                                           log_every=1, precision="mixed"))
    steps = [e for e in loop.state.history if e["event"] == "step"]
    assert all("skipped_steps" in e for e in steps)


def test_forward_beyond_f16_range_trains_as_fp32_does(rt):
    """An activation beyond f16's range (65504) in the forward (layer 0's norm weight of 1e5:
    its normalised input reaches 3e5, its scan output 1e23) once gave a non-finite loss at
    any loss scale; with per-tensor f16 scales (tests/test_f16_scaling.py) the mixed run
    trains these weights with finite losses, within 2% of fp32's."""
    _need_f16(rt)
    w = init_weights(CURVE_CFG, 0)
    w["backbone.layers.0.norm.weight"] = np.full_like(w["backbone.layers.0.norm.weight"], 1e5)
    ws = _demo_windows(16)[:4]
    o = dict(max_steps=2, lr=1e-3, batch_size=2, seq_len=16, log_every=2)
    fp32 = fit(LanguageModel(rt, CURVE_CFG, w), ws, TrainOptions(**o))
    a = np.array([e["loss"] for e in fp32.state.history if e["event"] == "step"])
    assert np.all(np.isfinite(a))
    model = LanguageModel(rt, CURVE_CFG, w)
    model.set_precision("mixed")
    mixed = fit(model, ws, TrainOptions(**o, precision="mixed"))
    b = np.array([e["loss"] for e in mixed.state.history if e["event"] == "step"])
    assert np.all(np.isfinite(b)) and np.all(np.abs(b - a) <= 0.02 * a)


def test_200_step_loss_curve_within_1_percent_of_fp32(rt):
    """The demo text, a tiny model, short windows: fp32 and mixed from the same weights
    and batches; the last logged losses (means over 10 steps) agree within 1%.  (About
    25 s on lavapipe with 2 cores, so it stays in the default run.)"""
    _need_f16(rt)
    ws = _demo_windows(16)
    curves = {}
    for precision in ("fp32", "mixed"):
        model = LanguageModel(rt, CURVE_CFG, init_weights(CURVE_CFG, 0))
        model.set_precision(precision)
        o = TrainOptions(max_steps=200, lr=3e-3, batch_size=2, seq_len=16, log_every=10, precision=precision)
        loop = fit(model, ws, o)
        curves[precision] = [e["loss"] for e in loop.state.history if e["event"] == "step"]
        if precision == "mixed":
            skipped = sum(e["skipped_steps"] for e in loop.state.history if e["event"] == "step")
    a, b = np.array(curves["fp32"]), np.array(curves["mixed"])
    print(f"\nfp32  {np.round(a, 4)}\nmixed {np.round(b, 4)}\nskipped steps {skipped}")
    assert len(a) == len(b) == 20
    assert a[-1] < 0.8 * a[0]                       # it learned something
    assert abs(b[-1] - a[-1]) <= 0.01 * a[-1]
    assert np.all(np.abs(b - a) <= 0.02 * a)        # and the whole curve stays close


# ------------------------------------------------------------------ the command line
from test_cli import assert_one_line_error, run  # noqa: E402


def test_cli_mixed_train_records_skips_and_refuses_without_f16(rt, monkeypatch, tiny_ckpt_ro, sample_text, tmp_path):
    _need_f16(rt)
    out = tmp_path / "o"
    r = run("train", tiny_ckpt_ro, "--data", sample_text, "-o", out, "--max-steps", "2", "--seq-len", "64",
            "--precision", "mixed", "--log-every", "1", "--json")
    assert r.exit_code == 0, r.stderr
    import json
    rec = json.loads((out / "memengine.json").read_text())
    assert rec["options"]["precision"] == "mixed"
    steps = [e for e in rec["history"] if e["event"] == "step"]
    assert steps and all(e["skipped_steps"] == 0 for e in steps)
    assert rec["result"]["skipped_steps"] == 0 and rec["result"]["loss_scale"] == 2.0 ** 16
    monkeypatch.setattr(rt, "has_f16", False)   # an adapter without shader-f16
    r = run("train", tiny_ckpt_ro, "--data", sample_text, "-o", tmp_path / "o2", "--max-steps", "1",
            "--seq-len", "64", "--precision", "mixed")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "shader-f16")
    assert not (tmp_path / "o2").exists()


def test_loss_scaler_state_is_kept_in_the_optimizer_state(rt, tmp_path):
    _need_f16(rt)
    from memengine.engine.io.data import make_batches
    from memengine.engine.train import optim_state
    model = LanguageModel(rt, CURVE_CFG, init_weights(CURVE_CFG, 0))
    model.set_precision("mixed")
    o = TrainOptions(max_steps=2, lr=1e-3, batch_size=2, seq_len=16, log_every=2, precision="mixed")
    trainer = Trainer(model, o, trace_capacity=2)
    rt.write(trainer.scaler.scale, [2.0 ** 120])   # overflows the gradients (see above)
    for b in make_batches(_demo_windows(16)[:4], 2, 16):
        trainer.step([b], 1e-3)
    trainer.read_trace()
    state = trainer.optimizer_state()
    np.testing.assert_array_equal(state[optim_state.LOSS_SCALE_KEY], [2.0 ** 118, 0, 2])
    optim_state.save(tmp_path, state)
    loaded = optim_state.load(tmp_path / optim_state.OPTIMIZER_FILE, model)
    again = Trainer(model, o, loaded)
    assert again.scaler.read() == {"loss_scale": 2.0 ** 118, "skipped_steps": 2}
    # and the f16 scales (their amax cleared: a step recomputes it), no calibration after
    table = state[optim_state.F16_SCALES_KEY]
    assert table.dtype == np.int32 and (table[0] != 0).any()
    np.testing.assert_array_equal(again.f16.state()[[0, 2, 3, 4, 5]], table[[0, 2, 3, 4, 5]])
    assert not again.f16.calibrate
    model.set_precision("fp32")
    assert Trainer(model, o, loaded).scaler is None   # an fp32 run ignores it
    bad = dict(state)
    bad[optim_state.LOSS_SCALE_KEY] = np.array([-1.0, 0, 0], np.float32)
    with pytest.raises(Exception, match="positive finite loss scale"):
        optim_state.check(bad, model, "x")
    bad = dict(state)
    bad[optim_state.F16_SCALES_KEY] = table.copy()
    bad[optim_state.F16_SCALES_KEY][0, 1] = 99
    with pytest.raises(Exception, match="exponents outside"):
        optim_state.check(bad, model, "x")


def test_a_run_on_tensor_cores_says_mixed_is_faster_or_where_its_products_run(rt, monkeypatch, tiny_ckpt_ro,
                                                                             sample_text, tmp_path):
    """One line at the start of a run on an adapter with f16 subgroup matrices: fp32 names the
    measured speed-up of mixed, mixed says its products take the tensor cores; none elsewhere."""
    from memengine.engine.app.run import MIXED_SPEEDUP

    args = ("--data", sample_text, "--max-steps", "1", "--seq-len", "32")
    r = run("train", tiny_ckpt_ro, "-o", tmp_path / "a", *args)
    assert r.exit_code == 0, r.stderr
    assert "subgroup matrices" not in r.stderr or rt.has_subgroup_matrix
    monkeypatch.setattr(rt, "has_subgroup_matrix", True)   # fp32 runs no f16 product: safe anywhere
    r = run("train", tiny_ckpt_ro, "-o", tmp_path / "b", *args)
    assert r.exit_code == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "subgroup matrices" in ln]
    assert len(lines) == 1 and f"{MIXED_SPEEDUP['dawn']:.2f}x" in lines[0] and "--precision mixed" in lines[0], r.stderr
    # --backend auto passed over Dawn's matrices for an fp32 run: the factor against wgpu-native
    monkeypatch.setattr(rt, "has_subgroup_matrix", False)
    monkeypatch.setattr(rt, "dawn_tensor_cores", True)
    r = run("train", tiny_ckpt_ro, "-o", tmp_path / "c", *args)
    assert r.exit_code == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "subgroup matrices" in ln]
    assert len(lines) == 1 and f"{MIXED_SPEEDUP['wgpu']:.2f}x" in lines[0] and "wgpu-native" in lines[0], r.stderr
