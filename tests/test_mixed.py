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

from memengine.engine.ops import matmul as mm

U16 = 2.0 ** -11   # f16 unit roundoff
U32 = 2.0 ** -24


def _need_f16(rt):
    if not rt.has_f16:
        pytest.skip("adapter without shader-f16")


@pytest.mark.parametrize("M,N,K", [(132, 76, 68), (8, 128, 1536), (4, 4, 4)])
@pytest.mark.parametrize("ta,tb", list(itertools.product([False, True], [False, True])))
def test_matmul_f16_within_the_rounding_bound(rt, M, N, K, ta, tb):
    _need_f16(rt)
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
    assert ("matmul_f16", "matmul_f16", ()) in rt._pipelines
    np.testing.assert_array_equal(rt.read(A16), a.astype(np.float16))   # round to nearest
    a64, b64 = (a.T if ta else a).astype(np.float64), (b.T if tb else b).astype(np.float64)
    ref = a64 @ b64 + bias + c0
    # exact product of the f16-rounded operands: what remains is f32 accumulation only
    ref16 = a64.astype(np.float16).astype(np.float64) @ b64.astype(np.float16).astype(np.float64) + bias + c0
    absprod = np.abs(a64) @ np.abs(b64)
    got = rt.read(C)
    bound32 = (K + 2) * U32 * (absprod + np.abs(bias) + np.abs(c0))
    bound16 = (2 * U16 + U16 ** 2) * absprod + bound32
    assert np.all(np.abs(got - ref16) <= bound32)
    assert np.all(np.abs(got - ref) <= bound16)
    # and f16 rounding is really there (the path is not secretly f32)
    assert np.abs(got - ref).max() > 1e-4


# ------------------------------------------------------------------ the model vs the oracle
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from memengine.engine.config import MambaConfig  # noqa: E402
from memengine.engine.model import MambaModel  # noqa: E402

from test_oracle import hf_model, rel, tensors_of  # noqa: E402

# shapes the f16 path takes everywhere (E, Di, R + 2N, V multiples of 4)
MIXED_CASES = [
    ("tied-2layers", dict(vocab_size=256, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2,
                          conv_kernel=4, use_bias=False, use_conv_bias=True, tie_word_embeddings=True,
                          time_step_rank=4), 2, 24, False),
    ("falcon-untied-bias", dict(vocab_size=128, hidden_size=24, state_size=8, num_hidden_layers=1, expand=2,
                                conv_kernel=4, use_bias=True, use_conv_bias=True, tie_word_embeddings=False,
                                time_step_rank=8), 2, 40, True),
]


@pytest.mark.parametrize("name,kw,B,L,falcon", MIXED_CASES, ids=[c[0] for c in MIXED_CASES])
def test_mixed_logits_loss_grads_within_bound_of_transformers(rt, monkeypatch, name, kw, B, L, falcon):
    _need_f16(rt)
    m = hf_model(kw, falcon=falcon)
    cfg = MambaConfig.from_dict(m.config.to_dict())
    ours = MambaModel(rt, cfg, tensors_of(m))
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

    from memengine.engine.gpu import Recorder
    seen = []
    orig = Recorder.dispatch
    monkeypatch.setattr(Recorder, "dispatch", lambda self, sh, en, *a, **k: (seen.append(en), orig(self, sh, en, *a, **k)))
    ours.loss_and_grads(ids, targets)
    # every product of the step is f16 (f32 products only for the bias gradients' column sums)
    n_products = 3 * (4 * cfg.num_hidden_layers + 1)
    assert seen.count("matmul_f16") == n_products, seen
    assert seen.count("matmul_fast") + seen.count("matmul_forward") == 2 * cfg.num_hidden_layers * kw["use_bias"]
    monkeypatch.undo()
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
