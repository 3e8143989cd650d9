import numpy as np
import pytest
from memengine.engine.errors import MemengineError
from memengine.engine.io.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


def test_byte_tokenizer_roundtrip():
    t = load_tokenizer(None)
    assert isinstance(t, ByteTokenizer) and t.vocab_size == 256 and t.name == "bytes"
    s = "Mamba ✓ naïve 🐍\n"
    ids = t.encode(s)
    assert ids.dtype == np.int32
    assert ids.tolist() == list(s.encode("utf-8"))
    assert t.decode(ids) == s
    assert t.decode(np.array([104, 105, 1000])) == "hi"  # beyond the byte range: dropped


def _write_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "mamba": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return tok


def test_tokenizer_json_beside_checkpoint(tmp_path):
    ref = _write_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "model.safetensors").write_bytes(b"")
    for where in (tmp_path, tmp_path / "model.safetensors"):
        t = load_tokenizer(where)
        assert isinstance(t, HFTokenizer) and t.vocab_size == 4
        ids = t.encode("hello mamba zebra world")
        assert ids.dtype == np.int32
        assert ids.tolist() == ref.encode("hello mamba zebra world").ids == [1, 3, 0, 2]
        assert t.decode(ids[:2]) == ref.decode([1, 3])


def test_override(tmp_path):
    _write_tokenizer(tmp_path / "tokenizer.json")
    other = tmp_path / "ckpt"
    other.mkdir()
    assert isinstance(load_tokenizer(other), ByteTokenizer)
    assert isinstance(load_tokenizer(other, str(tmp_path / "tokenizer.json")), HFTokenizer)
    assert isinstance(load_tokenizer(other, str(tmp_path)), HFTokenizer)
    assert isinstance(load_tokenizer(tmp_path, "bytes"), ByteTokenizer)
    with pytest.raises(MemengineError, match="--tokenizer.*missing.json"):
        load_tokenizer(other, str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(MemengineError, match="bad.json"):
        load_tokenizer(None, str(bad))
