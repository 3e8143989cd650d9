"""The Mamba-2 + attention hybrids (engine/models/hybrid) against transformers'
GraniteMoeHybridForCausalLM (dense: num_local_experts 0) and BambaForCausalLM (their PyTorch
paths, eager attention) in float64: logits, loss, every gradient by name and AdamW steps
against torch.optim.AdamW, on odd shapes: attention at irregular layer indices, GQA ratios of
1, 3 and 2, partial RoPE (Bamba), full RoPE and no positional encoding (Granite), Granite's
four multipliers away from 1, tied and untied heads, biases on and off."""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from memengine.engine import models  # noqa: E402
from memengine.engine.app.options import TrainOptions  # noqa: E402
from memengine.engine.errors import MemengineError  # noqa: E402
from memengine.engine.models.hybrid.config import HybridConfig  # noqa: E402
from memengine.engine.models.lm import LanguageModel  # noqa: E402
from memengine.engine.train.loop import fit  # noqa: E402

GRANITE_BASE = dict(model_type="granitemoehybrid", num_local_experts=0, hidden_act="silu", mamba_d_conv=3,
                    mamba_chunk_size=4, attention_dropout=0.0, initializer_range=0.1)
BAMBA_BASE = dict(model_type="bamba", hidden_act="silu", mamba_d_conv=4, mamba_chunk_size=5, initializer_range=0.1)

# (name, config kwargs, batch, seq_len); Di = mamba_expand * hidden_size = mamba_n_heads * mamba_d_head
CASES = [
    ("granite-rope-gqa3-tied-multipliers", dict(
        GRANITE_BASE, vocab_size=67, hidden_size=24, num_hidden_layers=5, num_attention_heads=6, num_key_value_heads=2,
        layer_types=["attention", "mamba", "mamba", "attention", "mamba"], position_embedding_type="rope",
        rope_parameters={"rope_type": "default", "rope_theta": 300.0}, shared_intermediate_size=20,
        embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.3, logits_scaling=2.5,
        mamba_n_heads=4, mamba_d_head=12, mamba_n_groups=2, mamba_d_state=5, mamba_expand=2,
        tie_word_embeddings=True), 2, 11),
    ("granite-nope-mha-untied-bias", dict(
        GRANITE_BASE, vocab_size=53, hidden_size=16, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
        layer_types=["mamba", "attention", "mamba"], position_embedding_type=None, shared_intermediate_size=12,
        embedding_multiplier=0.5, residual_multiplier=1.3, attention_multiplier=0.2, logits_scaling=0.7,
        attention_bias=True, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=6, mamba_expand=2,
        mamba_proj_bias=True, tie_word_embeddings=False), 1, 13),
    ("bamba-partial-rope-gqa3-untied", dict(
        BAMBA_BASE, vocab_size=71, hidden_size=24, num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1,
        attn_layer_indices=[2], intermediate_size=28, mlp_bias=True, rope_parameters={"rope_type": "default",
                                                                                      "rope_theta": 500.0},
        mamba_n_heads=6, mamba_d_head=8, mamba_n_groups=3, mamba_d_state=4, mamba_expand=2,
        tie_word_embeddings=False), 2, 9),
    ("bamba-gqa2-tied-two-attention", dict(
        BAMBA_BASE, vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        attn_layer_indices=[0, 3], intermediate_size=24, attention_bias=True, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0},
        mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=7, mamba_expand=1,
        mamba_conv_bias=False, tie_word_embeddings=True), 1, 17),
]


@contextlib.contextmanager
def float64_oracle():
    """transformers' hybrids cast to float32 on the way (the chunked scan's inputs, A_log, the
    RMS norms, the attention softmax): within this context a float64 tensor stays float64 there,
    so the oracle is float64 throughout (else it rounds A_log's and dt_bias's gradients to
    about 1e-3 and hides errors of that size)."""
    f, to, sm = torch.Tensor.float, torch.Tensor.to, torch.nn.functional.softmax

    def keep_float(self, *a, **k):
        return self if self.dtype == torch.float64 else f(self, *a, **k)

    def keep_to(self, *a, **k):
        if self.dtype == torch.float64 and ((a and a[0] is torch.float32) or k.get("dtype") is torch.float32):
            a = tuple(torch.float64 if x is torch.float32 else x for x in a)
            k = {n: (torch.float64 if v is torch.float32 else v) for n, v in k.items()}
        return to(self, *a, **k)

    def keep_softmax(x, *a, dtype=None, **k):
        return sm(x, *a, dtype=torch.float64 if x.dtype == torch.float64 else dtype, **k)

    torch.Tensor.float, torch.Tensor.to, torch.nn.functional.softmax = keep_float, keep_to, keep_softmax
    try:
        yield
    finally:
        torch.Tensor.float, torch.Tensor.to, torch.nn.functional.softmax = f, to, sm


def hf_class(kw):
    return (transformers.GraniteMoeHybridForCausalLM if kw["model_type"] == "granitemoehybrid"
            else transformers.BambaForCausalLM)


def hf_config(kw):
    kw = dict(kw)
    cls = transformers.GraniteMoeHybridConfig if kw.pop("model_type") == "granitemoehybrid" else transformers.BambaConfig
    return cls(**kw)


