"""`memengine train` and `memengine adapt` end to end on a tiny model (lavapipe-friendly)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from test_cli import assert_one_line_error, run, tree_digest

FAST = ["--seq-len", "64", "--batch-size", "2"]


def json_lines(stdout: str) -> list[dict]:
    lines = stdout.splitlines()
    assert lines, "no JSON on stdout"
    return [json.loads(ln) for ln in lines]  # every line must parse: stdout is pure JSON


@pytest.fixture(scope="module")
def trained(tmp_path_factory, _tiny_master):
    """Train the tiny model once (3 epochs) and share the result."""
    root = tmp_path_factory.mktemp("trained")
    txt = root / "text.txt"
    from conftest import SAMPLE_TEXT

    txt.write_text(SAMPLE_TEXT * 3)
    before = tree_digest(_tiny_master)
    out = root / "out"
    r = run("train", _tiny_master, "--data", txt, "-o", out, "--epochs", "3", "--lr", "3e-3", *FAST, "--json")
    assert tree_digest(_tiny_master) == before, "the input checkpoint was modified"
    return r, out, txt


def test_train_json_and_outputs(trained):
    r, out, _ = trained
    assert r.exit_code == 0, r.stderr
    events = json_lines(r.stdout)
    epochs = [e for e in events if e["event"] == "epoch"]
    assert [e["epoch"] for e in epochs] == [1, 2, 3]
    for e in epochs:
        assert set(e) == {"event", "epoch", "step", "loss", "grad_norm", "tokens", "tokens_per_s", "elapsed_s"}
        assert np.isfinite(e["loss"]) and e["grad_norm"] > 0
    assert events[-1]["event"] == "summary" and events[-1]["output"] == str(out)
    assert events[-1]["final_loss"] == epochs[-1]["loss"]
    assert epochs[-1]["loss"] < epochs[0]["loss"]
    for f in ("model.safetensors", "config.json", "optimizer.safetensors", "memengine.json"):
        assert (out / f).is_file(), f
    rec = json.loads((out / "memengine.json").read_text())
    assert rec["options"]["epochs"] == 3 and rec["options"]["lr"] == 3e-3
    assert rec["memengine_version"] and rec["adapter"]
    assert [e for e in rec["history"] if e["event"] == "epoch"] == epochs
    steps = [e for e in events if e["event"] == "step"]  # --log-every 10 by default
    assert steps and [e["step"] for e in steps] == list(range(10, epochs[-1]["step"] + 1, 10))
    for e in steps:
        assert set(e) == {"event", "step", "epoch", "loss", "grad_norm", "lr", "tokens", "tokens_per_s"}
    opt = load_file(str(out / "optimizer.safetensors"))
    assert any(k.endswith(".exp_avg") for k in opt)
    # the human table went to stderr
    assert "loss" in r.stderr and "grad norm" in r.stderr
    # no temporary directories left beside OUT
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]


def test_train_config_file_and_flag_override(trained, tmp_path):
    _, out, txt = trained
    cfg = tmp_path / "opts.yaml"
    cfg.write_text("epochs: 1\nlr: 0.001\nseq-len: 64\nbatch_size: 2\n")
    r = run("train", out, "--data", txt, "-o", tmp_path / "o", "--config", cfg, "--epochs", "2", "--json")
    assert r.exit_code == 0, r.stderr
    events = json_lines(r.stdout)
    assert [e["epoch"] for e in events if e["event"] == "epoch"] == [1, 2]  # flag beats file
    rec = json.loads((tmp_path / "o" / "memengine.json").read_text())
    assert rec["options"]["epochs"] == 2 and rec["options"]["lr"] == 0.001 and rec["options"]["seq_len"] == 64
    assert "resuming optimizer state" in r.stderr  # trained/ has optimizer.safetensors


def test_adapt_changes_only_x_proj(trained, tmp_path):
    _, base, _ = trained
    note = tmp_path / "note.txt"
    text = "The lighthouse keeper counted seventeen ships at dawn. " * 3
    note.write_text(text)
    steps_per_epoch = -(-(len(text.encode()) - 1) // 64)
    out = tmp_path / "adapted"
    r = run("adapt", base, "--data", note, "-o", out, "--lr", "1e-3", "--epochs", "2", "--seq-len", "64",
            "--weight-decay", "0", "--json")
    assert r.exit_code == 0, r.stderr
    events = json_lines(r.stdout)
    s = events[-1]
    assert s["event"] == "summary" and s["rolled_back"] is False
    for k in ("perplexity_before", "perplexity_after", "grad_norm", "reason", "changed_tensors", "max_abs_delta"):
        assert k in s
    assert s["perplexity_after"] <= s["perplexity_before"] * 1.25
    # trust region 0.05 per step, weight decay 0: at most 0.05 per step over all steps
    assert 0 < s["max_abs_delta"] <= 2 * steps_per_epoch * 0.05 + 1e-6
    a = load_file(str(base / "model.safetensors"))
    b = load_file(str(out / "model.safetensors"))
    assert set(a) == set(b)
    changed = set()
    for name in a:
        same = a[name].tobytes() == b[name].tobytes()
        if ".x_proj." in name:
            if not same:
                changed.add(name)
        else:
            assert same, f"{name} changed"
    assert changed and changed == set(s["changed_tensors"])
    assert (out / "optimizer.safetensors").is_file()


def test_adapt_forced_regression_rolls_back(trained, tmp_path):
    _, base, _ = trained
    note = tmp_path / "note.txt"
    note.write_text("A completely new sentence about quiet harbours and ledgers. " * 2)
    out = tmp_path / "adapted"
    before = tree_digest(base)
    r = run("adapt", base, "--data", note, "-o", out, "--epochs", "1", "--seq-len", "64",
            "--tolerance", "0.5", "--json")
    assert r.exit_code == 3, r.stderr
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    s = json_lines(r.stdout)[-1]
    assert s["event"] == "summary" and s["rolled_back"] is True and s["output"] is None
    assert "perplexity" in s["reason"]
    assert_one_line_error(r.stderr, "rolled back")
    assert tree_digest(base) == before


def test_train_ctrl_c_keeps_a_checkpoint_and_nothing_partial(trained, tmp_path):
    _, base, txt = trained
    out = tmp_path / "o"
    env = dict(os.environ)
    env.pop("MEMENGINE_DEBUG", None)
    p = subprocess.Popen([sys.executable, "-m", "memengine.cli.main", "train", str(base), "--data", str(txt),
                          "-o", str(out), "--epochs", "500", *FAST],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        # wait until training has started (the first epoch line), then interrupt
        deadline = time.time() + 120
        seen = ""
        while time.time() < deadline:
            line = p.stderr.readline()
            seen += line
            if "epoch 1" in line or not line:
                break
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, seen + err
    assert "Traceback" not in err
    # the step in flight finished and its checkpoint is OUT's only content; nothing hidden is left
    steps = [q.name for q in (out / "checkpoints").iterdir()]
    assert len(steps) == 1 and steps[0].startswith("step-") and f"{out}/checkpoints/{steps[0]}" in err
    assert [q.name for q in out.iterdir()] == ["checkpoints"]
    assert not [q for q in tmp_path.iterdir() if q.name.startswith(".")]


def test_demo_fast(tmp_path):
    """The demo end to end on a short slice (the README's main job, scaled down)."""
    wd = tmp_path / "demo"
    r = run("demo", "--workdir", wd, "--chars", "300", "--epochs", "1", "--seq-len", "64")
    assert r.exit_code == 0, r.stderr
    assert r.stdout == ""
    for step in ("1/6", "2/6", "3/6", "4/6", "5/6", "6/6", "perplexity before", "perplexity after", "fp32 vs fp16",
                 'continuations of "The lighthouse keeper"'):
        assert step in r.stderr, step
    for d in ("base", "trained", "model-f16"):
        assert (wd / d / "model.safetensors").is_file(), d
    r = run("demo", "--workdir", wd)
    assert r.exit_code == 2  # non-empty workdir refused without --force


def test_nonfinite_loss_exit_1_writes_nothing(tiny_ckpt_ro, sample_text, tmp_path):
    out = tmp_path / "o"
    r = run("train", tiny_ckpt_ro, "--data", sample_text, "-o", out, "--epochs", "2", "--seq-len", "64",
            "--lr", "1e30", "--max-grad-norm", "0", "--json")
    assert r.exit_code == 1, r.stderr
    assert_one_line_error(r.stderr, "non-finite")
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    for ln in r.stdout.splitlines():  # still pure JSON
        json.loads(ln)


def test_adapt_no_rollback_writes(tiny_ckpt_ro, sample_text, tmp_path):
    out = tmp_path / "o"
    r = run("adapt", tiny_ckpt_ro, "--data", sample_text, "-o", out, "--epochs", "1", "--seq-len", "64",
            "--tolerance", "0.5", "--no-rollback", "--json")
    assert r.exit_code == 0, r.stderr
    s = json_lines(r.stdout)[-1]
    assert s["rolled_back"] is False and "no-rollback" in s["reason"]
    assert (out / "model.safetensors").is_file()


def test_quiet_and_no_adapter(tiny_ckpt_ro, sample_text):
    r = run("eval", tiny_ckpt_ro, "--data", sample_text, "--seq-len", "64", "--quiet")
    assert r.exit_code == 0 and r.stderr == "" and r.stdout == ""
    r = run("eval", tiny_ckpt_ro, "--data", sample_text, "--device", "no-such-adapter-xyz")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "no-such-adapter-xyz")
    r = run("eval", tiny_ckpt_ro, "--data", sample_text, env={"MEMENGINE_DEVICE": "no-such-adapter-xyz"})
    assert r.exit_code == 2


