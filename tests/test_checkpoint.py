import json
import struct

import numpy as np
import pytest
from memengine.engine.errors import MemengineError
from memengine.engine.io.checkpoint import infer_config, load_checkpoint, save_checkpoint
from memengine.engine.io.safetensors_io import read_header, read_safetensors, write_safetensors
from memengine.engine.models.mamba1.config import MambaConfig, expected_shapes
from memengine.engine.models.mamba1.init import init_weights

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _cfg(**kw):
    base = dict(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2)
    return MambaConfig(**{**base, **kw})


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("use_bias", [True, False])
def test_saved_checkpoint_loads_in_transformers(tmp_path, tie, use_bias):
    cfg = _cfg(tie_word_embeddings=tie, use_bias=use_bias, use_conv_bias=not use_bias)
    w = init_weights(cfg, 7)
    out = save_checkpoint(tmp_path / "ck", cfg, w)
    model = transformers.MambaForCausalLM.from_pretrained(out, dtype=torch.float32)
    sd = model.state_dict()
    for k, v in w.items():
        assert np.array_equal(sd[k].numpy(), v), k
    assert set(sd) - set(w) == ({"lm_head.weight"} if tie else set())
    if tie:
        assert torch.equal(model.lm_head.weight, model.backbone.embeddings.weight)
    # and back through our loader
    ck = load_checkpoint(out)
    assert ck.config == cfg
    assert list(ck.tensors) == list(expected_shapes(cfg))
    assert all(np.array_equal(ck.tensors[k], w[k]) for k in w)
    assert set(ck.dtypes.values()) == {"F32"}


@pytest.mark.parametrize("tie", [True, False])
def test_transformers_checkpoint_loads(tmp_path, tie):
    hf_cfg = transformers.MambaConfig(vocab_size=80, hidden_size=32, state_size=4, num_hidden_layers=2,
                                      tie_word_embeddings=tie, use_bias=True)
    torch.manual_seed(0)
    model = transformers.MambaForCausalLM(hf_cfg)
    model.save_pretrained(tmp_path, safe_serialization=True)
    ck = load_checkpoint(tmp_path)
    sd = model.state_dict()
    if tie:
        sd.pop("lm_head.weight")
    assert list(ck.tensors) == list(sd)
    for k, v in sd.items():
        assert np.array_equal(ck.tensors[k], v.numpy()), k
    assert ck.config.hidden_size == 32 and ck.config.tie_word_embeddings == tie
    assert ck.tokenizer_path is None and ck.path == tmp_path


@pytest.mark.parametrize("dtype,tdt", [("F16", "float16"), ("BF16", "bfloat16")])
def test_half_checkpoints_decode_exactly(tmp_path, dtype, tdt):
    hf_cfg = transformers.MambaConfig(vocab_size=50, hidden_size=16, state_size=4, num_hidden_layers=1)
    model = transformers.MambaForCausalLM(hf_cfg).to(getattr(torch, tdt))
    with torch.no_grad():  # include subnormals and signed zeros
        model.backbone.layers[0].mixer.D[:4] = torch.tensor([1e-7, -3e-8, -0.0, 6e-5])
    model.save_pretrained(tmp_path)
    ck = load_checkpoint(tmp_path)
    for k, v in model.state_dict().items():
        if k == "lm_head.weight":
            continue
        ref = v.float().numpy()
        assert np.array_equal(ck.tensors[k].view(np.uint32), ref.view(np.uint32)), k
        assert ck.dtypes[k] == dtype
    # our own F16/BF16 writer agrees with torch's rounding, and transformers loads it
    cfg = ck.config
    w = init_weights(cfg, 1)
    save_checkpoint(tmp_path / "ours", cfg, w, dtype=dtype)
    ours = load_checkpoint(tmp_path / "ours")
    m2 = transformers.MambaForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32)
    for k, v in w.items():
        ref = torch.from_numpy(v).to(getattr(torch, tdt)).float().numpy()
        assert np.array_equal(ours.tensors[k], ref), k
        assert np.array_equal(m2.state_dict()[k].numpy(), ref), k