def hf_model(kw, seed=0):
    torch.manual_seed(seed)
    cfg = hf_config(kw)
    cfg._attn_implementation = "eager"
    m = hf_class(kw)(cfg).double().eval()
    with torch.no_grad():   # less symmetric than the default init (D = 1, A_log = log h, norms 1, biases 0)
        for name, p in m.named_parameters():
            if name.endswith(".D") or "norm" in name or name.endswith("A_log"):
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("dt_bias"):   # dt in [0.05, 0.5] (the hybrids' init
                # puts dt_bias at 1: states that forget within a step, A_log's gradient a tiny difference)
                dt = torch.exp(torch.rand_like(p) * (np.log(0.5) - np.log(0.05)) + np.log(0.05))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            if name.endswith("bias"):
                p.add_(0.05 * torch.randn_like(p))
            if ".self_attn." in name:
                p.mul_(2.0)   # attention far from uniform
    return m


def tensors_of(m) -> dict:
    sd = {k: v.detach().to(torch.float32).numpy().copy() for k, v in m.state_dict().items()}
    if m.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def our_config(m, kw):
    return models.config_from_dict(dict(m.config.to_dict(), model_type=kw["model_type"]), "cfg")


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def batch(V, B, L, seed=1):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V, size=(B, L)).astype(np.int32)
    targets = rng.integers(0, V, size=(B, L)).astype(np.int32)
    if B * L > 2:
        targets[0, -1] = -1
    return ids, targets


