"""`memengine export`: the GGUF file read back with the gguf package's own reader (names,
shapes, types, metadata keys and values as llama.cpp's converter writes them for Mamba-1
and Falcon-Mamba), the tokenizer mapping, a merged LoRA adapter, the atomic write, and the
refusals. llama.cpp running the files is tests/test_export_llama_cpp.py (slow)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from memengine.engine.errors import MemengineError  # noqa: E402
from memengine.engine.io.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from memengine.engine.models.mamba1.config import MambaConfig  # noqa: E402
from memengine.engine.models.mamba1.init import init_weights  # noqa: E402
from test_cli import assert_one_line_error, run, tree_digest  # noqa: E402

ODD = dict(vocab_size=259, hidden_size=40, state_size=6, num_hidden_layers=2, expand=2, conv_kernel=4)


def make_model(path: Path, seed: int = 0, **overrides) -> Path:
    """A checkpoint of odd shape, its weights less symmetric than the init (D, norms, A and
    the biases moved), so that a wrong mapping shows in the logits."""
    cfg = MambaConfig.from_dict({**ODD, **overrides})
    t = init_weights(cfg, seed)
    rng = np.random.default_rng(seed + 100)
    for name, a in t.items():
        if name.endswith((".D", "norm.weight", "norm_f.weight")):
            t[name] = (a + 0.1 * rng.standard_normal(a.shape)).astype(np.float32)
        elif name.endswith("A_log"):
            t[name] = (a + 0.05 * rng.standard_normal(a.shape)).astype(np.float32)
        elif name.endswith("bias"):
            t[name] = (a + 0.02 * rng.standard_normal(a.shape)).astype(np.float32)
    save_checkpoint(path, cfg, t, dtype="F32")
    return path


def read(path: Path):
    r = gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: t for t in r.tensors}
    return fields, tensors


def export(*args):
    return run("export", *[str(a) for a in args])


def tensor_f32(t) -> np.ndarray:
    """A tensor read back, as float32 in numpy order."""
    shape = tuple(int(n) for n in reversed(t.shape))
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)


@pytest.mark.parametrize("falcon", [False, True], ids=["mamba", "falcon_mamba"])
def test_f32_export_has_the_converters_names_shapes_and_keys(tmp_path, falcon):
    ck = make_model(tmp_path / "m", model_type="falcon_mamba" if falcon else "mamba")
    out = tmp_path / "m.gguf"
    r = export(ck, "-o", out, "--type", "f32", "--json")
    assert r.exit_code == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["output"] == str(out) and summary["type"] == "f32" and summary["architecture"] == "mamba"
    fields, tensors = read(out)
    cfg = load_checkpoint(ck).config
    E, Di, N, R, K, V = 40, 80, 6, 3, 4, 259
    assert fields["general.architecture"] == "mamba"  # the converter writes falcon_mamba as mamba + dt_b_c_rms
    assert fields["general.type"] == "model"
    assert fields["general.file_type"] == int(gguf.LlamaFileType.ALL_F32)
    assert fields["general.quantization_version"] == gguf.GGML_QUANT_VERSION
    expect = {"mamba.context_length": 2**20, "mamba.embedding_length": E, "mamba.feed_forward_length": 0,
              "mamba.attention.head_count": 0, "mamba.block_count": 2, "mamba.ssm.conv_kernel": K,
              "mamba.ssm.inner_size": Di, "mamba.ssm.state_size": N, "mamba.ssm.time_step_rank": R,
              "mamba.ssm.dt_b_c_rms": falcon, "tokenizer.ggml.model": "none", "mamba.vocab_size": V}
    for k, v in expect.items():
        assert fields[k] == v, k
    assert fields["mamba.attention.layer_norm_rms_epsilon"] == pytest.approx(cfg.layer_norm_epsilon)
    # names: gguf's own table for MODEL_ARCH.MAMBA (the converter's map_tensor_name)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MAMBA, 2)
    src = load_checkpoint(ck).tensors
    want = {}
    for hf in src:
        base, suffix = (hf[:-len(".weight")], ".weight") if hf.endswith(".weight") else \
            (hf[:-len(".bias")], ".bias") if hf.endswith(".bias") else (hf, "")
        want[tmap.get_name(base) + suffix] = hf
    assert set(tensors) == set(want)  # tied: no output.weight
    shapes = {"token_embd.weight": (V, E), "output_norm.weight": (E,)}
    for i in range(2):
        shapes.update({f"blk.{i}.attn_norm.weight": (E,), f"blk.{i}.ssm_in.weight": (2 * Di, E),
                       f"blk.{i}.ssm_conv1d.weight": (Di, K), f"blk.{i}.ssm_conv1d.bias": (Di,),
                       f"blk.{i}.ssm_x.weight": (R + 2 * N, Di), f"blk.{i}.ssm_dt.weight": (Di, R),
                       f"blk.{i}.ssm_dt.bias": (Di,), f"blk.{i}.ssm_a": (Di, N), f"blk.{i}.ssm_d": (Di,),
                       f"blk.{i}.ssm_out.weight": (E, Di)})
    for name, t in tensors.items():
        assert tuple(int(n) for n in reversed(t.shape)) == shapes[name], name
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, name
        a, x = tensor_f32(t), src[want[name]]
        if name.endswith("ssm_a"):
            x = -np.exp(x)
        np.testing.assert_array_equal(a, x.reshape(a.shape).astype(np.float32), err_msg=name)


def test_untied_head_and_no_conv_bias(tmp_path):
    ck = make_model(tmp_path / "m", tie_word_embeddings=False, use_conv_bias=False)
    out = tmp_path / "m.gguf"
    r = export(ck, "-o", out, "-t", "f32")
    assert r.exit_code == 0, r.stderr
    assert "zero ssm_conv1d.bias" in r.stderr
    _, tensors = read(out)
    assert "output.weight" in tensors
    np.testing.assert_array_equal(tensor_f32(tensors["output.weight"]),
                                  load_checkpoint(ck).tensors["lm_head.weight"])
    assert not tensor_f32(tensors["blk.1.ssm_conv1d.bias"]).any()


@pytest.mark.parametrize("type_,qtype", [("f16", "F16"), ("bf16", "BF16"), ("q8_0", "Q8_0"), ("q4_0", "Q4_0"),
                                         ("q4_1", "Q4_1"), ("q5_0", "Q5_0"), ("q5_1", "Q5_1")])
def test_types_keep_small_tensors_f32_and_fall_back_to_f16(tmp_path, type_, qtype):
    # E = 64: rows of 64 and 128 split into 32-blocks; dt_proj's rows (R = 4) do not -> F16
    ck = make_model(tmp_path / "m", hidden_size=64)
    out = tmp_path / "m.gguf"
    assert export(ck, "-o", out, "--type", type_).exit_code == 0
    fields, tensors = read(out)
    assert fields["general.file_type"] == int(gguf.LlamaFileType["MOSTLY_" + qtype])
    Q = gguf.GGMLQuantizationType
    block = gguf.GGML_QUANT_SIZES[Q[qtype]][0]
    for name, t in tensors.items():
        if len(t.shape) == 1 or name.endswith(("ssm_a", "ssm_conv1d.weight")):
            assert t.tensor_type == Q.F32, name
        elif int(t.shape[0]) % block:
            assert t.tensor_type == Q.F16, name
        else:
            assert t.tensor_type == Q[qtype], name
    assert tensors["blk.0.ssm_in.weight"].tensor_type == Q[qtype]
    # what was written decodes to the weights within the type's step
    w = load_checkpoint(ck).tensors["backbone.layers.0.mixer.in_proj.weight"]
    err = np.abs(tensor_f32(tensors["blk.0.ssm_in.weight"]) - w).max() / np.abs(w).max()
    assert err < {"F16": 1e-3, "BF16": 8e-3, "Q8_0": 1e-2}.get(qtype, 0.1), err


def test_types_not_written_are_refused_in_one_line(tmp_path):
    ck = make_model(tmp_path / "m")
    for t, needle in (("q4_k", "no quantizer for Q4_K"), ("int3", "not a type export writes")):
        r = export(ck, "-o", tmp_path / "x.gguf", "--type", t)
        assert r.exit_code == 2
        assert_one_line_error(r.stderr, needle)
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("overrides,needle", [
    (dict(expand=3), "only an expansion factor of 2"),
    (dict(expand=1), "only an expansion factor of 2"),
    (dict(use_bias=True), "use_bias"),
], ids=["expand3", "expand1", "use_bias"])
def test_what_llama_cpp_cannot_run_is_refused_before_writing(tmp_path, overrides, needle):
    ck = make_model(tmp_path / "m", **overrides)
    out = tmp_path / "m.gguf"
    r = export(ck, "-o", out)
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, needle)
    assert "llama.cpp cannot run this model" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_output_checks(tmp_path):
    ck = make_model(tmp_path / "m")
    before = tree_digest(ck)
    out = tmp_path / "m.gguf"
    assert export(ck, "-o", out).exit_code == 0
    first = out.read_bytes()
    r = export(ck, "-o", out, "-t", "f32")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "exists (use --force")
    assert out.read_bytes() == first
    assert export(ck, "-o", out, "-t", "f32", "--force").exit_code == 0
    assert out.read_bytes() != first
    for bad, needle in ((ck / "model.gguf", "never writes into an input"), (tmp_path, "is a directory"),
                        (tmp_path / "no" / "such" / "x.gguf", "does not exist")):
        r = export(ck, "-o", bad)
        assert r.exit_code == 2, bad
        assert_one_line_error(r.stderr, needle)
    assert tree_digest(ck) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "m.gguf"]


@pytest.mark.parametrize("exc,code", [(MemengineError("disk full (simulated)"), 2), (KeyboardInterrupt(), 130)],
                         ids=["error", "interrupt"])
def test_a_failed_or_interrupted_write_leaves_nothing(tmp_path, monkeypatch, exc, code):
    ck = make_model(tmp_path / "m")
    out = tmp_path / "m.gguf"
    out.write_bytes(b"old")

    def boom(self, *a, **k):
        self.fout[0].write(b"half a file")
        raise exc

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", boom)
    r = export(ck, "-o", out, "--force")
    assert r.exit_code == code
    assert_one_line_error(r.stderr, "simulated" if code == 2 else None)
    assert out.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "m.gguf"]


def make_bpe_tokenizer(path: Path, vocab_size: int) -> Path:
    """A byte-level BPE tokenizer.json (GPT-2 / GPT-NeoX style) trained on a few lines."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["It was the best of times, it was the worst of times, it was the age of wisdom.",
            "The lighthouse keeper counted seventeen ships at dawn and wrote each name down."] * 20
    tok.train_from_iterator(text, trainer)
    tok.save(str(path))
    return path


