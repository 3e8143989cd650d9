"""A real checkpoint size on the adapter's own limits: the mamba-130m shape (V 50280, E 768,
24 layers; random weights, nothing downloaded), saved by transformers' `save_pretrained` as
shards, goes through every command with 128 MiB storage bindings, although its embedding
table (147 MiB) is larger than one such binding (lavapipe's and WebGPU's default).  Oracles:
the loss of transformers' MambaForCausalLM on the same weights (float64, as the other oracle
tests), and the quantized output loaded by transformers, equal to its own weights cast.

The weights are transformers' initialisation with the residual projections rescaled by
1/sqrt(layers) (`rescale_prenorm_residual`, mamba_ssm's own init): without it a random
24-layer stack amplifies float32 rounding enough that transformers' own float32 forward
drifts 2e-4 from its float64 one.  The data is one 16-token window (one training step).

`info`, `eval` and `quantize` run in the default suite (about 40 s on a 2-core machine with
lavapipe); `train`, `adapt` and `generate` are marked `slow` (a 130m-shape training step
takes about 40 s on lavapipe, most of it in matmuls whose 128-row tiles hold 16 rows;
generate's oracle, transformers' float64 generate, about a minute): `make test-slow`, or
`pytest -m slow`, runs them (about 5 minutes)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from memengine.engine.models import load_config  # noqa: E402
from memengine.engine.runtime import get_runtime  # noqa: E402
from test_cli import run  # noqa: E402

BINDING = 128 * 2**20
ENV = {"MEMENGINE_MAX_BINDING_BYTES": str(BINDING)}
TEXT = "It was the best o"  # 17 bytes: 16 inputs, each predicting the next (byte-level tokenizer)


@pytest.fixture(scope="module")
def m130(tmp_path_factory):
    """(sharded checkpoint dir, data file, transformers' float64 loss, its bf16 weights)."""
    cfg = load_config("mamba-130m")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    hf = transformers.MambaForCausalLM(transformers.MambaConfig(
        **{**cfg.to_hf_dict(), "rescale_prenorm_residual": True})).eval()
    hf.config.rescale_prenorm_residual = False  # (else from_pretrained rescales the loaded weights again)
    d = tmp_path_factory.mktemp("m130")
    hf.save_pretrained(d / "ckpt", max_shard_size="100MB")
    want_bf16 = {k: v.detach().to(torch.bfloat16) for k, v in hf.state_dict().items()}
    ids = torch.tensor([list(TEXT.encode())])
    with torch.no_grad():
        ref = float(hf.double()(input_ids=ids, labels=ids).loss)
    del hf
    (d / "d.txt").write_text(TEXT, encoding="utf-8")
    print(f"\ntransformers: model, shards and float64 loss in {time.perf_counter() - t0:.1f}s")
    yield d / "ckpt", d / "d.txt", ref, want_bf16
    get_runtime()  # the adapter's own limits again for the tests that follow


def _json(r) -> dict:
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def _timed(times: dict, name: str, *args) -> dict:
    t = time.perf_counter()
    out = _json(run(*args, env=ENV))
    times[name] = time.perf_counter() - t
    return out


def test_mamba_130m_shape_sharded_by_transformers_info_eval_quantize(rt, m130, tmp_path):
    src, data, ref, want_bf16 = m130
    shards = sorted(p.name for p in src.glob("model-*.safetensors"))
    assert len(shards) >= 5 and (src / "model.safetensors.index.json").is_file()
    assert want_bf16["backbone.embeddings.weight"].numel() * 4 > BINDING  # 147 MiB > 128 MiB
    times: dict = {}
    info = _timed(times, "info", "info", src, "--seq-len", 16, "--json")
    assert info["weight_files"] == shards and info["parameters"] == 129_135_360
    assert info["plan"]["limits"]["max_binding_bytes"] == BINDING
    assert all(info["plan"][k]["ok"] for k in ("eval", "train", "adapt"))

    ev = _timed(times, "eval", "eval", src, "--data", data, "--seq-len", 16, "--json")
    assert ev["tokens"] == 16
    assert abs(ev["loss"] - ref) <= 1e-4 * ref, (ev["loss"], ref)

    q = tmp_path / "bf16"
    _timed(times, "quantize", "quantize", src, "-o", q, "--dtype", "bf16", "--max-shard-size", "100MB", "--json")
    assert len(list(q.glob("model-*.safetensors"))) >= 2
    t = time.perf_counter()
    got = transformers.MambaForCausalLM.from_pretrained(q, torch_dtype=torch.bfloat16).state_dict()
    for k, v in want_bf16.items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v), k
    times["transformers load"] = time.perf_counter() - t
    print(f"\nmamba-130m shape, {len(shards)} shards, on {rt.describe()}: eval loss {ev['loss']:.6f} vs "
          f"transformers {ref:.6f} (rel {abs(ev['loss'] - ref) / ref:.1e}); "
          + ", ".join(f"{k} {v:.1f}s" for k, v in times.items()))