def test_bare_file_metadata_and_inference(tmp_path):
    cfg = _cfg(use_bias=True, tie_word_embeddings=False, expand=3)
    w = init_weights(cfg, 2)
    save_checkpoint(tmp_path / "ck", cfg, w)
    # bare file with config in __metadata__
    bare = tmp_path / "bare.safetensors"
    bare.write_bytes((tmp_path / "ck" / "model.safetensors").read_bytes())
    ck = load_checkpoint(bare)
    assert ck.config == cfg and ck.path == bare
    # no metadata: inferred from shapes (HF name alias for the embeddings accepted)
    w2 = dict(w)
    w2["backbone.embedding.weight"] = w2.pop("backbone.embeddings.weight")
    write_safetensors(tmp_path / "plain.safetensors", w2)
    ck = load_checkpoint(tmp_path / "plain.safetensors")
    assert ck.config.to_hf_dict() == cfg.to_hf_dict()
    assert np.array_equal(ck.tensors["backbone.embeddings.weight"], w["backbone.embeddings.weight"])
    assert infer_config({k: v.shape for k, v in w.items()}).to_hf_dict() == cfg.to_hf_dict()


def test_tied_head_stored_explicitly(tmp_path):
    cfg = _cfg()
    w = init_weights(cfg, 0)
    (tmp_path / "a").mkdir()
    write_safetensors(tmp_path / "a" / "model.safetensors", {**w, "lm_head.weight": w["backbone.embeddings.weight"]})
    (tmp_path / "a" / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    assert "lm_head.weight" not in load_checkpoint(tmp_path / "a").tensors
    write_safetensors(tmp_path / "a" / "model.safetensors", {**w, "lm_head.weight": w["backbone.embeddings.weight"] + 1})
    with pytest.raises(MemengineError, match="lm_head.weight"):
        load_checkpoint(tmp_path / "a")


def test_extras_tokenizer_optimizer(tmp_path):
    cfg = _cfg()
    tok = tmp_path / "tokenizer.json"
    tok.write_text('{"x": 1}')
    out = save_checkpoint(tmp_path / "ck", cfg, init_weights(cfg, 0), tokenizer_path=tok,
                          extra_files={"optimizer.safetensors": b"abc", "notes.txt": tok}, metadata={"step": "3"})
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "notes.txt",
                                                     "optimizer.safetensors", "tokenizer.json"]
    ck = load_checkpoint(out)
    assert ck.tokenizer_path == out / "tokenizer.json"
    assert ck.extra["optimizer_path"] == out / "optimizer.safetensors"
    assert ck.extra["metadata"]["step"] == "3"
    with pytest.raises(MemengineError, match="plain file name"):
        save_checkpoint(tmp_path / "x", cfg, init_weights(cfg, 0), extra_files={"../evil": b""})


# ----------------------------------------------------------------------- errors
@pytest.fixture
def ck_dir(tmp_path):
    cfg = _cfg()
    return save_checkpoint(tmp_path / "ck", cfg, init_weights(cfg, 0)), cfg


def _rewrite(ck_dir, fn):
    d, cfg = ck_dir
    t, _, _ = read_safetensors(d / "model.safetensors")
    fn(t)
    write_safetensors(d / "model.safetensors", t)
    return d


def test_missing_tensor(ck_dir):
    d = _rewrite(ck_dir, lambda t: t.pop("backbone.layers.1.mixer.x_proj.weight"))
    with pytest.raises(MemengineError, match=r"missing tensor 'backbone.layers.1.mixer.x_proj.weight'"):
        load_checkpoint(d)


def test_misshaped_tensor(ck_dir):
    d = _rewrite(ck_dir, lambda t: t.__setitem__("backbone.layers.0.mixer.D", np.ones(5, np.float32)))
    with pytest.raises(MemengineError, match=r"'backbone.layers.0.mixer.D' has shape \[5\], expected \[32\]"):
        load_checkpoint(d)