def test_tokenizer_json_becomes_the_converters_gpt2_vocabulary(tmp_path):
    ck = make_model(tmp_path / "m", vocab_size=300)
    make_bpe_tokenizer(ck / "tokenizer.json", 290)
    out = tmp_path / "m.gguf"
    r = export(ck, "-o", out, "-t", "f16")
    assert r.exit_code == 0, r.stderr
    fields, tensors = read(out)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ck / "tokenizer.json"))
    vocab = tok.get_vocab(with_added_tokens=True)
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "gpt-2"
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == 300  # one per embedding row
    for t, i in vocab.items():
        assert tokens[i] == t
    eot = vocab["<|endoftext|>"]
    assert types[eot] == gguf.TokenType.CONTROL
    assert tokens[299] == "[PAD299]" and types[299] == gguf.TokenType.UNUSED
    merges = json.loads((ck / "tokenizer.json").read_text())["model"]["merges"]
    assert len(fields["tokenizer.ggml.merges"]) == len(merges) > 0
    assert "mamba.vocab_size" not in fields


def test_tokenizers_llama_cpp_cannot_take_are_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    ck = make_model(tmp_path / "m")
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(ck / "tokenizer.json"))
    r = export(ck, "-o", tmp_path / "m.gguf")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "byte-level BPE")
    make_bpe_tokenizer(ck / "tokenizer.json", 300)  # more tokens than the model's 259 rows
    r = export(ck, "-o", tmp_path / "m.gguf")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "embedding rows")
    assert not (tmp_path / "m.gguf").exists()


