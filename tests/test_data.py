import io
import json

import numpy as np
import pytest
from memengine.engine.errors import MemengineError
from memengine.engine.io.data import Batch, check_vocab, make_batches, make_windows, read_documents, tokenize_documents
from memengine.engine.io.tokenizer import BYTE_EOS, ByteTokenizer


def _ref_windows(ids, L):
    # independent oracle: every position i with a next token is an (input, target) pair,
    # grouped by i // L
    pairs = [(ids[i], ids[i + 1]) for i in range(len(ids) - 1)]
    groups = {}
    for i, p in enumerate(pairs):
        groups.setdefault(i // L, []).append(p)
    return [([a for a, _ in g], [b for _, b in g]) for g in groups.values()]


@pytest.mark.parametrize("n,L", [(2, 4), (5, 4), (8, 4), (9, 4), (10, 4), (11, 3), (1000, 7), (17, 1)])
def test_windows_match_next_token_oracle(n, L):
    ids = np.random.default_rng(n).integers(0, 256, n).astype(np.int32)
    got = make_windows(ids, L)
    ref = _ref_windows(ids.tolist(), L)
    assert [(x.tolist(), y.tolist()) for x, y in got] == ref
    assert all(x.dtype == np.int32 and y.dtype == np.int32 for x, y in got)


def test_partial_final_window_rules():
    ids = np.arange(9)  # 9 tokens, L=4: [0..3]->[1..4], [4..7]->[5..8]; no leftover
    w = make_windows(ids, 4)
    assert len(w) == 2 and w[-1][1].tolist() == [5, 6, 7, 8]
    w = make_windows(np.arange(10), 4)  # leftover tokens 8, 9 -> a 1-target window
    assert len(w) == 3 and w[-1][0].tolist() == [8] and w[-1][1].tolist() == [9]
    with pytest.raises(MemengineError, match="at least 2"):
        make_windows(np.arange(1), 4)
    with pytest.raises(ValueError, match="seq_len"):
        make_windows(np.arange(10), 0)


def test_batches_fixed_shape_and_padding():
    w = make_windows(np.arange(1, 12), 4)  # 11 tokens -> windows of 4, 4, 2 targets
    bs = make_batches(w, 2, 4)
    assert len(bs) == 2
    for b in bs:
        assert isinstance(b, Batch)
        assert b.ids.shape == (2, 4) and b.targets.shape == (2, 4)
        assert b.ids.dtype == np.int32 and b.targets.dtype == np.int32
    assert bs[0].n_targets == 8
    last = bs[1]
    assert last.ids.tolist() == [[9, 10, 0, 0], [0, 0, 0, 0]]
    assert last.targets.tolist() == [[10, 11, -1, -1], [-1, -1, -1, -1]]
    assert last.n_targets == 2 == last.n_tokens
    assert sum(b.n_targets for b in bs) == 10  # every next-token pair counted once
    with pytest.raises(ValueError, match="batch_size"):
        make_batches(w, 0, 4)


def test_read_files_jsonl_stdin(tmp_path):
    a = tmp_path / "a.txt"
    a.write_text("héllo")
    b = tmp_path / "b.txt"
    b.write_text("world\n")
    j = tmp_path / "c.jsonl"
    j.write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two", "id": 3}) + "\n")
    assert read_documents([str(a), str(b)]) == ["héllo", "world\n"]
    assert read_documents([str(j)]) == ["one", "two"]
    assert read_documents(["-"], stdin=io.BytesIO("from stdin ✓".encode())) == ["from stdin ✓"]
    assert read_documents([str(b), "-"], stdin=io.BytesIO(b"x")) == ["world\n", "x"]


def test_documents_are_separated_by_eos():
    """Byte-level: documents joined by 0xFF (never a byte of UTF-8 text), not by newline;
    a tokenizer without an end-of-text token joins them with a newline."""
    tok = ByteTokenizer()
    ids = tokenize_documents(["ab", "c", "dé"], tok)
    assert ids.tolist() == [97, 98, BYTE_EOS, 99, BYTE_EOS, 100, 0xC3, 0xA9]
    assert BYTE_EOS not in tok.encode("any text \u00ff\U0001F40D")  # UTF-8 never holds 0xFF

    class NoEos(ByteTokenizer):
        eos_id = None

    assert tokenize_documents(["ab", "c"], NoEos()).tolist() == [97, 98, 10, 99]


def test_hf_tokenizer_eos(tmp_path):
    from memengine.engine.io.tokenizer import HFTokenizer
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "<|endoftext|>": 3, "</s>": 4}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.save(str(tmp_path / "tokenizer.json"))
    tok = HFTokenizer(tmp_path / "tokenizer.json")
    assert tok.eos_id == 3  # the first of the usual names
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    tok = HFTokenizer(tmp_path / "tokenizer.json")
    assert tok.eos_id == 4  # tokenizer_config.json says which
    assert tokenize_documents(["hello world", "world"], tok).tolist() == [1, 2, 4, 2]


def test_read_text_stdin_default(monkeypatch):
    class FakeStdin:
        buffer = io.BytesIO(b"piped text")

    monkeypatch.setattr("sys.stdin", FakeStdin())
    assert read_documents("-") == ["piped text"]


def test_read_text_errors(tmp_path):
    with pytest.raises(MemengineError, match="nope.txt"):
        read_documents([str(tmp_path / "nope.txt")])
    e = tmp_path / "empty.txt"
    e.write_bytes(b"")
    with pytest.raises(MemengineError, match="empty.txt"):
        read_documents([str(e)])
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok \xff\xfe")
    with pytest.raises(MemengineError, match="bad.txt.*UTF-8"):
        read_documents([str(bad)])
    jl = tmp_path / "d.jsonl"
    jl.write_text('{"text": "a"}\n{"txt": "b"}\n')
    with pytest.raises(MemengineError, match="d.jsonl:2"):
        read_documents([str(jl)])
    jl.write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(MemengineError, match="d.jsonl:2"):
        read_documents([str(jl)])
    with pytest.raises(MemengineError, match="stdin"):
        read_documents(["-"], stdin=io.BytesIO(b""))
    with pytest.raises(MemengineError):
        read_documents([])


def test_check_vocab():
    check_vocab(np.array([0, 5, 255]), 256, "x")
    with pytest.raises(MemengineError, match="train.txt.*token id 300 at position 1"):
        check_vocab(np.array([1, 300, 2]), 256, "train.txt")
    with pytest.raises(MemengineError, match="-1"):
        check_vocab(np.array([-1]), 256, "x")


def test_demo_text_bundled():
    from memengine.engine.io.data import DEMO_TEXT

    raw = DEMO_TEXT.read_bytes()
    assert 20_000 <= len(raw) <= 45_000
    raw.decode("utf-8")