def test_unexpected_tensor(ck_dir):
    d = _rewrite(ck_dir, lambda t: t.__setitem__("backbone.layers.0.mixer.extra", np.ones(5, np.float32)))
    with pytest.raises(MemengineError, match="unexpected tensor 'backbone.layers.0.mixer.extra'"):
        load_checkpoint(d)


@pytest.mark.parametrize("val", [np.nan, np.inf])
def test_nonfinite_weight(ck_dir, val):
    def poison(t):
        t["backbone.layers.1.mixer.A_log"][2, 1] = val
    d = _rewrite(ck_dir, poison)
    with pytest.raises(MemengineError, match="backbone.layers.1.mixer.A_log.*non-finite"):
        load_checkpoint(d)


def test_integer_dtype_refused(ck_dir):
    d = _rewrite(ck_dir, lambda t: t.__setitem__("backbone.norm_f.weight", np.ones(16, np.int32)))
    with pytest.raises(MemengineError, match="backbone.norm_f.weight.*I32"):
        load_checkpoint(d)


def test_truncated_file(ck_dir):
    d, _ = ck_dir
    f = d / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(raw[:-10])
    with pytest.raises(MemengineError, match=r"model.safetensors.*tensor '.*'.*truncated"):
        load_checkpoint(d)
    f.write_bytes(raw[:5])
    with pytest.raises(MemengineError, match="model.safetensors"):
        load_checkpoint(d)
    (n,) = struct.unpack("<Q", raw[:8])
    f.write_bytes(raw[: 8 + n // 2])
    with pytest.raises(MemengineError, match="header length.*beyond"):
        load_checkpoint(d)


@pytest.mark.parametrize("content,match", [
    ("{not json", "config.json.*JSON"), ('{"hidden_size": "big"}', "config.json.*hidden_size"),
    ('{"hidden_size": 16, "vocab_size": 64, "num_hidden_layers": 2, "state_size": 8}', "A_log"),
])
def test_bad_config_json(ck_dir, content, match):
    d, _ = ck_dir
    (d / "config.json").write_text(content)
    with pytest.raises(MemengineError, match=match):
        load_checkpoint(d)


def test_missing_files(tmp_path, ck_dir):
    with pytest.raises(MemengineError, match="nowhere"):
        load_checkpoint(tmp_path / "nowhere")
    d, _ = ck_dir
    (d / "config.json").unlink()
    with pytest.raises(MemengineError, match="config.json"):
        load_checkpoint(d)
    (tmp_path / "empty").mkdir()
    with pytest.raises(MemengineError, match="model.safetensors"):
        load_checkpoint(tmp_path / "empty")


def test_save_refuses_bad_tensors(tmp_path):
    cfg = _cfg()
    w = init_weights(cfg, 0)
    w["backbone.norm_f.weight"][0] = np.nan
    with pytest.raises(MemengineError, match="backbone.norm_f.weight"):
        save_checkpoint(tmp_path / "o", cfg, w)
    assert not (tmp_path / "o" / "model.safetensors").exists()
    w = init_weights(cfg, 0)
    del w["backbone.layers.0.mixer.D"]
    with pytest.raises(MemengineError, match="missing tensor 'backbone.layers.0.mixer.D'"):
        save_checkpoint(tmp_path / "o", cfg, w)
    w = init_weights(cfg, 0)
    w["backbone.layers.0.mixer.D"][0] = 1e6
    with pytest.raises(MemengineError, match="backbone.layers.0.mixer.D.*F16"):
        save_checkpoint(tmp_path / "o", cfg, w, dtype="F16")


def test_save_is_atomic(tmp_path, monkeypatch):
    cfg = _cfg()
    w = init_weights(cfg, 0)
    out = save_checkpoint(tmp_path / "ck", cfg, w)
    before = (out / "model.safetensors").read_bytes()
    import memengine.engine.io.safetensors_io as sio

    real = sio.os.replace

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(sio.os, "replace", boom)
    w2 = init_weights(cfg, 1)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(out, cfg, w2)
    monkeypatch.setattr(sio.os, "replace", real)
    assert (out / "model.safetensors").read_bytes() == before  # old file intact
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]  # no temp left
    assert read_header(out / "model.safetensors").metadata["format"] == "pt"