def make_adapter(base: Path, out: Path, seed: int = 1) -> Path:
    from memengine.engine import lora

    cfg = load_checkpoint(base).config
    spec = lora.LoraSpec(r=2, alpha=3.0, targets=("in_proj", "x_proj"), base=str(base.resolve()))
    rng = np.random.default_rng(seed)
    tensors = {n: (0.1 * rng.standard_normal(s)).astype(np.float32) for n, s in lora.shapes(cfg, spec).items()}
    out.mkdir()
    lora.write_adapter(out, spec, tensors)
    return out


def test_an_adapter_is_merged_into_its_base(tmp_path):
    ck = make_model(tmp_path / "m")
    ad = make_adapter(ck, tmp_path / "ad")
    out = tmp_path / "merged.gguf"
    r = export(ad, "-o", out, "-t", "f32", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["merged_adapter"] == str(ad)
    # the oracle: `memengine merge`, then export the merged checkpoint
    assert run("merge", ad, "-o", tmp_path / "merged").exit_code == 0
    assert export(tmp_path / "merged", "-o", tmp_path / "ref.gguf", "-t", "f32").exit_code == 0
    _, got = read(out)
    _, ref = read(tmp_path / "ref.gguf")
    base = load_checkpoint(ck).tensors
    assert set(got) == set(ref)
    for name in got:
        np.testing.assert_array_equal(tensor_f32(got[name]), tensor_f32(ref[name]), err_msg=name)
    assert not np.array_equal(tensor_f32(got["blk.0.ssm_in.weight"]), base["backbone.layers.0.mixer.in_proj.weight"])
    r = export(ad, "-o", ad / "x.gguf")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "never writes into an input")


