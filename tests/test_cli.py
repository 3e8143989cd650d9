"""Command-line behaviour: help, happy paths, JSON purity, exit codes, atomic outputs.

In-process tests use typer's CliRunner (stdout and stderr captured separately); exit-code
and stdout-purity checks that must see the real process use subprocess.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import SAMPLE_TEXT, make_checkpoint
from memengine.cli.main import app
from typer.testing import CliRunner

COMMANDS = ["init", "info", "eval", "train", "adapt", "merge", "quantize", "export", "generate", "demo", "devices", "plot"]
EVAL_KEYS = {"loss", "perplexity", "tokens", "bits_per_token", "top1_accuracy", "top5_accuracy"}


def run(*args, input=None, env=None):
    runner = CliRunner()
    return runner.invoke(app, [str(a) for a in args], input=input, env=env, catch_exceptions=False)


def run_proc(*args, input=None, env_extra=None, timeout=300):
    env = dict(os.environ)
    env.pop("MEMENGINE_DEBUG", None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "memengine.cli.main", *[str(a) for a in args]],
                          input=input, capture_output=True, text=True, env=env, timeout=timeout)


def tree_digest(path: Path) -> dict:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def assert_one_line_error(stderr: str, needle: str | None = None):
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert lines, "expected an error line on stderr"
    errs = [ln for ln in lines if ln.startswith("error:")]
    assert len(errs) == 1, stderr
    assert "Traceback" not in stderr, stderr
    if needle is not None:
        assert needle.lower() in errs[0].lower(), errs[0]


# ----------------------------------------------------------------------------- help
@pytest.mark.parametrize("cmd", COMMANDS)
def test_help_shows_examples(cmd):
    r = run(cmd, "--help")
    assert r.exit_code == 0
    assert "Examples" in r.stdout
    assert f"memengine {cmd}" in r.stdout


def test_root_help_and_version():
    r = run("--help")
    assert r.exit_code == 0
    for cmd in COMMANDS:
        assert cmd in r.stdout
    r = run("--version")
    assert r.exit_code == 0 and r.stdout.startswith("memengine ")


def test_bad_flag_is_usage_error_exit_2():
    r = run_proc("eval", "nowhere", "--no-such-flag")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "--no-such-flag" in r.stderr
    assert r.stdout == ""


def test_out_of_range_flag_exit_2(tiny_ckpt_ro, sample_text, tmp_path):
    r = run_proc("train", tiny_ckpt_ro, "--data", sample_text, "-o", tmp_path / "o", "--epochs", "0")
    assert r.returncode == 2
    assert "--epochs" in r.stderr
    assert not (tmp_path / "o").exists()


def test_bad_value_names_the_flag(tiny_ckpt_ro, sample_text, tmp_path):
    r = run("train", tiny_ckpt_ro, "--data", sample_text, "-o", tmp_path / "o", "--beta1", "1.5")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "--beta1")


# ----------------------------------------------------------------------------- init / info
def test_init_and_info(tmp_path):
    out = tmp_path / "m"
    r = run("init", "tiny", "-o", out, "--seed", "1")
    assert r.exit_code == 0, r.stderr
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert r.stdout == ""
    # same seed, same bytes
    out2 = tmp_path / "m2"
    assert run("init", "tiny", "-o", out2, "--seed", "1").exit_code == 0
    assert (out / "model.safetensors").read_bytes() == (out2 / "model.safetensors").read_bytes()
    # no stray temporary directories beside the output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "m2"]

    r = run("info", out, "--json")
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1
    d = json.loads(lines[0])
    assert d["parameters"] > 0 and d["config"]["hidden_size"] == 64
    r = run("info", out)   # the report is the command's result: on stdout (`| grep parameters`)
    assert r.exit_code == 0 and "parameters" in r.stdout


def test_init_refuses_nonempty_out_without_force(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    r = run("init", "tiny", "-o", out)
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "--force")
    assert (out / "keep.txt").read_text() == "precious"
    # --force replaces only what memengine writes: a directory holding the user's file is refused
    r = run("init", "tiny", "-o", out, "--force")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "keep.txt")
    assert (out / "keep.txt").read_text() == "precious"
    (out / "keep.txt").unlink()
    (out / "config.json").write_text("{}")   # an output of memengine's is replaced
    r = run("init", "tiny", "-o", out, "--force")
    assert r.exit_code == 0, r.stderr
    assert (out / "model.safetensors").is_file()


def test_init_unknown_config_exit_2(tmp_path):
    r = run("init", "no-such-shape", "-o", tmp_path / "m")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "no-such-shape")
    assert not (tmp_path / "m").exists()


# ----------------------------------------------------------------------------- eval
def test_eval_json_is_one_object(tiny_ckpt_ro, sample_text):
    r = run("eval", tiny_ckpt_ro, "--data", sample_text, "--seq-len", "64", "--json")
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1
    d = json.loads(lines[0])
    assert set(d) == EVAL_KEYS
    assert np.isfinite(d["loss"]) and abs(d["perplexity"] - np.exp(d["loss"])) < 1e-3 * d["perplexity"]
    assert abs(d["bits_per_token"] - d["loss"] / np.log(2)) < 1e-9
    assert 0 <= d["top1_accuracy"] <= d["top5_accuracy"] <= 1
    assert d["tokens"] == len(SAMPLE_TEXT.encode()) - 1
    # untrained byte model: loss near ln(256)
    assert 4.0 < d["loss"] < 7.0


def test_eval_stdin_subprocess_stdout_pure(tiny_ckpt_ro):
    r = run_proc("eval", tiny_ckpt_ro, "--data", "-", "--seq-len", "32", "--json", input=SAMPLE_TEXT)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1 and set(json.loads(lines[0])) == EVAL_KEYS
    assert "XDG_RUNTIME_DIR" not in r.stderr
    assert "\x1b[" not in r.stderr  # no colour when stderr is not a terminal


# ----------------------------------------------------------------------------- quantize
def test_quantize_f16_and_dry_run(tiny_ckpt_ro, tmp_path):
    before = tree_digest(tiny_ckpt_ro)
    r = run("quantize", tiny_ckpt_ro, "--dry-run", "--json")
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["event"] == "summary" and d["dry_run"] and d["bytes_after"] * 2 == d["bytes_before"]
    out = tmp_path / "q"
    r = run("quantize", tiny_ckpt_ro, "-o", out, "--dtype", "f16")
    assert r.exit_code == 0, r.stderr
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert "max error" in r.stdout   # the report: the command's result, on stdout
    assert tree_digest(tiny_ckpt_ro) == before
    r = run("info", out, "--json")
    assert json.loads(r.stdout)["dtypes"] == {"F16": len(json.loads(r.stdout)["tensors"])}
    r = run("quantize", tiny_ckpt_ro, "-o", tmp_path / "q2", "--dtype", "f8")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "--dtype")


def test_quantize_overflow_refused_unless_saturate(tmp_path):
    from memengine.engine.io.checkpoint import load_checkpoint, save_checkpoint

    src = make_checkpoint(tmp_path / "big")
    c = load_checkpoint(src)
    t = dict(c.tensors)
    t["backbone.norm_f.weight"] = t["backbone.norm_f.weight"].copy()
    t["backbone.norm_f.weight"][0] = 1e6
    save_checkpoint(src, c.config, t, dtype="F32")
    r = run("quantize", src, "-o", tmp_path / "q")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "norm_f")
    assert not (tmp_path / "q").exists()
    r = run("quantize", src, "-o", tmp_path / "q", "--saturate")
    assert r.exit_code == 0, r.stderr


# ----------------------------------------------------------------------------- bad input
def _corrupt(ckpt: Path, kind: str):
    f = ckpt / "model.safetensors"
    raw = f.read_bytes()
    if kind == "garbage":
        f.write_bytes(b"this is not a safetensors file at all" * 4)
    elif kind == "truncated":
        f.write_bytes(raw[: len(raw) - 100])
    elif kind == "header-length":
        f.write_bytes((10**12).to_bytes(8, "little") + raw[8:])
    else:
        from safetensors.numpy import load_file, save_file

        t = load_file(str(f))
        if kind == "missing":
            del t["backbone.layers.0.mixer.x_proj.weight"]
        elif kind == "misshaped":
            t["backbone.layers.0.mixer.D"] = np.zeros((3,), np.float32)
        elif kind == "nan":
            a = t["backbone.layers.0.mixer.dt_proj.weight"].copy()
            a.flat[0] = np.nan
            t["backbone.layers.0.mixer.dt_proj.weight"] = a
        save_file(t, str(f))


@pytest.mark.parametrize("kind,needle", [
    ("garbage", "model.safetensors"),
    ("truncated", "model.safetensors"),
    ("header-length", "model.safetensors"),
    ("missing", "x_proj"),
    ("misshaped", "mixer.D"),
    ("nan", "dt_proj"),
])
def test_bad_checkpoint_exit_2(tiny_ckpt, sample_text, kind, needle):
    _corrupt(tiny_ckpt, kind)
    r = run("eval", tiny_ckpt, "--data", sample_text, "--seq-len", "32")
    assert r.exit_code == 2, (r.exit_code, r.stderr)
    assert_one_line_error(r.stderr, needle)
    assert r.stdout == ""


def test_bad_checkpoint_subprocess_no_traceback(tiny_ckpt):
    _corrupt(tiny_ckpt, "truncated")
    r = run_proc("info", tiny_ckpt, "--json")
    assert r.returncode == 2
    assert r.stdout == ""
    assert_one_line_error(r.stderr, "model.safetensors")
    r = run_proc("info", tiny_ckpt, env_extra={"MEMENGINE_DEBUG": "1"})
    assert r.returncode == 2 and "Traceback" in r.stderr


def test_missing_checkpoint_and_data_exit_2(tiny_ckpt_ro, tmp_path):
    r = run("eval", tmp_path / "nope", "--data", tmp_path / "x.txt")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "nope")
    r = run("eval", tiny_ckpt_ro, "--data", tmp_path / "missing.txt")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "missing.txt")


def test_empty_data_exit_2(tiny_ckpt_ro, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    r = run("eval", tiny_ckpt_ro, "--data", empty)
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "empty.txt")
    r = run("train", tiny_ckpt_ro, "--data", "-", "-o", tmp_path / "o", input="")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr)
    assert not (tmp_path / "o").exists()


def test_token_beyond_vocabulary_exit_2(tmp_path):
    small_vocab = make_checkpoint(tmp_path / "v64", {"vocab_size": 64})
    txt = tmp_path / "t.txt"
    txt.write_text("zzzz zzzz")  # 'z' = 122 >= 64
    r = run("eval", small_vocab, "--data", txt)
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "vocab")


def test_bad_config_file_exit_2(tiny_ckpt_ro, sample_text, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("epochs: 1\nlearning_rate: 3\n")
    r = run("train", tiny_ckpt_ro, "--data", sample_text, "-o", tmp_path / "o", "--config", cfg)
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "learning_rate")


def test_output_equal_to_input_refused(tiny_ckpt, sample_text):
    before = tree_digest(tiny_ckpt)
    r = run("train", tiny_ckpt, "--data", sample_text, "-o", tiny_ckpt, "--force", "--epochs", "1")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "input")
    assert tree_digest(tiny_ckpt) == before


@pytest.mark.parametrize("name", ["info", "eval", "train", "adapt"])
def test_run_command_flags_come_from_the_options_dataclass(name):
    """Each field of the run's options dataclass is a parameter of the command, with the
    dataclass's help and default (nothing restated in the CLI)."""
    import dataclasses

    import typer
    from memengine.engine.app.options import AdaptOptions, EvalOptions, InfoOptions, TrainOptions, spec_of

    cls = {"info": InfoOptions, "eval": EvalOptions, "train": TrainOptions, "adapt": AdaptOptions}[name]
    cmd = typer.main.get_command(app).commands[name]
    params = {p.name: p for p in cmd.params}
    for f in cls.option_fields():
        p = params[f.name]
        want = spec_of(f).help.format(**cls.help_values())
        assert getattr(p, "help", want) == want, f.name
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert p.default == default or (p.default in (None, ()) and default in (None, [])), (f.name, p.default)
    shared = {"json_out", "quiet", "verbose"} | ({"config"} if cls.CONFIG_FILE else set())
    assert set(params) - {f.name for f in cls.option_fields()} == shared
    if name == "adapt":
        assert params["max_delta"].default == 0.05 and params["tolerance"].default == 1.25