@pytest.mark.slow
def test_mamba_130m_shape_sharded_by_transformers_train_and_adapt(rt, m130, tmp_path):
    src, data, ref, _ = m130
    common = ["--data", data, "--seq-len", 16, "--epochs", 1, "--json"]
    times: dict = {}
    tr = _timed(times, "train", "train", src, "-o", tmp_path / "trained", *common)
    assert tr["steps"] == 1 and tr["epochs"] == 1
    assert abs(tr["first_loss"] - ref) <= 1e-4 * ref, (tr["first_loss"], ref)  # the one step's loss
    out = transformers.MambaForCausalLM.from_pretrained(tmp_path / "trained")
    assert out.config.vocab_size == 50280 and out.config.num_hidden_layers == 24

    ad = _timed(times, "adapt", "adapt", src, "-o", tmp_path / "adapted", *common)
    assert not ad["rolled_back"]
    assert abs(np.log(ad["perplexity_before"]) - ref) <= 1e-4 * ref
    assert ad["changed_tensors"] and all(".mixer.x_proj." in n for n in ad["changed_tensors"])
    print("\n" + ", ".join(f"{k} {v:.1f}s" for k, v in times.items()))


@pytest.mark.slow
def test_mamba_130m_shape_generate_reads_the_lm_head_in_ranges(rt, m130):
    """generate on the 130m shape with 128 MiB bindings: the LM head (tied to the 147 MiB
    embedding table) is read in row ranges by every step; greedy tokens equal transformers'
    generate on the same shards (float64), or first differ at a near tie of its logits."""
    src, _, _, _ = m130
    n_new = 4
    t = time.perf_counter()
    out = _json(run("generate", src, "-p", TEXT, "-n", n_new, "-t", 0, "--json", env=ENV))
    took = time.perf_counter() - t
    hf = transformers.MambaForCausalLM.from_pretrained(src).double().eval()
    ids = torch.tensor([list(TEXT.encode())])
    with torch.no_grad():
        g = hf.generate(ids, max_new_tokens=n_new, do_sample=False, eos_token_id=None, pad_token_id=0,
                        output_scores=True, return_dict_in_generate=True)
    want = g.sequences[0, ids.shape[1]:].tolist()
    got = out["tokens"]
    assert len(got) == n_new and out["stop"] == "length"
    j = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if j is not None:  # allowed only where transformers' own top logits are a near tie
        s = g.scores[j][0].numpy()
        gap = float(s[want[j]] - s[got[j]])
        assert gap <= 1e-4 * float(np.abs(s).max()), (j, got, want, gap)
    print(f"\n130m generate: {got} vs transformers {want}, {took:.1f}s "
          f"({out['tokens_per_s']:.2f} tokens/s after a first token at {out['ttft_s']:.1f}s)")