@pytest.mark.parametrize("name,kw,B,L", CASES, ids=[c[0] for c in CASES])
def test_the_tensor_table_is_transformers(name, kw, B, L):
    m = hf_model(kw)
    cfg = our_config(m, kw)
    arch = models.of(cfg)
    ours = list(arch.iter_shapes(cfg))
    theirs = [(k, tuple(v.shape)) for k, v in m.state_dict().items()
              if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    assert ours == theirs
    assert arch.n_params(cfg) == sum(p.numel() for p in m.parameters())
    # what we write back, transformers reads as the same model
    back = hf_config(dict(cfg.to_hf_dict()))
    assert back.layers_block_type == m.config.layers_block_type
    assert back.num_key_value_heads == m.config.num_key_value_heads


def _oracle(kw, B, L):
    """transformers' model of `kw` in float64, a batch, and its logits, loss and gradients."""
    m = hf_model(kw)
    V = kw["vocab_size"]
    ids, targets = batch(V, B, L)
    with float64_oracle():
        logits_ref = m(input_ids=torch.tensor(ids, dtype=torch.long)).logits
        loss_ref = torch.nn.functional.cross_entropy(logits_ref.reshape(-1, V), torch.tensor(targets, dtype=torch.long)
                                                     .reshape(-1), ignore_index=-1)
        loss_ref.backward()
    grads_ref = {n: p.grad.numpy() for n, p in m.named_parameters()}
    return m, our_config(m, kw), ids, targets, logits_ref, loss_ref, grads_ref


@pytest.mark.parametrize("name,kw,B,L", CASES, ids=[c[0] for c in CASES])
def test_logits_loss_grads_match_transformers(rt, name, kw, B, L):
    m, cfg, ids, targets, logits_ref, loss_ref, grads_ref = _oracle(kw, B, L)
    ours = LanguageModel(rt, cfg, tensors_of(m))
    logits = ours.logits(ids)
    loss = ours.loss_and_grads(ids, targets)
    grads = ours.grad_dict()
    e_logits = rel(logits, logits_ref.detach().numpy())
    e_loss = abs(loss - loss_ref.item()) / abs(loss_ref.item())
    print(f"\n[{name}] logits max rel err {e_logits:.2e}; loss {loss:.6f} vs {loss_ref.item():.6f} (rel {e_loss:.2e})")
    assert e_logits < 1e-4 and e_loss < 1e-4
    assert set(grads_ref) == set(grads), sorted(set(grads_ref) ^ set(grads))
    worst = 0.0
    largest = max(np.abs(g).max() for g in grads_ref.values())
    for n, g_ref in grads_ref.items():
        if n.endswith("k_proj.bias"):   # 0 in exact arithmetic (a constant added to a row's scores): both round
            e = float(np.abs(grads[n] - g_ref).max() / largest)
        else:
            e = rel(grads[n], g_ref)
        worst = max(worst, e)
        print(f"  d{n:50s} max rel err {e:.2e}")
        assert e < 1e-3, n
    print(f"[{name}] largest gradient rel err {worst:.2e}")


# shapes whose every product suits the f16 kernels (features, rows and columns multiples of 4)
MIXED_CASES = [
    ("mixed-granite-rope-gqa3-multipliers", dict(
        GRANITE_BASE, vocab_size=64, hidden_size=48, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
        layer_types=["mamba", "attention", "mamba"], position_embedding_type="rope",
        rope_parameters={"rope_type": "default", "rope_theta": 300.0}, shared_intermediate_size=24,
        embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.3, logits_scaling=2.5,
        mamba_n_heads=4, mamba_d_head=24, mamba_n_groups=2, mamba_d_state=8, mamba_expand=2,
        tie_word_embeddings=True), 2, 10),
    ("mixed-bamba-partial-rope-untied-bias", dict(
        BAMBA_BASE, vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        attn_layer_indices=[0], intermediate_size=24, mlp_bias=True, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8, mamba_expand=1,
        tie_word_embeddings=False), 1, 12),
]


@pytest.mark.parametrize("name,kw,B,L", MIXED_CASES, ids=[c[0] for c in MIXED_CASES])
def test_mixed_precision_within_bound_of_transformers(rt, name, kw, B, L):
    """--precision mixed (f16 operands of every product: in_proj, out_proj, q/k/v/o, the MLP,
    the head; f32 accumulation): logits, loss and every gradient within depth x 2u of
    transformers' float64 (depth: the f16 products on a path, 4 a layer and the head; twice
    that for a gradient), every product of a step f16 (the dispatches are counted), and
    above what fp32 gives (the f16 path is really taken).  As for Mamba-2, the per-head sums
    (A_log, D, dt_bias) get 4x the bound."""
    if not rt.has_f16:
        pytest.skip("the adapter lacks shader-f16")
    from memengine.engine.kernels import matmul as mm

    m, cfg, ids, targets, logits_ref, loss_ref, grads_ref = _oracle(kw, B, L)
    ours, seen = _mixed_model(rt, cfg, m, ids, targets)
    # the products of a step: per Mamba layer in_proj, out_proj; per attention layer q, k, v, o;
    # per layer the MLP's (Granite one input product, Bamba gate and up); the head; each three times
    att = len(cfg.attention_layers)
    mlp_in = 1 if kw["model_type"] == "granitemoehybrid" else 2
    per_step = 2 * (cfg.num_hidden_layers - att) + 4 * att + (mlp_in + 1) * cfg.num_hidden_layers + 1
    assert sum(seen.count(e) for e in mm.F16_ENTRIES) == 3 * per_step, seen
    _within_mixed_bound(name, ours, ids, targets, logits_ref, loss_ref, grads_ref, 4 * cfg.num_hidden_layers + 1)


MIXED_S = 1024.0   # the loss scale of the mixed tests


def _mixed_model(rt, cfg, m, ids, targets):
    """The model of transformers' `m` in --precision mixed, and the entry points one
    loss_and_grads of it dispatches."""
    from memengine.engine.runtime import Recorder

    ours = LanguageModel(rt, cfg, tensors_of(m))
    ours.set_precision("mixed")
    ours.loss_scale = rt.upload(np.array([MIXED_S], np.float32))
    seen = []
    orig = Recorder.dispatch

    def count(self, sh, en, *a, **k):
        seen.append(en)
        return orig(self, sh, en, *a, **k)

    Recorder.dispatch = count
    try:
        ours.loss_and_grads(ids, targets)
    finally:
        Recorder.dispatch = orig
    return ours, seen


def _within_mixed_bound(name, ours, ids, targets, logits_ref, loss_ref, grads_ref, depth: int) -> None:
    """Logits, loss and every gradient within depth x 2u (twice that for a gradient; 4x for
    the per-head sums A_log, D, dt_bias; k_proj.bias against the largest gradient, its own
    being near zero) of transformers' float64, and above what fp32 gives."""
    logits = ours.logits(ids)
    loss = ours.loss_and_grads(ids, targets)
    grads = {n: g / MIXED_S for n, g in ours.grad_dict().items()}
    u16 = 2.0 ** -11
    bound_fwd, bound_grad = depth * 2 * u16, 2 * depth * 2 * u16
    e_logits = rel(logits, logits_ref.detach().numpy())
    e_loss = abs(loss - loss_ref.item()) / abs(loss_ref.item())
    largest = max(np.abs(g).max() for g in grads_ref.values())
    errs = {n: float(np.abs(grads[n] - g).max() / largest) if n.endswith("k_proj.bias") else rel(grads[n], g)
            for n, g in grads_ref.items()}
    print(f"\n[{name}] mixed: logits rel err {e_logits:.2e}, loss {e_loss:.2e} (bound {bound_fwd:.2e}); "
          f"largest gradient rel err {max(errs.values()):.2e} (bound {bound_grad:.2e})")
    assert e_logits < bound_fwd and e_loss < bound_fwd
    for n, e in errs.items():
        assert e < bound_grad * (4 if n.endswith(("A_log", ".D", "dt_bias")) else 1), (n, e)
    assert e_logits > 1e-5


# head_dim 32: the attention takes its subgroup-matrix kernels under --precision mixed
SG_ATTENTION_CASE = ("mixed-granite-attention-sgmat", dict(
    GRANITE_BASE, vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    layer_types=["attention", "mamba"], position_embedding_type="rope",
    rope_parameters={"rope_type": "default", "rope_theta": 300.0}, shared_intermediate_size=32,
    residual_multiplier=0.5, attention_multiplier=0.2, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
    mamba_d_state=8, mamba_expand=1, tie_word_embeddings=True), 2, 70)


def test_mixed_attention_on_subgroup_matrices_within_bound(rt):
    """--precision mixed on an adapter with f16 subgroup matrices: the attention's forward and
    backward run shaders/attention_sgmat.wgsl (f16 copies of q, k, v and dO with their own
    scale slots; p and ds rounded to f16), the fp32 attention kernels not at all; logits, loss
    and every gradient within the mixed bound of transformers' float64, the attention layer
    counted as 4 more f16 roundings on a path.  Where the adapter has no subgroup matrices
    (lavapipe) both matmul_sgmat and attention_sgmat run emulated (tests/sgmat_emulation.py);
    L 70 is more than one block of 64 rows and no multiple of 32."""
    if not rt.has_f16:
        pytest.skip("the adapter lacks shader-f16")
    from sgmat_emulation import emulated

    name, kw, B, L = SG_ATTENTION_CASE
    m, cfg, ids, targets, logits_ref, loss_ref, grads_ref = _oracle(kw, B, L)
    ctx = contextlib.nullcontext() if rt.has_subgroup_matrix else emulated(rt, ("matmul_sgmat", "attention_sgmat"))
    with ctx:
        ours, seen = _mixed_model(rt, cfg, m, ids, targets)
        assert seen.count("attention_sg_forward") == 1 and seen.count("attention_sg_dq") == 1, seen
        assert seen.count("attention_sg_dkv") == 1 and "attention_forward" not in seen, seen
        _within_mixed_bound(name, ours, ids, targets, logits_ref, loss_ref, grads_ref,
                            4 * cfg.num_hidden_layers + 1 + 4 * len(cfg.attention_layers))


def test_the_oracle_can_fail(rt):
    """The same weights with one multiplier read wrongly, or one attention layer's kv heads
    paired with the wrong query heads, miss transformers: the comparisons above have teeth."""
    name, kw, B, L = CASES[0]
    m = hf_model(kw)
    ids, _ = batch(kw["vocab_size"], B, L)
    with float64_oracle():
        ref = m(input_ids=torch.tensor(ids, dtype=torch.long)).logits.detach().numpy()
    for change in (dict(residual_multiplier=0.41), dict(attention_multiplier=0.31), dict(embedding_multiplier=3.1)):
        cfg = models.config_from_dict(dict(m.config.to_dict(), model_type=kw["model_type"], **change), "cfg")
        assert rel(LanguageModel(rt, cfg, tensors_of(m)).logits(ids), ref) > 1e-4, change
    t = tensors_of(m)
    k = "model.layers.0.self_attn.k_proj.weight"
    t[k] = np.concatenate([t[k][4:], t[k][:4]])   # the two kv heads swapped
    assert rel(LanguageModel(rt, our_config(m, kw), t).logits(ids), ref) > 1e-4


@pytest.mark.parametrize("case", [0, 2], ids=["granite", "bamba"])
def test_adamw_steps_match_torch(rt, case):
    """Two training steps (clip + AdamW + weight decay) through the engine's loop against
    transformers + torch.optim.AdamW.  eps 1e-6 in both: AdamW's first step moves an element
    by lr * g / (|g| + eps), so a gradient near eps (some here are 1e-8, at f32's noise level
    against the largest) would move by a different fraction of lr in each."""
    name, kw, B, L = CASES[case]
    hf = hf_model(kw, seed=4)
    cfg = our_config(hf, kw)
    tensors = tensors_of(hf)
    V = kw["vocab_size"]
    ids, tg = batch(V, 2, 10, seed=3)
    tg[0, -1] = 5
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    norms = []
    for _ in range(2):
        opt.zero_grad()
        with float64_oracle():
            logits = hf(input_ids=torch.tensor(ids, dtype=torch.long)).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), torch.tensor(tg, dtype=torch.long)
                                                     .reshape(-1))
            loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(hf.parameters(), 0.5)))
        opt.step()
    model = LanguageModel(rt, cfg, tensors)
    loop = fit(model, [(ids[0], tg[0]), (ids[1], tg[1])],
               TrainOptions(epochs=2, lr=1e-2, batch_size=2, seq_len=10, max_grad_norm=0.5, eps=1e-6, shuffle=False))
    ours = model.state_dict()
    hist = [e for e in loop.state.history if e["event"] == "epoch"]
    assert norms[0] > 0.5
    np.testing.assert_allclose([h["grad_norm"] for h in hist], norms, rtol=1e-4)
    sd = dict(hf.named_parameters())
    worst = 0.0
    for n in ours:
        err = rel(ours[n], sd[n].detach().numpy())
        worst = max(worst, err)
        assert err < 1e-4, n
    print(f"\n[adamw/{name}] weights after 2 steps: largest rel err {worst:.2e}")


