"""Checkpoints as people download them, through every command: a Falcon-Mamba saved in shards
by transformers, with its tokenizer, tokenizer configs and generation config.

train, adapt, quantize and eval run on it; outputs keep model_type falcon_mamba, are sharded
by --max-shard-size, load in transformers as FalconMambaForCausalLM with the loss memengine
reports, carry the side files (AutoTokenizer gives the same special tokens) and hold no
absolute local path.  A bare .safetensors states its assumption and --model-type settles it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_cli import assert_one_line_error, run

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

WORDS = "the keeper of the light counted ships at dawn and wrote each name in a blue ledger".split()
TEXT = " ".join(WORDS * 2)
SHARD = "6KB"
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "[UNK]"}


def _save_tokenizer(d: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "<pad>": 3, **{w: i + 4 for i, w in enumerate(sorted(set(WORDS)))}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL).save_pretrained(d)
    # the older layout many hub repos have: part of the special tokens only in special_tokens_map.json
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    moved = {k: cfg.pop(k) for k in ("eos_token", "pad_token")}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "special_tokens_map.json").write_text(json.dumps(moved))


@pytest.fixture(scope="module")
def falcon(tmp_path_factory):
    root = tmp_path_factory.mktemp("falcon")
    torch.manual_seed(0)
    cfg = transformers.FalconMambaConfig(vocab_size=40, hidden_size=16, state_size=4, num_hidden_layers=2,
                                         tie_word_embeddings=False, mixer_rms_eps=1e-3)
    m = transformers.FalconMambaForCausalLM(cfg)
    src = root / "falcon"
    m.save_pretrained(src, max_shard_size=SHARD)
    _save_tokenizer(src)
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "max_new_tokens": 7}))
    data = root / "data.txt"
    data.write_text(TEXT)
    return root, src, data


def _hf_loss(path: Path, dtype=torch.float32, **config_overrides) -> float:
    m = transformers.FalconMambaForCausalLM.from_pretrained(path, dtype=dtype, **config_overrides).float().eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = torch.tensor(tok(TEXT, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        logits = m(input_ids=ids[None, :-1]).logits[0]
    return float(torch.nn.functional.cross_entropy(logits, ids[1:]))


def _eval(path, *extra) -> float:
    r = run("eval", path, "--data", DATA[0], "--seq-len", "64", "--json", *extra)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)["loss"]


DATA: list = []


def _check_output(src: Path, out: Path, root: Path) -> None:
    assert json.loads((out / "config.json").read_text())["model_type"] == "falcon_mamba"
    assert (out / "model.safetensors.index.json").is_file() and not (out / "model.safetensors").exists()
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        assert (out / f).read_bytes() == (src / f).read_bytes(), f
    a, b = transformers.AutoTokenizer.from_pretrained(src), transformers.AutoTokenizer.from_pretrained(out)
    assert a.special_tokens_map == b.special_tokens_map == SPECIAL
    assert transformers.GenerationConfig.from_pretrained(out).max_new_tokens == 7
    assert type(transformers.AutoModelForCausalLM.from_pretrained(out)) is transformers.FalconMambaForCausalLM
    for f in out.iterdir():  # no absolute local path in any file we wrote
        assert str(root).encode() not in f.read_bytes(), f


def test_falcon_shards_every_command(falcon):
    root, src, data = falcon
    DATA[:] = [data]
    assert len(list(src.glob("model-*.safetensors"))) > 2
    r = run("info", src, "--json")
    assert r.exit_code == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["model_type"] == "falcon_mamba" and len(info["weight_files"]) > 2
    assert abs(_eval(src) - _hf_loss(src)) < 1e-4 * _hf_loss(src)

    trained = root / "trained"
    r = run("train", src, "--data", data, "-o", trained, "--epochs", "2", "--lr", "1e-2", "--seq-len", "64",
            "--max-shard-size", SHARD)
    assert r.exit_code == 0, r.stderr
    _check_output(src, trained, root)
    rec = json.loads((trained / "memengine.json").read_text())
    assert rec["input"] == "falcon" and rec["data"] == ["data.txt"]  # absolute paths: base names only
    loss = _eval(trained)
    assert abs(loss - _hf_loss(trained)) < 1e-4 * loss
    assert loss < _eval(src)

    adapted = root / "adapted"
    r = run("adapt", trained, "--data", data, "-o", adapted, "--epochs", "1", "--lr", "1e-3", "--seq-len", "64",
            "--no-rollback", "--max-shard-size", SHARD)
    assert r.exit_code == 0, r.stderr
    _check_output(src, adapted, root)
    from memengine.engine.io.checkpoint import load_checkpoint

    before, after = load_checkpoint(trained).tensors, load_checkpoint(adapted).tensors
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert changed and all(".mixer.x_proj." in k for k in changed)
    assert abs(_eval(adapted) - _hf_loss(adapted)) < 1e-4 * _hf_loss(adapted)

    quant = root / "quant"
    r = run("quantize", adapted, "-o", quant, "--dtype", "bf16", "--max-shard-size", "3KB")
    assert r.exit_code == 0, r.stderr
    _check_output(src, quant, root)
    assert transformers.FalconMambaForCausalLM.from_pretrained(quant).dtype == torch.bfloat16
    assert abs(_eval(quant) - _hf_loss(quant, torch.bfloat16)) < 1e-4 * _hf_loss(quant, torch.bfloat16)


def test_bare_file_model_type(falcon, tmp_path):
    """A bare file without config: one warning line naming the assumption; --model-type settles it."""
    root, src, data = falcon
    DATA[:] = [data]
    from memengine.engine.io.checkpoint import load_checkpoint
    from memengine.engine.io.safetensors_io import write_safetensors

    ck = load_checkpoint(src)
    bare = tmp_path / "weights.safetensors"
    write_safetensors(bare, ck.tensors)  # no __metadata__ config
    r = run("eval", bare, "--data", data, "--seq-len", "64", "--tokenizer", src, "--json")
    assert r.exit_code == 0, r.stderr
    warns = [ln for ln in r.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warns) == 1 and "assuming mamba" in warns[0] and "--model-type falcon_mamba" in warns[0]
    true = _hf_loss(src, mixer_rms_eps=1e-6)  # the eps is not in the tensors: a bare file gets the default
    assert abs(json.loads(r.stdout)["loss"] - true) > 1e-4 * true  # computed as plain Mamba: beyond tolerance
    r = run("eval", bare, "--data", data, "--seq-len", "64", "--tokenizer", src, "--json",
            "--model-type", "falcon_mamba")
    assert r.exit_code == 0 and "warning" not in r.stderr, r.stderr
    assert abs(json.loads(r.stdout)["loss"] - true) < 1e-4 * true
    # our outputs carry the config (eps included) in __metadata__: a bare copy needs no flag
    out = tmp_path / "out"
    r = run("quantize", src, "-o", out)
    assert r.exit_code == 0, r.stderr
    meta_only = tmp_path / "meta.safetensors"
    meta_only.write_bytes((out / "model.safetensors").read_bytes())
    ck2 = load_checkpoint(meta_only)
    assert ck2.warnings == [] and ck2.config.is_falcon and ck2.config.mixer_rms_eps == 1e-3
    # a config that says otherwise wins over nothing: asking for the other type is an error
    r = run("eval", src, "--data", data, "--model-type", "mamba")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "falcon_mamba")


@pytest.mark.parametrize("size", ["5GiB", "abc", "0"])
def test_bad_max_shard_size_refused_before_work(tiny_ckpt_ro, sample_text, tmp_path, size):
    r = run("train", tiny_ckpt_ro, "--data", sample_text, "-o", tmp_path / "o", "--max-shard-size", size)
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "--max-shard-size")
    assert not (tmp_path / "o").exists()


def test_init_and_quantize_write_shards(tmp_path):
    out = tmp_path / "m"
    r = run("init", "tiny", "-o", out, "--max-shard-size", "100KB")
    assert r.exit_code == 0, r.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((out / f).stat().st_size <= 100_000 or len(
        [k for k, v in index["weight_map"].items() if v == f]) == 1 for f in files)
    m = transformers.MambaForCausalLM.from_pretrained(out)
    assert m.config.model_type == "mamba"
