"""Sharded checkpoints (model.safetensors.index.json): transformers' shards load in memengine
and ours load in transformers, with the same file names and index; the index is validated."""

from __future__ import annotations

import inspect
import json
import shutil

import numpy as np
import pytest
from memengine.engine.errors import MemengineError
from memengine.engine.io.checkpoint import load_checkpoint, save_checkpoint
from memengine.engine.io.safetensors_io import read_safetensors, write_safetensors
from memengine.engine.io.shards import DEFAULT_MAX_SHARD_SIZE, INDEX_FILE, parse_size

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

KW = dict(vocab_size=80, hidden_size=32, state_size=4, num_hidden_layers=2)


def _hf(falcon=False, **kw):
    torch.manual_seed(0)
    if falcon:
        return transformers.FalconMambaForCausalLM(transformers.FalconMambaConfig(**{**KW, **kw}))
    return transformers.MambaForCausalLM(transformers.MambaConfig(**{**KW, **kw}))


def _shard_files(d):
    return sorted(p.name for p in d.iterdir() if p.name.startswith("model"))


def test_default_and_sizes_follow_transformers():
    from huggingface_hub.serialization._base import parse_size_to_int

    default = inspect.signature(transformers.PreTrainedModel.save_pretrained).parameters["max_shard_size"].default
    assert DEFAULT_MAX_SHARD_SIZE == default
    for s in ("5GB", "500MB", "1.5GB", "20kb", " 3 MB ", "2TB"):
        assert parse_size(s) == parse_size_to_int(s), s
    assert parse_size("123456") == parse_size(123456) == 123456
    for bad in ("5GiB", "abc", "", "1.5", "-1MB", "0", 0):
        with pytest.raises(MemengineError, match="--max-shard-size"):
            parse_size(bad)


@pytest.mark.parametrize("falcon,tie", [(False, True), (False, False), (True, True), (True, False)])
def test_transformers_shards_load_and_ours_load_in_transformers(tmp_path, falcon, tie):
    m = _hf(falcon, tie_word_embeddings=tie, use_bias=not tie)
    m.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / INDEX_FILE).is_file() and not (tmp_path / "hf" / "model.safetensors").exists()
    ck = load_checkpoint(tmp_path / "hf")
    assert ck.warnings == [] and ck.config.model_type == ("falcon_mamba" if falcon else "mamba")
    sd = {k: v.numpy() for k, v in m.state_dict().items() if not (tie and k == "lm_head.weight")}
    assert list(ck.tensors) == list(sd)
    assert all(np.array_equal(ck.tensors[k], v) for k, v in sd.items())
    assert len(ck.extra["weight_files"]) > 2
    # the index file itself is accepted too
    assert load_checkpoint(tmp_path / "hf" / INDEX_FILE).config == ck.config

    out = save_checkpoint(tmp_path / "ours", ck.config, ck.tensors, max_shard_size="20KB")
    assert _shard_files(out) == _shard_files(tmp_path / "hf")
    assert json.loads((out / INDEX_FILE).read_text()) == json.loads((tmp_path / "hf" / INDEX_FILE).read_text())
    cls = transformers.FalconMambaForCausalLM if falcon else transformers.MambaForCausalLM
    m2 = cls.from_pretrained(out)
    assert type(m2) is cls
    for k, v in m.state_dict().items():
        assert torch.equal(m2.state_dict()[k], v), k


def test_one_file_when_small_enough_and_stale_files_go(tmp_path):
    m = _hf()
    m.save_pretrained(tmp_path / "hf")  # default limit: one file
    ck = load_checkpoint(tmp_path / "hf")
    out = save_checkpoint(tmp_path / "o", ck.config, ck.tensors, max_shard_size=10_000)
    n = len(_shard_files(out))
    assert n > 3 and "model.safetensors" not in _shard_files(out)
    save_checkpoint(out, ck.config, ck.tensors)  # now fits in one file: the shards and index go
    assert _shard_files(out) == ["model.safetensors"]
    save_checkpoint(out, ck.config, ck.tensors, max_shard_size="30KB")
    assert "model.safetensors" not in _shard_files(out) and len(_shard_files(out)) < n
    assert all(np.array_equal(load_checkpoint(out).tensors[k], v) for k, v in ck.tensors.items())