def test_refusals_are_one_line():
    base = dict(CASES[0][1])
    for bad, word in ((dict(num_local_experts=4, num_experts_per_tok=2), "num_local_experts"),
                      (dict(num_key_value_heads=4), "num_key_value_heads"),
                      (dict(layer_types=["mamba", "attention"]), "layer_types"),
                      (dict(layer_types=["mamba", "cross", "mamba", "mamba", "mamba"]), "layer_types"),
                      (dict(position_embedding_type="alibi"), "position_embedding_type"),
                      (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1.0}), "rope_type"),
                      (dict(mamba_d_head=5), "mamba_d_head"), (dict(mamba_n_groups=3), "mamba_n_groups"),
                      (dict(attention_dropout=0.1), "attention_dropout"), (dict(hidden_act="gelu"), "hidden_act")):
        with pytest.raises(MemengineError) as e:
            HybridConfig.from_dict({**base, **bad}, "cfg.json")
        assert word in str(e.value) and "\n" not in str(e.value) and "cfg.json" in str(e.value), str(e.value)
    with pytest.raises(MemengineError) as e:
        HybridConfig.from_dict({**dict(CASES[2][1]), "z_loss_coefficient": 0.1}, "cfg.json")
    assert "z_loss_coefficient" in str(e.value) and "\n" not in str(e.value)