def _word_tokenizer(path: Path, words: list[str]) -> Path:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(sorted(set(words)))}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path))
    return path


def test_tokenizer_override_and_copy(tiny_ckpt_ro, tmp_path):
    text = "the cat sat on the mat and the dog sat on the log " * 4
    tok = _word_tokenizer(tmp_path / "tokenizer.json", text.split())
    data = tmp_path / "d.txt"
    data.write_text(text)
    r = run("eval", tiny_ckpt_ro, "--data", data, "--tokenizer", tok, "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] == len(text.split()) - 1
    out = tmp_path / "o"
    r = run("train", tiny_ckpt_ro, "--data", data, "--tokenizer", tok, "-o", out, "--epochs", "1", "--seq-len", "16")
    assert r.exit_code == 0, r.stderr
    assert (out / "tokenizer.json").read_bytes() == tok.read_bytes()  # travels with the model
    r = run("eval", out, "--data", data, "--json")  # picked up from beside the checkpoint
    assert json.loads(r.stdout)["tokens"] == len(text.split()) - 1
    r = run("eval", tiny_ckpt_ro, "--data", data, "--tokenizer", tmp_path / "nope.json")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "nope.json")


def test_engine_adapt_rollback_writes_nothing(tiny_ckpt_ro, sample_text, tmp_path):
    """engine.run.run_adapt: a forced regression trains, then rolls back (exit status 3,
    nothing written); with rollback off the adapted x_proj tensors are written."""
    from memengine.engine.app.options import AdaptOptions
    from memengine.engine.app.run import run_adapt

    seen = []

    class Seen:
        def __getattr__(self, name):
            return lambda *a: seen.append(a[0]) if name == "on_epoch" else None

    out = tmp_path / "o"
    opts = dict(ckpt=tiny_ckpt_ro, data=[str(sample_text)], output=out, epochs=2, lr=1e-2, seq_len=64,
                tolerance=0.5)
    res = run_adapt(AdaptOptions(**opts), Seen())
    assert res.exit_code == 3 and res.adapt.rolled_back and "perplexity" in res.adapt.reason
    assert len(seen) == 2 and res.adapt.changed_tensors  # it did train before rolling back
    assert all(".x_proj." in n for n in res.adapt.changed_tensors)
    assert res.output is None and not out.exists()
    res2 = run_adapt(AdaptOptions(**opts, rollback=False))
    assert res2.exit_code == 0 and not res2.adapt.rolled_back
    a = load_file(str(tiny_ckpt_ro / "model.safetensors"))
    b = load_file(str(out / "model.safetensors"))
    assert {n for n in a if a[n].tobytes() != b[n].tobytes()} == set(res2.adapt.changed_tensors)
