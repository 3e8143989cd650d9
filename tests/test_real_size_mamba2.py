"""A real Mamba-2 checkpoint size on the adapter's own limits: the mamba2-130m shape (V 50288,
E 768, 24 layers of 24 heads x 64, N 128; random weights, nothing downloaded), saved by
transformers' `save_pretrained` as shards, through `info`, `eval`, `quantize`, `train`, a
LoRA adapter and `generate` with 128 MiB storage bindings, although its embedding table
(147 MiB) is larger than one such binding.  Oracles: transformers' Mamba2ForCausalLM on the
same weights (its PyTorch path, float64): the loss, the greedy tokens; the quantized output
loaded by transformers equals its own weights cast.

The weights are transformers' initialisation with the residual projections rescaled by
1/sqrt(layers), as in tests/test_real_size.py (a random 24-layer stack otherwise amplifies
float32 rounding).  The data is one 16-token window.  All marked `slow` (minutes on
lavapipe): `make test-slow`."""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from memengine.engine.models import load_config  # noqa: E402
from memengine.engine.runtime import get_runtime  # noqa: E402
from test_cli import run  # noqa: E402
from test_real_size import BINDING, ENV, TEXT, _json, _timed  # noqa: E402  (the Mamba-1 size test's)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def m2(tmp_path_factory):
    """(sharded checkpoint dir, data file, transformers' float64 loss, its bf16 weights)."""
    cfg = load_config("mamba2-130m")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    hf = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(
        **{**cfg.to_hf_dict(), "rescale_prenorm_residual": True})).eval()
    hf.config.rescale_prenorm_residual = False  # (else from_pretrained rescales the loaded weights again)
    d = tmp_path_factory.mktemp("m2")
    hf.save_pretrained(d / "ckpt", max_shard_size="100MB")
    want_bf16 = {k: v.detach().to(torch.bfloat16) for k, v in hf.state_dict().items()}
    ids = torch.tensor([list(TEXT.encode())])
    with torch.no_grad():
        ref = float(hf.double()(input_ids=ids, labels=ids).loss)
    del hf
    (d / "d.txt").write_text(TEXT, encoding="utf-8")
    print(f"\ntransformers: Mamba-2 model, shards and float64 loss in {time.perf_counter() - t0:.1f}s")
    yield d / "ckpt", d / "d.txt", ref, want_bf16
    get_runtime()


def test_mamba2_130m_shape_sharded_info_eval_quantize(rt, m2, tmp_path):
    src, data, ref, want_bf16 = m2
    shards = sorted(p.name for p in src.glob("model-*.safetensors"))
    assert len(shards) >= 5 and (src / "model.safetensors.index.json").is_file()
    assert want_bf16["backbone.embeddings.weight"].numel() * 4 > BINDING  # 147 MiB > 128 MiB
    times: dict = {}
    info = _timed(times, "info", "info", src, "--seq-len", 16, "--json")
    assert info["weight_files"] == shards
    assert info["parameters"] == sum(v.numel() for k, v in want_bf16.items() if k != "lm_head.weight")
    assert info["plan"]["limits"]["max_binding_bytes"] == BINDING
    assert all(info["plan"][k]["ok"] for k in ("eval", "train", "adapt"))

    ev = _timed(times, "eval", "eval", src, "--data", data, "--seq-len", 16, "--json")
    assert ev["tokens"] == 16
    assert abs(ev["loss"] - ref) <= 1e-4 * ref, (ev["loss"], ref)

    q = tmp_path / "bf16"
    _timed(times, "quantize", "quantize", src, "-o", q, "--dtype", "bf16", "--max-shard-size", "100MB", "--json")
    got = transformers.Mamba2ForCausalLM.from_pretrained(q, torch_dtype=torch.bfloat16).state_dict()
    for k, v in want_bf16.items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v), k
    print(f"\nmamba2-130m shape, {len(shards)} shards, on {rt.describe()}: eval loss {ev['loss']:.6f} vs "
          f"transformers {ref:.6f} (rel {abs(ev['loss'] - ref) / ref:.1e}); "
          + ", ".join(f"{k} {v:.1f}s" for k, v in times.items()))


def test_mamba2_130m_shape_train_lora_and_adapt(rt, m2, tmp_path):
    src, data, ref, _ = m2
    common = ["--data", data, "--seq-len", 16, "--epochs", 1, "--json"]
    times: dict = {}
    tr = _timed(times, "train", "train", src, "-o", tmp_path / "trained", *common)
    assert tr["steps"] == 1 and abs(tr["first_loss"] - ref) <= 1e-4 * ref, (tr["first_loss"], ref)
    out = transformers.Mamba2ForCausalLM.from_pretrained(tmp_path / "trained")
    assert out.config.vocab_size == 50288 and out.config.num_hidden_layers == 24

    lo = _timed(times, "lora", "train", src, "-o", tmp_path / "lora", "--lora-rank", 4, *common)
    assert lo["steps"] == 1 and abs(lo["first_loss"] - ref) <= 1e-4 * ref
    assert (tmp_path / "lora" / "adapter_model.safetensors").is_file()

    ad = _timed(times, "adapt", "adapt", src, "-o", tmp_path / "adapted", *common)
    assert abs(np.log(ad["perplexity_before"]) - ref) <= 1e-4 * ref
    assert ad["changed_tensors"] and all(n.endswith(("mixer.in_proj.weight", "mixer.dt_bias"))
                                         for n in ad["changed_tensors"])
    print("\n" + ", ".join(f"{k} {v:.1f}s" for k, v in times.items()))


def test_mamba2_130m_shape_generate_equals_transformers(rt, m2):
    """Greedy tokens equal transformers' generate on the same shards (float64), or first differ
    at a near tie of its logits."""
    src, _, _, _ = m2
    n_new = 4
    out = _json(run("generate", src, "-p", TEXT, "-n", n_new, "-t", 0, "--json", env=ENV))
    hf = transformers.Mamba2ForCausalLM.from_pretrained(src).double().eval()
    ids = torch.tensor([list(TEXT.encode())])
    with torch.no_grad():
        g = hf.generate(ids, max_new_tokens=n_new, do_sample=False, eos_token_id=None, pad_token_id=0,
                        output_scores=True, return_dict_in_generate=True)
    want = g.sequences[0, ids.shape[1]:].tolist()
    got = out["tokens"]
    assert len(got) == n_new and out["stop"] == "length"
    j = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if j is not None:
        s = g.scores[j][0].numpy()
        gap = float(s[want[j]] - s[got[j]])
        assert gap <= 1e-4 * float(np.abs(s).max()), (j, got, want, gap)
    print(f"\nmamba2-130m generate: {got} vs transformers {want}")