def test_adapt_trains_only_the_mamba_selection(rt):
    """WSLA on a hybrid: the Mamba layers' in_proj rows of B, C and dt and dt_bias move;
    attention, MLP, norms, embeddings and the z / x rows stay bit-identical."""
    name, kw, B, L = CASES[0]
    m = hf_model(kw, seed=5)
    cfg = our_config(m, kw)
    before = tensors_of(m)
    model = LanguageModel(rt, cfg, before)
    arch = models.of(cfg)
    names = model.trainable_names(wsla=True)
    assert names == [n for n in model.names if ".mamba." in n and n.endswith(("in_proj.weight", "dt_bias"))]
    assert len(names) == 2 * (cfg.num_hidden_layers - len(cfg.attention_layers))
    ids, tg = batch(kw["vocab_size"], 2, 10, seed=3)
    from memengine.engine.app.options import AdaptOptions

    fit(model, [(ids[0], tg[0]), (ids[1], tg[1])],
        AdaptOptions(epochs=2, lr=1e-2, batch_size=2, seq_len=10, weight_decay=0.1, shuffle=False))
    after = model.state_dict()
    Di = cfg.mamba.intermediate_size
    for n, w in before.items():
        if n in names and n.endswith("in_proj.weight"):
            np.testing.assert_array_equal(after[n][:2 * Di], w[:2 * Di])
            assert not np.array_equal(after[n][2 * Di:], w[2 * Di:]), n
        elif n in names:
            assert not np.array_equal(after[n], w), n
        else:
            np.testing.assert_array_equal(after[n], w, err_msg=n)
    assert arch.wsla_scope


# ----------------------------------------------------------------------------- generate (KV cache)
@pytest.mark.parametrize("case", [0, 1, 2, 3], ids=[c[0] for c in CASES])
def test_step_logits_equal_sequence_logits(rt, monkeypatch, case):
    """A prompt of p tokens, then the rest one token at a time through the step kernels (the
    Mamba layers' recurrent state, the attention layers' KV cache, RoPE at the GPU-held
    position): the logits after every position equal transformers' sequence logits.  Decode
    segments of 4 keys, so that a step combines several."""
    from memengine.engine.app.generate import Decoder
    from memengine.engine.kernels import attention

    monkeypatch.setattr(attention, "DECODE_SEGMENT", 4)
    name, kw, B, L = CASES[case]
    m = hf_model(kw, seed=2)
    ours = LanguageModel(rt, our_config(m, kw), tensors_of(m))
    n = 23
    ids = np.random.default_rng(1).integers(0, kw["vocab_size"], n).astype(np.int32)
    with float64_oracle():
        ref = m(input_ids=torch.tensor(ids[None], dtype=torch.long)).logits[0].detach().numpy()
    dec = Decoder(ours)
    worst = 0.0
    for p in (1, 4, 9):
        got = [dec.prefill_logits(ids[:p])]
        for t in range(p, n):
            got.append(dec.push_logits(int(ids[t])))
        e = rel(np.array(got), ref[p - 1:])
        worst = max(worst, e)
        assert e < 1e-4, (p, e)
    print(f"\n[{name}] step logits vs transformers: max rel err {worst:.2e}")


def greedy_full(m, prompt, n):
    """Greedy decoding through transformers' full-sequence forward (no cache): the tokens and
    each step's logits."""
    seq, scores = [int(x) for x in prompt], []
    with torch.no_grad():
        for _ in range(n):
            logits = m(input_ids=torch.tensor([seq], dtype=torch.long)).logits[0, -1].numpy()
            scores.append(logits)
            seq.append(int(np.argmax(logits)))
    return seq[len(prompt):], np.array(scores)


@pytest.mark.parametrize("case", [0, 2], ids=["granite", "bamba"])
def test_greedy_equals_transformers_generate(rt, case):
    """Greedy generate (temperature 0) = transformers' greedy decoding.  Granite: its
    generate(do_sample=False) itself.  Bamba: transformers 5.24's cached decode of Bamba
    disagrees with its own full forward once the prompt is long (the logits of generate's
    steps 14% away from the forward's at a 19-token prompt, in a model whose layers are all
    attention too), so the oracle there is greedy decoding through the full forward, and
    generate(do_sample=False) where it agrees with that (the short prompts)."""
    from memengine.engine.app.generate import generate
    from memengine.engine.app.options import SamplingOptions

    name, kw, B, L = CASES[case]
    m = hf_model(kw, seed=4)
    ours = LanguageModel(rt, our_config(m, kw), tensors_of(m))
    rng = np.random.default_rng(7)
    seen = set()
    for p in (1, 5, 19):
        prompt = rng.integers(0, kw["vocab_size"], p).astype(np.int32)
        want, scores = greedy_full(m, prompt, 12)
        if case == 0 or p <= 5:
            out = m.generate(torch.tensor(prompt[None], dtype=torch.long), max_new_tokens=12, do_sample=False,
                             pad_token_id=0)
            assert out[0, p:].tolist() == want, (p, "transformers' generate and its forward disagree")
        got = generate(ours, prompt, SamplingOptions(max_new_tokens=12, temperature=0), decode=lambda x: "").tokens
        seen |= set(want)
        assert len(got) == 12
        j = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if j is not None:   # allowed only at a near tie of transformers' own
            gap = float(scores[j][want[j]] - scores[j][got[j]])
            assert gap <= 1e-5 * float(np.abs(scores[j]).max()), (p, j, gap)
    assert len(seen) > 3, seen   # not one token repeated: the continuations depend on the prompt


