"""Logits, loss and every gradient against transformers' MambaForCausalLM and
FalconMambaForCausalLM (pure PyTorch).

The oracle is the same checkpoint run through `transformers` on the CPU in float64; our
GPU model runs it in float32.  The largest relative error of each quantity is printed.

Each case also runs with the storage-binding limit forced down to the smallest one the run
can work with (a few KiB for the short cases: one sequence must fit) and the buffer limit to
the largest single tensor, so every tensor larger than that is split into ranges and the
parameter/gradient stores take several buffers.
"""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import checked_limits  # noqa: E402
from memengine.engine.app import plan  # noqa: E402
from memengine.engine.models.mamba1.config import MambaConfig  # noqa: E402
from memengine.engine.models.lm import LanguageModel  # noqa: E402

LIMITS = ["adapter", "forced"]


def forced_limits(cfg, B, L) -> tuple[int, int]:
    """(binding, buffer) limits that split every tensor that can be split: the binding the
    plan says one unit of work needs (at least 4 KiB), the buffer the largest tensor needs."""
    binding = max(4096, -(-plan.min_binding(cfg, B, L) // 1024) * 1024)
    big = plan.Limits(2**62, 2**62, 256)
    largest = max(b for _, b, _ in plan.estimate(cfg, B, L, "train", big).buffers)
    return binding, max(binding, largest)


def limits_for(rt, mode, cfg, B, L, monkeypatch):
    """The adapter's limits, or the forced ones with every dispatch checked against them."""
    if mode == "adapter":
        return contextlib.nullcontext()
    return checked_limits(rt, monkeypatch, *forced_limits(cfg, B, L))


# (name, config kwargs, batch, seq_len)
CASES = [
    ("tied-odd", dict(vocab_size=259, hidden_size=37, state_size=5, num_hidden_layers=2, expand=2,
                      conv_kernel=4, use_bias=False, use_conv_bias=True, tie_word_embeddings=True), 2, 7),
    ("untied-bias-L1", dict(vocab_size=67, hidden_size=16, state_size=4, num_hidden_layers=1, expand=2,
                            conv_kernel=3, use_bias=True, use_conv_bias=False, tie_word_embeddings=False), 1, 1),
    ("untied-bias-long", dict(vocab_size=131, hidden_size=24, state_size=16, num_hidden_layers=2, expand=2,
                              conv_kernel=4, use_bias=True, use_conv_bias=True, tie_word_embeddings=False,
                              time_step_rank=5), 2, 300),
]


def hf_model(kwargs, seed=0, falcon=False):
    torch.manual_seed(seed)
    if falcon:
        m = transformers.FalconMambaForCausalLM(transformers.FalconMambaConfig(**kwargs))
    else:
        m = transformers.MambaForCausalLM(transformers.MambaConfig(**kwargs))
    m = m.double().eval()
    # make the weights less symmetric than the default init (D = 1, A_log = log n)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(".D") or name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("A_log"):
                p.add_(0.05 * torch.randn_like(p))
            if name.endswith("bias"):
                p.add_(0.02 * torch.randn_like(p))
    return m


def tensors_of(m) -> dict:
    sd = {k: v.detach().to(torch.float32).numpy().copy() for k, v in m.state_dict().items()}
    if m.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def rel(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


FALCON_CASES = [
    ("falcon-tied-odd", dict(CASES[0][1]), 2, 7),
    ("falcon-untied-bias-eps", dict(CASES[1][1], mixer_rms_eps=0.05, state_size=3, time_step_rank=3), 2, 5),
    ("falcon-untied-bias-long", dict(CASES[2][1], num_hidden_layers=1), 1, 130),
]


@pytest.mark.parametrize("limits", LIMITS)
@pytest.mark.parametrize("name,kw,B,L", CASES + FALCON_CASES, ids=[c[0] for c in CASES + FALCON_CASES])
def test_logits_loss_grads_match_transformers(rt, monkeypatch, name, kw, B, L, limits):
    falcon = name.startswith("falcon")
    m = hf_model(kw, falcon=falcon)
    tensors = tensors_of(m)
    cfg = MambaConfig.from_dict(m.config.to_dict())
    assert cfg.is_falcon == falcon and cfg.mixer_rms_eps == m.config.to_dict().get("mixer_rms_eps", 1e-6)
    from memengine.engine.kernels import scan

    scan_parts = []
    whole = scan._sequences
    monkeypatch.setattr(scan, "_sequences", lambda *a: scan_parts.append(len(whole(*a))) or whole(*a))
    with limits_for(rt, limits, cfg, B, L, monkeypatch):
        batch_over = max(scan.sequence_windows(B, L, cfg.intermediate_size, cfg.state_size, cfg.dt_rank)) > (
            rt.max_binding - rt.storage_align + 4)
        _compare(rt, m, tensors, cfg, name, kw, B, L, limits)
    if limits == "forced" and batch_over:  # the selective scan ran in ranges of sequences
        assert max(scan_parts) > 1, scan_parts


def _compare(rt, m, tensors, cfg, name, kw, B, L, limits):
    ours = LanguageModel(rt, cfg, tensors)
    if limits == "forced":  # the forcing bites: tensors exceed one binding, the stores split
        ws = ours.workspace(B, L)
        sizes = [t.nbytes for t in ours.P.views.values()]
        whole_logits = 4 * B * L * cfg.vocab_size
        assert max(sizes + [ws.xz[0].nbytes, whole_logits]) > rt.max_binding, (max(sizes), rt.max_binding)
        if sum(sizes) > rt.max_buffer:
            assert len(ours.P.segments) > 1

    rng = np.random.default_rng(1)
    V = kw["vocab_size"]
    ids = rng.integers(0, V, size=(B, L)).astype(np.int32)
    targets = rng.integers(0, V, size=(B, L)).astype(np.int32)
    if B * L > 2:
        targets[0, -1] = -1  # an ignored target

    # oracle: float64 autograd through transformers
    t_ids = torch.tensor(ids, dtype=torch.long)
    logits_ref = m(input_ids=t_ids).logits
    loss_ref = torch.nn.functional.cross_entropy(
        logits_ref.reshape(-1, V), torch.tensor(targets, dtype=torch.long).reshape(-1), ignore_index=-1)
    loss_ref.backward()
    grads_ref = {n: p.grad.numpy() for n, p in m.named_parameters()}

    logits = ours.logits(ids)
    e_logits = rel(logits, logits_ref.detach().numpy())
    loss = ours.loss_and_grads(ids, targets)
    if limits == "forced":
        print(f"\n[{name}] forced limits: binding {rt.max_binding} B, buffer {rt.max_buffer} B, "
              f"{len(ours.P.segments)} parameter buffer(s)")
    e_loss = abs(loss - loss_ref.item()) / abs(loss_ref.item())
    grads = ours.grad_dict()
    print(f"[{name}/{limits}] logits max rel err {e_logits:.2e}; loss {loss:.6f} vs {loss_ref.item():.6f} "
          f"(rel {e_loss:.2e})")
    assert e_logits < 1e-4
    assert e_loss < 1e-4

    worst = 0.0
    assert set(grads_ref) == set(grads), (sorted(set(grads_ref) ^ set(grads)))
    for n, g_ref in grads_ref.items():
        e = rel(grads[n], g_ref)
        worst = max(worst, e)
        print(f"  d{n:45s} max rel err {e:.2e}")
        assert e < 1e-3, n
    print(f"[{name}] largest gradient rel err {worst:.2e}")
    if cfg.is_falcon:  # the dt/B/C norms matter: the same weights run as plain Mamba miss the oracle
        plain = LanguageModel(rt, MambaConfig.from_dict({**m.config.to_dict(), "model_type": "mamba"}), tensors)
        e_plain = rel(plain.logits(ids), logits_ref.detach().numpy())
        plain.loss_and_grads(ids, targets)
        xp = "backbone.layers.0.mixer.x_proj.weight"
        e_plain_g = rel(plain.grad_dict()[xp], grads_ref[xp])
        print(f"[{name}] as plain Mamba: logits rel err {e_plain:.2e}, d{xp} rel err {e_plain_g:.2e}")
        assert e_plain > 1e-4 and e_plain_g > 1e-3


def test_lm_head_in_row_chunks_matches_whole(rt):
    """Logits larger than one binding are produced in row chunks: same loss and gradients."""
    kw = dict(CASES[0][1])
    m = hf_model(kw, seed=3)
    tensors = tensors_of(m)
    cfg = MambaConfig.from_dict(m.config.to_dict())
    rng = np.random.default_rng(2)
    ids = rng.integers(0, kw["vocab_size"], size=(2, 9)).astype(np.int32)
    tg = rng.integers(0, kw["vocab_size"], size=(2, 9)).astype(np.int32)

    whole = LanguageModel(rt, cfg, tensors)
    loss_w = whole.loss_and_grads(ids, tg)
    grads_w = whole.grad_dict()
    logits_w = whole.logits(ids)

    chunked = LanguageModel(rt, cfg, tensors)
    ws = chunked.workspace(2, 9)
    assert ws.chunk == 18
    ws.chunk = 4  # 18 rows -> chunks of 4, 4, 4, 4, 2
    loss_c = chunked.loss_and_grads(ids, tg)
    grads_c = chunked.grad_dict()
    np.testing.assert_allclose(chunked.logits(ids), logits_w, rtol=1e-5, atol=1e-6)
    assert abs(loss_c - loss_w) < 1e-5 * abs(loss_w)
    for n in grads_w:
        np.testing.assert_allclose(grads_c[n], grads_w[n], rtol=1e-4, atol=1e-7, err_msg=n)
