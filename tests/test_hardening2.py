"""Bad input is one `error:` line and exit 2, never an internal error (exit 1): cases found
by an adversarial run against the README's promises."""

from __future__ import annotations

import json

import pytest
from conftest import SAMPLE_TEXT
from test_cli import assert_one_line_error, run, run_proc


@pytest.fixture
def text(tmp_path):
    p = tmp_path / "text.txt"
    p.write_text(SAMPLE_TEXT)
    return p


@pytest.mark.parametrize("where", ["flag", "config"])
def test_a_negative_seed_is_refused(tiny_ckpt_ro, text, tmp_path, where):
    extra = ["--seed", "-1"] if where == "flag" else ["--config", tmp_path / "c.yaml"]
    (tmp_path / "c.yaml").write_text("seed: -1\n")
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", tmp_path / "o", *extra)
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "seed")


def test_a_config_that_sets_an_option_twice_is_refused(tiny_ckpt_ro, text, tmp_path):
    (tmp_path / "c.yaml").write_text("seq-len: 32\nseq_len: 64\n")
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", tmp_path / "o", "--config", tmp_path / "c.yaml")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "set twice")


def test_a_config_that_is_no_file_says_so(tiny_ckpt_ro, text, tmp_path):
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", tmp_path / "o", "--config", "/dev/zero")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "not a regular file")


def test_a_deeply_nested_generation_config_is_refused(tmp_path):
    """generation_config.json goes through the bounded reader (a tokenizer.json model reads it)."""
    from types import SimpleNamespace

    from memengine.engine.app.generate import eos_token_ids
    from memengine.engine.errors import MemengineError

    (tmp_path / "generation_config.json").write_text('{"a": ' * 100_000 + "1" + "}" * 100_000)
    with pytest.raises(MemengineError, match="generation_config.json: JSON nested"):
        eos_token_ids(SimpleNamespace(name="tokenizer.json"), SimpleNamespace(eos_token_id=0, vocab_size=10),
                      tmp_path)


@pytest.mark.parametrize("alpha", [1e30, 1e308])
def test_an_adapter_whose_alpha_overflows_is_refused(tiny_ckpt_ro, text, tmp_path, alpha):
    ad = tmp_path / "ad"
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", ad, "--seq-len", "32", "--max-steps", "1", "--lora-rank", "2")
    assert r.exit_code == 0, r.stderr
    cfg = json.loads((ad / "adapter_config.json").read_text())
    cfg["lora_alpha"] = alpha
    (ad / "adapter_config.json").write_text(json.dumps(cfg))
    r = run("eval", ad, "--data", text, "--seq-len", "32")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "lora_alpha")
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", tmp_path / "o", "--lora-rank", "2", "--lora-alpha", str(alpha))
    assert r.exit_code == 2


@pytest.mark.parametrize("value", ["abc", "0", "-1", "1.5", "100000"])
def test_matvec_lanes_is_validated(tiny_ckpt_ro, value):
    r = run_proc("generate", tiny_ckpt_ro, "-p", "ab", "-n", "2", env_extra={"MEMENGINE_MATVEC_LANES": value})
    assert r.returncode == 2, r.stderr
    assert_one_line_error(r.stderr, "MEMENGINE_MATVEC_LANES")


def test_demo_workdir_that_is_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("mine")
    r = run("demo", "--workdir", f)
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "not a directory")
    assert f.read_text() == "mine"


def test_adapt_says_fell_when_the_perplexity_fell_but_missed_the_tolerance():
    from memengine.engine.train.adapt import regression

    why = regression(193.0472, 191.9218, 1e-9)
    assert "fell from 193.0472 to 191.9218" in why


@pytest.mark.parametrize("cmd", ["info", "eval", "train"])
def test_a_huge_batch_is_refused_at_once(tiny_ckpt_ro, text, tmp_path, cmd):
    import time

    t0 = time.perf_counter()
    extra = {"info": [], "eval": ["--data", text], "train": ["--data", text, "-o", tmp_path / "o"]}[cmd]
    r = run(cmd, tiny_ckpt_ro, *extra, "--batch-size", str(10**12))
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "--batch-size")
    assert time.perf_counter() - t0 < 30