# ----------------------------------------------------------------------------- the command line
TINY_GRANITE = dict(model_type="granitemoehybrid", vocab_size=256, hidden_size=32, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, layer_types=["mamba", "attention", "mamba"],
                    position_embedding_type="rope", shared_intermediate_size=48, embedding_multiplier=2.0,
                    residual_multiplier=0.5, attention_multiplier=0.125, logits_scaling=2.0, mamba_n_heads=8,
                    mamba_d_head=8, mamba_d_state=16, mamba_n_groups=1, num_local_experts=0,
                    tie_word_embeddings=True, eos_token_id=0, bos_token_id=0, pad_token_id=0)
TINY_BAMBA = dict(model_type="bamba", vocab_size=256, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=1, attn_layer_indices=[1], intermediate_size=40, mamba_n_heads=8,
                  mamba_d_head=8, mamba_d_state=8, tie_word_embeddings=False, eos_token_id=0, pad_token_id=0)
TEXT = "the quick brown fox jumps over the lazy dog; a stitch in time saves nine. " * 4


def _cli(*args):
    from typer.testing import CliRunner
    from memengine.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def _one_error(res, needle):
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.startswith("error:")]
    assert res.exit_code == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert needle in lines[0], lines[0]


def _hf_loss(ckpt, data, L):
    """transformers' mean next-token loss (its from_pretrained of what we wrote) over the
    windows `eval` cuts from the text."""
    from memengine.engine.io.checkpoint import load_checkpoint
    from memengine.engine.io.data import make_windows, read_documents, tokenize_documents
    from memengine.engine.io.tokenizer import load_tokenizer

    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager").double().eval()
    ids = tokenize_documents(read_documents([str(data)]), load_tokenizer(load_checkpoint(ckpt).path))
    total, n = 0.0, 0
    with torch.no_grad(), float64_oracle():
        for x, y in make_windows(ids, L):
            lg = hf(input_ids=torch.tensor(x[None], dtype=torch.long)).logits[0]
            total += float(torch.nn.functional.cross_entropy(lg, torch.tensor(y, dtype=torch.long), reduction="sum"))
            n += len(y)
    return total / n, n