def test_f16_shards_round_trip(tmp_path):
    ck = load_checkpoint(save_checkpoint(tmp_path / "a", *_cfg_tensors()))
    out = save_checkpoint(tmp_path / "h", ck.config, ck.tensors, dtype="F16", max_shard_size="8KB")
    back = load_checkpoint(out)
    assert set(back.dtypes.values()) == {"F16"}
    for k, v in ck.tensors.items():
        assert np.array_equal(back.tensors[k], v.astype(np.float16).astype(np.float32)), k


def _cfg_tensors():
    m = _hf()
    from memengine.engine.models.mamba1.config import MambaConfig

    sd = {k: v.numpy() for k, v in m.state_dict().items() if k != "lm_head.weight"}
    return MambaConfig.from_dict(m.config.to_dict()), sd


# ----------------------------------------------------------------------- index validation
@pytest.fixture
def sharded(tmp_path):
    cfg, sd = _cfg_tensors()
    d = save_checkpoint(tmp_path / "s", cfg, sd, max_shard_size="20KB")
    return d, json.loads((d / INDEX_FILE).read_text())


def _write_index(d, idx):
    (d / INDEX_FILE).write_text(json.dumps(idx))


def test_index_tensor_in_two_shards(sharded):
    d, idx = sharded
    name = "backbone.norm_f.weight"
    other = next(f for f in sorted(set(idx["weight_map"].values())) if f != idx["weight_map"][name])
    t, _, meta = read_safetensors(d / other)
    write_safetensors(d / other, {**t, name: np.ones(32, np.float32)}, meta)
    with pytest.raises(MemengineError, match=f"{other}.*'{name}' is listed in {INDEX_FILE} under shard"):
        load_checkpoint(d)


def test_index_lists_a_tensor_its_shard_lacks(sharded):
    d, idx = sharded
    idx["weight_map"]["backbone.layers.0.mixer.D"] = next(
        f for f in idx["weight_map"].values() if f != idx["weight_map"]["backbone.layers.0.mixer.D"])
    _write_index(d, idx)
    with pytest.raises(MemengineError, match="'backbone.layers.0.mixer.D'"):
        load_checkpoint(d)


def test_index_unlisted_tensor(sharded):
    d, idx = sharded
    del idx["weight_map"]["backbone.layers.1.norm.weight"]
    _write_index(d, idx)
    with pytest.raises(MemengineError, match="'backbone.layers.1.norm.weight' is not listed"):
        load_checkpoint(d)


def test_index_missing_shard(sharded):
    d, idx = sharded
    (d / "model-00002-of-00005.safetensors").unlink()
    with pytest.raises(MemengineError, match="shard 'model-00002-of-00005.safetensors' is missing"):
        load_checkpoint(d)


@pytest.mark.parametrize("bad", ["../model-00001-of-00005.safetensors", "/etc/passwd", "sub/x.safetensors", "", 3])
def test_index_path_escape_refused(sharded, bad):
    d, idx = sharded
    idx["weight_map"]["backbone.norm_f.weight"] = bad
    _write_index(d, idx)
    with pytest.raises(MemengineError, match="plain file name"):
        load_checkpoint(d)


@pytest.mark.parametrize("content,match", [
    ("{", "not valid JSON"), ("[]", "weight_map"), ('{"weight_map": {}}', "weight_map"),
    ('{"weight_map": {"a": "x", "a": "y"}}', "duplicate"),
])
def test_index_malformed(sharded, content, match):
    d, _ = sharded
    (d / INDEX_FILE).write_text(content)
    with pytest.raises(MemengineError, match=match):
        load_checkpoint(d)


def test_one_shard_alone_is_refused(sharded):
    d, _ = sharded
    with pytest.raises(MemengineError, match="one shard of the sharded checkpoint"):
        load_checkpoint(d / "model-00003-of-00005.safetensors")
    # moved out of its set it is a (partial) bare file: the usual missing-tensor error
    shutil.copy(d / "model-00001-of-00005.safetensors", d.parent / "lone.safetensors")
    with pytest.raises(MemengineError, match="missing tensor|cannot infer"):
        load_checkpoint(d.parent / "lone.safetensors")