def test_without_the_gguf_package_one_line_says_how_to_get_it(tmp_path, monkeypatch):
    import sys

    ck = make_model(tmp_path / "m")
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    r = export(ck, "-o", tmp_path / "m.gguf")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "memengine[gguf]")
    assert not (tmp_path / "m.gguf").exists()


# ----------------------------------------------------------------------------- Mamba-2
M2 = dict(model_type="mamba2", vocab_size=272, hidden_size=32, num_heads=8, head_dim=8, n_groups=2, state_size=12,
          num_hidden_layers=2, expand=2, conv_kernel=4, chunk_size=16, tie_word_embeddings=False)


def make_mamba2(path: Path, seed: int = 0, **overrides) -> Path:
    """A Mamba-2 checkpoint of odd shape (G 2, N 12), D, the norms, A and the biases moved."""
    from memengine.engine import models

    cfg = models.config_from_dict({**M2, **overrides}, "test")
    t = models.of(cfg).init_weights(cfg, seed)
    rng = np.random.default_rng(seed + 100)
    for name, a in t.items():
        if name.endswith((".D", "norm.weight", "norm_f.weight", "dt_bias", "bias")):
            t[name] = (a + 0.1 * rng.standard_normal(a.shape)).astype(np.float32)
        elif name.endswith("A_log"):
            t[name] = (a + 0.05 * rng.standard_normal(a.shape)).astype(np.float32)
    save_checkpoint(path, cfg, t, dtype="F32")
    return path


def test_mamba2_export_has_the_converters_names_shapes_and_keys(tmp_path):
    m = make_mamba2(tmp_path / "m")
    r = export(m, "-o", tmp_path / "m.gguf", "--type", "f32")
    assert r.exit_code == 0, r.stderr
    fields, tensors = read(tmp_path / "m.gguf")
    assert fields["general.architecture"] == "mamba2"
    assert fields["mamba2.ssm.time_step_rank"] == 8 and fields["mamba2.ssm.group_count"] == 2
    assert fields["mamba2.ssm.inner_size"] == 64 and fields["mamba2.ssm.state_size"] == 12
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MAMBA2, 2)
    c = load_checkpoint(m)
    for hf, a in c.tensors.items():
        key = hf.replace(".dt_bias", ".dt_proj.bias")   # the converter's own renaming
        want = tmap.get_name(key, try_suffixes=(".weight", ".bias"))
        assert want in tensors, (hf, want)
    a_log = c.tensors["backbone.layers.1.mixer.A_log"]
    assert np.array_equal(tensor_f32(tensors["blk.1.ssm_a"]).reshape(-1), -np.exp(a_log))
    assert tensor_f32(tensors["blk.0.ssm_norm.weight"]).shape == (2, 32)


@pytest.mark.parametrize("overrides,needle", [(dict(expand=3, num_heads=12), "expand 2"),
                                              (dict(use_bias=True), "use_bias")])
def test_what_llama_cpp_cannot_run_of_mamba2_is_refused(tmp_path, overrides, needle):
    m = make_mamba2(tmp_path / "m", **overrides)
    r = export(m, "-o", tmp_path / "m.gguf")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, needle)
    assert not (tmp_path / "m.gguf").exists()
