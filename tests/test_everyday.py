"""Everyday use: resuming the way people resume (the command that was run, plus --resume)."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import SAMPLE_TEXT
from test_cli import COMMANDS, assert_one_line_error, run

TRAIN = ("--seq-len", "32", "--batch-size", "4", "--save-every", "2")


@pytest.fixture
def text(tmp_path):
    p = tmp_path / "text.txt"
    p.write_text(SAMPLE_TEXT * 2)
    return p


def _steps(stdout: str) -> list:
    return [e["step"] for e in map(json.loads, stdout.splitlines()) if e.get("event") == "step"]


def test_the_command_that_was_run_plus_resume_continues(tiny_ckpt_ro, text, tmp_path):
    out = tmp_path / "out"
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", out, *TRAIN, "--max-steps", "2")
    assert r.exit_code == 0, r.stderr
    # as HF Trainer users resume: the same command, CKPT included, plus --resume (a step or OUT)
    for resume, until, first in ((out / "checkpoints" / "step-2", 4, 3), (out, 6, 5)):
        r = run("train", tiny_ckpt_ro, "--data", text, "-o", out, *TRAIN, "--max-steps", str(until),
                "--log-every", "1", "--resume", resume, "--json")
        assert r.exit_code == 0, r.stderr
        assert _steps(r.stdout)[0] == first


def test_another_checkpoint_beside_resume_is_refused_naming_both(tiny_ckpt_ro, text, tmp_path):
    out = tmp_path / "out"
    assert run("train", tiny_ckpt_ro, "--data", text, "-o", out, *TRAIN, "--max-steps", "2").exit_code == 0
    other = tmp_path / "other"
    shutil.copytree(tiny_ckpt_ro, other)
    r = run("train", other, "--data", text, "--resume", out, *TRAIN, "--max-steps", "4")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "started from")
    assert str(other) in r.stderr and tiny_ckpt_ro.name in r.stderr


def test_running_the_command_again_names_resume(tiny_ckpt_ro, text, tmp_path):
    out = tmp_path / "out"
    assert run("train", tiny_ckpt_ro, "--data", text, "-o", out, *TRAIN, "--max-steps", "2").exit_code == 0
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", out, *TRAIN, "--max-steps", "4")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, f"--resume {out}")


# ----------------------------------------------------------------------------- small things
def test_memengine_alone_prints_the_help_and_no_error():
    from test_cli import run_proc

    r = run_proc()
    assert r.returncode == 0
    assert "Usage: memengine" in r.stdout and "error:" not in r.stderr


def test_a_user_error_is_one_line_without_the_traceback_hint(tmp_path):
    r = run("eval", tmp_path / "nothing-here", "--data", tmp_path / "d.txt")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "not found")
    assert "MEMENGINE_DEBUG" not in r.stderr


def test_info_on_a_device_that_is_not_there_exits_2_as_eval_does(tiny_ckpt_ro, text):
    r = run("info", tiny_ckpt_ro, "--device", "no-such-device")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "no-such-device")
    r = run("eval", tiny_ckpt_ro, "--data", text, "--device", "no-such-device")
    assert r.exit_code == 2


def test_verbose_shows_no_xdg_runtime_dir_lines(tiny_ckpt_ro, tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("XDG_RUNTIME_DIR", "MEMENGINE_DEBUG")}
    r = subprocess.run([sys.executable, "-m", "memengine.cli.main", "info", str(tiny_ckpt_ro), "-v"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "XDG_RUNTIME_DIR" not in r.stderr


def test_the_demo_says_where_its_checkpoints_went():
    r = run("demo", "--epochs", "1", "--chars", "512")
    assert r.exit_code == 0, r.stderr
    assert "--workdir DIR keeps them" in r.stderr


def test_a_resumed_run_keeps_the_first_segments_finished_time(tiny_ckpt_ro, text, tmp_path):
    out = tmp_path / "out"
    assert run("train", tiny_ckpt_ro, "--data", text, "-o", out, *TRAIN, "--max-steps", "2").exit_code == 0
    first = json.loads((out / "memengine.json").read_text())["segments"][0]["finished"]
    assert first is not None
    r = run("train", "--resume", out, "--max-steps", "4")
    assert r.exit_code == 0, r.stderr
    segs = json.loads((out / "memengine.json").read_text())["segments"]
    assert len(segs) == 2 and segs[0]["finished"] == first and segs[1]["finished"] is not None


def test_generate_says_when_byte_level_text_leaves_ids_out(tmp_path):
    """A model whose vocabulary is larger than the byte tokenizer's 256 ids may generate ids
    that have no text: said once, not dropped in silence."""
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"vocab_size": 4000, "hidden_size": 16, "state_size": 4, "num_hidden_layers": 1}))
    assert run("init", cfg, "-o", tmp_path / "m", "--seed", "0").exit_code == 0
    r = run("generate", tmp_path / "m", "-p", "ab", "-n", "30", "-t", "1.5", "--seed", "1", "--json")
    assert r.exit_code == 0, r.stderr
    tokens = json.loads(r.stdout.splitlines()[-1])["tokens"]
    n = sum(t >= 256 for t in tokens)
    assert n > 0   # 94% of this vocabulary is beyond the bytes
    warns = [ln for ln in r.stderr.splitlines() if "beyond the byte-level" in ln]
    assert len(warns) == 1 and f"{n} of the 30" in warns[0]


@pytest.mark.parametrize("cmd", ["init", "info", "eval", "train", "adapt", "merge", "quantize", "generate", "export",
                                 "demo"])
def test_every_command_takes_version(cmd):
    r = run(cmd, "--version")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.startswith("memengine ")


def test_devices_lists_the_adapters_and_the_one_auto_takes():
    r = run("devices", "--json")
    assert r.exit_code == 0, r.stderr
    found = json.loads(r.stdout)["devices"]
    assert found and sum(d["auto"] for d in found) == 1
    assert all(d["limits"]["max-storage-buffer-binding-size"] > 0 for d in found)
    from memengine.engine.runtime import get_runtime

    rt = get_runtime()
    auto = next(d for d in found if d["auto"])
    assert auto["name"] == rt.adapter_name


def test_dry_run_shows_the_plan_and_writes_nothing(tiny_ckpt_ro, text, tmp_path):
    out = tmp_path / "out"
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", out, *TRAIN, "--max-steps", "3", "--dry-run", "--json")
    assert r.exit_code == 0, r.stderr
    (d,) = [json.loads(ln) for ln in r.stdout.splitlines()]
    assert d["event"] == "dry_run" and not out.exists()
    assert d["steps"]["total"] == 3 and d["checkpoints"]["every"] == 2 and d["memory"]["ok"]
    # the steps and the plan are the real run's
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", out, *TRAIN, "--max-steps", "3", "--json")
    assert r.exit_code == 0, r.stderr
    summary = [e for e in map(json.loads, r.stdout.splitlines()) if e.get("event") == "summary"][0]
    assert summary["steps"] == 3
    # a run that cannot fit is refused by the dry run as by the run itself
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", tmp_path / "o2", *TRAIN, "--dry-run",
            env={"MEMENGINE_MAX_MEMORY_BYTES": "64K"})
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "needs")
    r = run("adapt", tiny_ckpt_ro, "--data", text, "-o", tmp_path / "o3", "--seq-len", "32", "--dry-run")
    assert r.exit_code == 0, r.stderr
    assert not (tmp_path / "o3").exists()


def test_results_go_to_stdout_and_progress_to_stderr(tiny_ckpt_ro, text, tmp_path):
    r = run("info", tiny_ckpt_ro)
    assert r.exit_code == 0 and "parameters" in r.stdout and "parameters" not in r.stderr
    r = run("eval", tiny_ckpt_ro, "--data", text, "--seq-len", "32")
    assert r.exit_code == 0 and "perplexity" in r.stdout
    r = run("quantize", tiny_ckpt_ro, "-o", tmp_path / "q")
    assert r.exit_code == 0 and "max error" in r.stdout and "wrote" in r.stderr
    r = run("info", tiny_ckpt_ro, "--json")   # --json: stdout is the JSON alone
    assert r.exit_code == 0 and json.loads(r.stdout)["parameters"] > 0


def test_the_example_training_config_runs(tiny_ckpt_ro, text, tmp_path):
    from pathlib import Path

    cfg = Path(__file__).resolve().parent.parent / "configs" / "training" / "lora-cosine.yaml"
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", tmp_path / "out", "--config", cfg, "--seq-len", "32",
            "--max-steps", "3", "--json")
    assert r.exit_code == 0, r.stderr
    summary = [e for e in map(json.loads, r.stdout.splitlines()) if e.get("event") == "summary"][0]
    assert summary["steps"] == 3 and (tmp_path / "out" / "adapter_config.json").is_file()


def test_out_holds_a_model_card(tiny_ckpt_ro, text, tmp_path):
    out = tmp_path / "out"
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", out, *TRAIN, "--max-steps", "2", "--json")
    assert r.exit_code == 0, r.stderr
    card = (out / "README.md").read_text()
    rec = json.loads((out / "memengine.json").read_text())
    assert card.startswith("---\nbase_model: ") and "library_name: transformers" in card
    assert tiny_ckpt_ro.name in card and text.name in card
    assert rec["result"]["final_loss"] is not None and f"{rec['result']['final_loss']:.6g}" in card
    ad = tmp_path / "ad"
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", ad, *TRAIN, "--max-steps", "2", "--lora-rank", "4")
    assert r.exit_code == 0, r.stderr
    card = (ad / "README.md").read_text()
    assert "library_name: peft" in card and "r 4, alpha 4" in card
    from memengine.engine.lora import read_adapter

    assert read_adapter(ad).spec.r == 4   # the card does not disturb PEFT's files


def test_shell_completion():
    import os
    import subprocess
    import sys

    from test_cli import run_proc

    r = run_proc("--help")   # (--show-completion detects the calling shell: not this test's)
    assert r.returncode == 0 and "--install-completion" in r.stdout
    env = dict(os.environ, _MEMENGINE_COMPLETE="complete_bash", COMP_WORDS="memengine tr", COMP_CWORD="1")
    r = subprocess.run([sys.executable, "-m", "memengine.cli.main"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert "train" in r.stdout.split()


def test_quantize_table_fits_80_columns_with_the_layer_numbers(tiny_ckpt_ro, tmp_path):
    """quantize's table (on stdout) fits 80 columns: names as layer.name (the prefix every
    layer shares left out, the layer number kept), sizes in KiB/MiB, errors to 3 digits."""
    from memengine.cli.main import short_tensor_name

    assert short_tensor_name("backbone.layers.23.mixer.out_proj.weight") == "23.out_proj.weight"
    assert short_tensor_name("backbone.embeddings.weight") == "embeddings.weight"
    assert short_tensor_name("lm_head.weight") == "lm_head.weight"
    r = run("quantize", tiny_ckpt_ro, "-o", tmp_path / "q", "--dtype", "f16")
    assert r.exit_code == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()][1:]   # (the title, which wraps, names paths)
    assert len(lines) > 10 and max(len(ln) for ln in lines) <= 80, max(lines, key=len)
    names = [ln.split()[0] for ln in lines if ln.lstrip()[:1].isdigit()]
    assert names and len(set(names)) == len(names) and "0" in {n.split(".")[0] for n in names}


def _help_examples(cmd: str) -> list[str]:
    r = run(cmd, "--help", env={"COLUMNS": "80", "TERM": "dumb"})
    assert r.exit_code == 0
    lines = r.stdout.splitlines()
    assert max(len(ln) for ln in lines) <= 80, max(lines, key=len)
    return [ln.strip() for ln in lines[next(i for i, ln in enumerate(lines) if ln.strip() == "Examples") + 1:]
            if ln.strip()]


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help_examples_never_wrap_mid_command_at_80_columns(cmd):
    """At 80 columns every example line is a command (`$ ...`), a comment above one (`# ...`),
    or the continuation of a line ending in a shell backslash: copied, it runs as shown."""
    from memengine.cli import main as cli_main

    ex = _help_examples(cmd)
    assert ex and ex[0].startswith(("$ ", "# ")), ex
    for before, line in zip(ex, ex[1:]):
        assert line.startswith(("$ ", "# ")) or before.endswith(" \\"), (before, line)
    # long ones were cut only before an option, keeping every word
    joined = " ".join(ln[:-2] if ln.endswith(" \\") else ln for ln in ex)
    long = "memengine train model --data book.txt --val-fraction 0.05 -o out --save-every 200"
    if cmd == "train":
        assert long in " ".join(joined.split())
    assert cli_main._example_lines("a " * 60)[0].endswith("a " * 37 + "a")   # no option: never cut


def test_train_help_groups_its_options_in_panels():
    """train --help: the options in named panels (data, output, training, ...), the catch-all
    'Options' panel holding only --version and --help."""
    r = run("train", "--help", env={"COLUMNS": "80", "TERM": "dumb"})
    panels, cur = {}, None
    for ln in r.stdout.splitlines():
        if ln.startswith("╭─ "):
            cur = ln.strip("╭─╮ ").split(" ─")[0].strip()
            panels[cur] = []
        elif cur and ln.startswith("│ --"):
            panels[cur].append(ln.split()[1])
    assert {"Data", "Output", "Training", "Checkpoints", "LoRA", "Evaluation", "Schedule"} <= set(panels), panels
    assert panels["Options"] == ["--version", "--help"], panels["Options"]
    assert "--lora-rank" in panels["LoRA"] and "--data" in panels["Data"] and "--save-every" in panels["Checkpoints"]


def _on_an_80_column_terminal(*args) -> list[str]:
    """Every line a command draws on an 80x50 terminal (a pty), redraws included: escape
    sequences taken out, cut at newlines and carriage returns."""
    import fcntl
    import os
    import pty
    import re
    import struct
    import sys
    import termios

    from test_safety import child_env

    env = {**child_env(), "COLUMNS": "80", "LINES": "50", "TERM": "xterm"}
    pid, fd = pty.fork()
    if pid == 0:   # pragma: no cover - the child
        os.execvpe(sys.executable, [sys.executable, "-m", "memengine.cli", *map(str, args)], env)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 80, 0, 0))
    raw = b""
    while True:
        try:
            piece = os.read(fd, 1 << 16)
        except OSError:
            break
        if not piece:
            break
        raw += piece
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, raw.decode(errors="replace")[-2000:]
    text = re.sub(r"\x1b\][^\x07]*\x07|\x1b\[[0-9;?]*[A-Za-z]", "", raw.decode(errors="replace"))
    return [p.rstrip() for ln in text.split("\n") for p in ln.split("\r") if p.strip()]


def test_tables_and_the_live_line_fit_an_80_column_terminal(tiny_ckpt_ro, tmp_path, text):
    """Issue 30, item 7: on an 80-column terminal info's report and plan, eval --compare's
    table, devices' table and train's live status fit without a line longer than 80, and the
    live line is not cut with an ellipsis (it was '14/… 0:00…')."""
    more = tmp_path / "more.txt"
    more.write_text(SAMPLE_TEXT * 60)   # steps for a few seconds: the live line is drawn
    for args in (("info", tiny_ckpt_ro), ("eval", tiny_ckpt_ro, "--compare", tiny_ckpt_ro, "--data", text,
                                          "--seq-len", "32"), ("devices",),
                 ("train", tiny_ckpt_ro, "--data", more, "-o", tmp_path / "o", "--seq-len", "64", "--max-steps", "120")):
        lines = _on_an_80_column_terminal(*args)
        assert lines and max(len(ln) for ln in lines) <= 80, (args[0], max(lines, key=len))
        if args[0] == "train":
            live = [ln for ln in lines if ln.lstrip().startswith("step ")]
            assert live and not any("…" in ln for ln in live), live
        if args[0] == "info":
            assert any(ln.split()[:1] == ["parameters"] for ln in lines) and any("fits" in ln for ln in lines)