@pytest.mark.parametrize("tiny", [TINY_GRANITE, TINY_BAMBA], ids=["granite", "bamba"])
def test_cli_init_train_adapt_quantize_eval_equal_transformers(tmp_path, tiny):
    """init from a config file, train (long-run options: max steps, cosine schedule, validation,
    periodic checkpoints), eval (= transformers' from_pretrained of what train wrote), adapt
    (attention and MLP bit-identical), quantize (transformers loads the f16 file), generate."""
    import json

    from memengine.engine.io.checkpoint import load_checkpoint

    (tmp_path / "c.json").write_text(json.dumps(tiny))
    data = tmp_path / "d.txt"
    data.write_text(TEXT)
    res = _cli("init", tmp_path / "c.json", "-o", tmp_path / "m", "--seed", 3)
    assert res.exit_code == 0, res.stderr
    res = _cli("info", tmp_path / "m")
    assert res.exit_code == 0 and "attention" in res.stdout, res.stdout
    res = _cli("train", tmp_path / "m", "--data", data, "-o", tmp_path / "t", "--seq-len", 16, "--batch-size", 2,
               "--max-steps", 4, "--lr", 3e-3, "--lr-schedule", "cosine", "--val-data", data, "--save-every", 2,
               "--json")
    assert res.exit_code == 0, res.stderr
    events = [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")]
    assert any(e.get("event") == "summary" and e["steps"] == 4 for e in events), res.stdout
    assert any(e.get("event") == "checkpoint" for e in events)
    res = _cli("eval", tmp_path / "t", "--data", data, "--seq-len", 16, "--json")
    assert res.exit_code == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    want, n = _hf_loss(tmp_path / "t", data, 16)
    print(f"\neval loss {got['loss']:.6f} vs transformers {want:.6f} over {n} tokens")
    assert got["tokens"] == n and abs(got["loss"] - want) < 1e-5 * want
    res = _cli("adapt", tmp_path / "m", "--data", data, "-o", tmp_path / "a", "--seq-len", 16, "--epochs", 1,
               "--lr", 1e-3, "--no-rollback")
    assert res.exit_code == 0, res.stderr
    before, after = load_checkpoint(tmp_path / "m").tensors, load_checkpoint(tmp_path / "a").tensors
    moved = {k for k in before if not np.array_equal(before[k], after[k])}
    assert moved and all(".mamba.in_proj." in k or k.endswith(".mamba.dt_bias") for k in moved), moved
    res = _cli("quantize", tmp_path / "t", "-o", tmp_path / "q")
    assert res.exit_code == 0, res.stderr
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert hf.config.model_type == tiny["model_type"]
    res = _cli("generate", tmp_path / "t", "-p", "the quick", "-n", 8, "-t", 0, "--json")
    assert res.exit_code == 0, res.stderr
    assert len(json.loads(res.stdout.strip().splitlines()[-1])["tokens"]) == 8
    # a LoRA adapter from the command line, evaluated applied and merged
    res = _cli("train", tmp_path / "t", "--data", data, "-o", tmp_path / "l", "--seq-len", 16, "--max-steps", 3,
               "--lora-rank", 4, "--lora-alpha", 8, "--lr", 1e-2, "--json")
    assert res.exit_code == 0, res.stderr
    assert (tmp_path / "l" / "adapter_model.safetensors").is_file()
    res = _cli("merge", tmp_path / "l", "-o", tmp_path / "lm")
    assert res.exit_code == 0, res.stderr
    ev = [json.loads(_cli("eval", d, "--data", data, "--seq-len", 16, "--json").stdout.strip().splitlines()[-1])
          for d in (tmp_path / "l", tmp_path / "lm", tmp_path / "t")]
    assert abs(ev[0]["loss"] - ev[1]["loss"]) < 1e-5 * ev[1]["loss"] and ev[0]["loss"] != ev[2]["loss"]
    res = _cli("generate", tmp_path / "l", "-p", "the quick", "-n", 4, "-t", 0, "--json")
    assert res.exit_code == 0, res.stderr


def test_cli_refusals_are_one_line(tmp_path):
    import json

    (tmp_path / "moe.json").write_text(json.dumps(dict(TINY_GRANITE, num_local_experts=4, num_experts_per_tok=2)))
    _one_error(_cli("init", tmp_path / "moe.json", "-o", tmp_path / "x"), "num_local_experts")
    (tmp_path / "c.json").write_text(json.dumps(TINY_GRANITE))
    (tmp_path / "d.txt").write_text(TEXT)
    assert _cli("init", tmp_path / "c.json", "-o", tmp_path / "m").exit_code == 0
    _one_error(_cli("train", tmp_path / "m", "--data", tmp_path / "d.txt", "-o", tmp_path / "l", "--seq-len", 8,
                    "--max-steps", 1, "--lora-rank", 2, "--lora-targets", "conv1d"), "--lora-targets conv1d")
    _one_error(_cli("train", tmp_path / "m", "--data", tmp_path / "d.txt", "-o", tmp_path / "l", "--seq-len", 8,
                    "--max-steps", 1, "--lora-rank", 2, "--lora-targets", "x_proj"), "x_proj")
    # --precision mixed trains (test_mixed_precision_within_bound_of_transformers holds its numbers)
    res = _cli("train", tmp_path / "m", "--data", tmp_path / "d.txt", "-o", tmp_path / "p", "--seq-len", 8,
               "--max-steps", 1, "--precision", "mixed")
    assert res.exit_code == 0, res.stderr


@pytest.mark.parametrize("name", ["granite-4.0-h-350m", "bamba-9b"])
def test_named_shapes_build_in_transformers(name):
    """configs/ holds the real checkpoints' shapes (written from their published config.json
    without a download): each parses, transformers builds the same model from our config.json
    (on the meta device) and the parameter counts agree with our tensor table, name by name."""
    cfg = models.load_config(name)
    arch = models.of(cfg)
    d = cfg.to_hf_dict()
    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(hf_config(d))
    theirs = {k: tuple(v.shape) for k, v in m.state_dict().items()
              if not (k == "lm_head.weight" and cfg.tie_word_embeddings)}
    assert dict(arch.iter_shapes(cfg)) == theirs
    print(f"\n{name}: {arch.n_params(cfg):,} parameters, attention at {cfg.attention_layers}")


# ----------------------------------------------------------------------------- LoRA (PEFT)
@pytest.mark.parametrize("case", [0, 1, 2, 3], ids=[c[0] for c in CASES])
def test_lora_round_trip_with_peft(rt, tmp_path, case):
    """A LoRA adapter on every layer PEFT adapts in these models (the Mamba layers' in_proj and
    out_proj; q, k, v, o; the MLP's layers), written by memengine in PEFT's format: PEFT
    loads it onto transformers' model, and the loss, the logits and every adapter gradient
    equal PEFT's autograd (float64); the merged weights equal PEFT's merge_and_unload; what
    PEFT saves, memengine reads back to the same tensors; generate with the adapter applied
    equals the merged model's step logits."""
    peft = pytest.importorskip("peft")
    from memengine.engine import lora as el
    from memengine.engine.app.generate import Decoder
    from memengine.engine.io.checkpoint import save_checkpoint

    name, kw, B, L = CASES[case]
    m = hf_model(kw, seed=6)
    sd = tensors_of(m)
    cfg = our_config(m, kw)
    arch = models.of(cfg)
    save_checkpoint(tmp_path / "base", cfg, sd, dtype="F32")
    spec = el.LoraSpec(r=3, alpha=5.0, targets=arch.lora_targets, base=str(tmp_path / "base"))
    rng = np.random.default_rng(1)
    tensors = {n: (0.3 * rng.standard_normal(s)).astype(np.float32) for n, s in el.shapes(cfg, spec).items()}
    assert any(".self_attn.o_proj." in n for n in tensors) and any(".mamba.out_proj." in n for n in tensors)
    el.write_adapter(tmp_path / "ad", spec, tensors)
    el.check_against(el.read_adapter(tmp_path / "ad"), cfg, "ad")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager").double()
    pm = peft.PeftModel.from_pretrained(base, tmp_path / "ad", is_trainable=True)
    ids = rng.integers(0, cfg.vocab_size, size=(2, 10))
    x, y = torch.tensor(ids[:, :-1]), torch.tensor(ids[:, 1:])
    with float64_oracle():
        logits_ref = pm(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits_ref.reshape(-1, cfg.vocab_size), y.reshape(-1))
        loss.backward()
    want = {n[len("base_model.model."):].replace(".default", ""): p.grad.numpy()
            for n, p in pm.named_parameters() if p.requires_grad}
    assert set(want) == set(tensors), sorted(set(want) ^ set(tensors))
    model = LanguageModel(rt, cfg, sd)
    model.lora = el.LoraAdapter(rt, cfg, spec, tensors, train=True)
    assert rel(model.logits(ids[:, :-1]), logits_ref.detach().numpy()) < 1e-4
    got = model.loss_and_grads(ids[:, :-1], ids[:, 1:], trainable=set(model.lora.names))
    assert rel(got, loss.item()) < 1e-5
    grads = model.lora.grad_dict()
    errs = {n: rel(grads[n], want[n]) for n in tensors}
    worst = max(errs, key=errs.get)
    print(f"\n[{name}] LoRA vs PEFT: loss rel {rel(got, loss.item()):.2e}, gradients max rel {errs[worst]:.2e} "
          f"({worst})")
    assert errs[worst] < 1e-4, worst
    # merge: ours = PEFT's merge_and_unload
    merged = el.merged_tensors(sd, el.read_adapter(tmp_path / "ad"))
    theirs = {k: v.detach().numpy() for k, v in pm.merge_and_unload().state_dict().items()}
    for k, v in merged.items():
        assert rel(v, theirs[k]) < 1e-6, k
    # what PEFT saves, we read back
    pm2 = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                              peft.LoraConfig(r=2, lora_alpha=4, target_modules=list(arch.lora_targets),
                                              task_type="CAUSAL_LM"))
    pm2.save_pretrained(tmp_path / "theirs")
    back = el.read_adapter(tmp_path / "theirs")
    el.check_against(back, cfg, "theirs")
    assert set(back.tensors) == set(el.shapes(cfg, el.LoraSpec(r=2, alpha=4, targets=arch.lora_targets)))
    # decoding with the adapter applied = the merged model's sequence logits
    dec = Decoder(model)
    seq = ids[0]
    steps = [dec.prefill_logits(seq[:3])] + [dec.push_logits(int(t)) for t in seq[3:]]
    full = LanguageModel(rt, cfg, merged).logits(seq[None])[0]
    assert rel(np.array(steps), full[2:]) < 1e-4


