"""A real hybrid checkpoint size on the adapter's own limits: the granite-4.0-h-350m shape
(configs/granite-4.0-h-350m.json: V 100352, E 768, 32 layers of which 4 attention, 12 / 4
heads x 64, Mamba 48 heads x 32, N 128; random weights from transformers' init, nothing
downloaded), saved by transformers' `save_pretrained` as shards, through `info`, `eval`,
`train`, a LoRA adapter, `adapt` and `generate` with 128 MiB storage bindings, although its embedding table
(294 MiB) is larger than one such binding.  Oracles: transformers' GraniteMoeHybridForCausalLM
on the same shards (its PyTorch path, float64): the loss, the greedy tokens.  The data is one
16-token window.  Marked `slow` (minutes on lavapipe): `make test-slow`."""

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
def g350(tmp_path_factory):
    """(sharded checkpoint dir, data file, transformers' float64 loss)."""
    cfg = load_config("granite-4.0-h-350m")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    hf = transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(**cfg.to_hf_dict())).eval()
    d = tmp_path_factory.mktemp("g350")
    hf.save_pretrained(d / "ckpt", max_shard_size="200MB")
    ids = torch.tensor([list(TEXT.encode())])
    with torch.no_grad():
        ref = float(hf.double()(input_ids=ids, labels=ids).loss)
    del hf
    (d / "d.txt").write_text(TEXT, encoding="utf-8")
    print(f"\ntransformers: Granite 4.0-H 350m shape, shards and float64 loss in {time.perf_counter() - t0:.1f}s")
    yield d / "ckpt", d / "d.txt", ref
    get_runtime()


def test_granite_350m_shape_sharded_info_eval_train_lora_adapt(rt, g350, tmp_path):
    src, data, ref = g350
    shards = sorted(p.name for p in src.glob("model-*.safetensors"))
    assert len(shards) >= 3 and (src / "model.safetensors.index.json").is_file()
    times: dict = {}
    info = _timed(times, "info", "info", src, "--seq-len", 16, "--json")
    assert info["weight_files"] == shards
    assert info["plan"]["limits"]["max_binding_bytes"] == BINDING
    assert all(info["plan"][k]["ok"] for k in ("eval", "train", "adapt"))
    ev = _timed(times, "eval", "eval", src, "--data", data, "--seq-len", 16, "--json")
    assert ev["tokens"] == 16
    assert abs(ev["loss"] - ref) <= 1e-4 * ref, (ev["loss"], ref)
    common = ["--data", data, "--seq-len", 16, "--epochs", 1, "--json"]
    tr = _timed(times, "train", "train", src, "-o", tmp_path / "trained", *common)
    assert tr["steps"] == 1 and abs(tr["first_loss"] - ref) <= 1e-4 * ref, (tr["first_loss"], ref)
    out = transformers.GraniteMoeHybridForCausalLM.from_pretrained(tmp_path / "trained")
    assert out.config.vocab_size == 100352 and out.config.num_hidden_layers == 32
    lo = _timed(times, "lora", "train", src, "-o", tmp_path / "lora", "--lora-rank", 4, *common)
    assert lo["steps"] == 1 and abs(lo["first_loss"] - ref) <= 1e-4 * ref
    assert (tmp_path / "lora" / "adapter_model.safetensors").is_file()
    ad = _timed(times, "adapt", "adapt", src, "-o", tmp_path / "adapted", "--no-rollback", *common)
    assert abs(np.log(ad["perplexity_before"]) - ref) <= 1e-4 * ref
    assert ad["changed_tensors"] and all(n.endswith(("mamba.in_proj.weight", "mamba.dt_bias"))
                                         for n in ad["changed_tensors"])
    print(f"\ngranite-4.0-h-350m shape, {len(shards)} shards, on {rt.describe()}: eval loss {ev['loss']:.6f} vs "
          f"transformers {ref:.6f} (rel {abs(ev['loss'] - ref) / ref:.1e}); "
          + ", ".join(f"{k} {v:.1f}s" for k, v in times.items()))


def test_granite_350m_shape_generate_equals_transformers(rt, g350):
    """Greedy tokens equal transformers' generate on the same shards (float64), or first differ
    at a near tie of its logits."""
    src, _, _ = g350
    n_new = 4
    out = _json(run("generate", src, "-p", TEXT, "-n", n_new, "-t", 0, "--json", env=ENV))
    hf = transformers.GraniteMoeHybridForCausalLM.from_pretrained(src).double().eval()
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
    print(f"\ngranite-4.0-h-350m generate: {got} vs transformers {want}")
