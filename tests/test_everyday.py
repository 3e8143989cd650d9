"""Everyday use: resuming the way people resume (the command that was run, plus --resume)."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import SAMPLE_TEXT
from test_cli import assert_one_line_error, run

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