@pytest.mark.parametrize("kind", ["eval", "train", "adapt", "lora", "train-mixed"])
def test_plan_equals_what_a_run_allocates(rt, kind, tmp_path):
    """A whole run of a hybrid (eval; train with held-out windows, in fp32 and under
    --precision mixed; adapt; a LoRA adapter trained): the memory plan it passed is what it
    allocated (the Mamba buffers for the Mamba layers only, the attention buffers for the
    attention layers only, mixed's f16 copies)."""
    from memengine.engine.app import plan
    from memengine.engine.app.options import AdaptOptions, EvalOptions, TrainOptions
    from memengine.engine.app.run import run_adapt, run_eval, run_train
    from memengine.engine.io.checkpoint import save_checkpoint

    cfg = HybridConfig.from_dict(dict(TINY_GRANITE))
    B, L = 2, 100
    save_checkpoint(tmp_path / "m", cfg, models.of(cfg).init_weights(cfg, 0), dtype="F32")
    rng = np.random.default_rng(0)
    (tmp_path / "d.txt").write_text("".join(chr(c) for c in rng.integers(97, 123, 5 * B * L)), encoding="utf-8")
    common = dict(ckpt=str(tmp_path / "m"), data=[str(tmp_path / "d.txt")], batch_size=B, seq_len=L)
    seen = {}
    real = plan.check_run
    mp = pytest.MonkeyPatch()
    mp.setattr(plan, "check_run", lambda *a, **kw: seen.setdefault("plan", real(*a, **kw)))
    try:
        if kind == "eval":
            run_eval(EvalOptions(**common))
        elif kind == "lora":
            run_train(TrainOptions(**common, epochs=1, val_fraction=0.3, output=tmp_path / "o", lora_rank=4))
        elif kind == "train":
            run_train(TrainOptions(**common, epochs=1, val_fraction=0.3, output=tmp_path / "o"))
        elif kind == "train-mixed":
            if not rt.has_f16:
                pytest.skip("the adapter lacks shader-f16")
            run_train(TrainOptions(**common, epochs=1, val_fraction=0.3, output=tmp_path / "o", precision="mixed"))
            assert seen["plan"].mixed
        else:
            run_adapt(AdaptOptions(**common, epochs=1, output=tmp_path / "o"))
    finally:
        mp.undo()
    est, got = seen["plan"], rt.bytes_allocated
    print(f"\n{kind}: plan {est.total:,} bytes, allocated {got:,} bytes")
    assert got - 4096 <= est.total <= 1.05 * got
