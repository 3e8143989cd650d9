"""Curves to look at (issue 30, item 3): loss.png in OUT and in each checkpoint, `memengine
plot` of one or several runs, and --report-to tensorboard's event files."""

from __future__ import annotations

import json
import struct

import pytest
from conftest import SAMPLE_TEXT
from test_cli import assert_one_line_error, run

PIL = pytest.importorskip("PIL.Image")
pytest.importorskip("matplotlib")

TRAIN = ("--seq-len", "32", "--batch-size", "2", "--log-every", "1", "--val-fraction", "0.2", "--eval-every", "2")


@pytest.fixture
def text(tmp_path):
    p = tmp_path / "text.txt"
    p.write_text(SAMPLE_TEXT * 3)
    return p


def png_size(path) -> tuple:
    with PIL.open(path) as im:
        assert im.format == "PNG"
        im.load()   # the whole image decodes
        return im.size


def test_loss_png_in_out_and_in_each_checkpoint(tiny_ckpt_ro, text, tmp_path):
    from memengine.engine.app.curves import SIZE

    out = tmp_path / "out"
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", out, *TRAIN, "--max-steps", "4", "--save-every", "2")
    assert r.exit_code == 0, r.stderr
    assert png_size(out / "loss.png") == SIZE
    assert png_size(out / "checkpoints" / "step-2" / "loss.png") == SIZE


def test_plot_draws_one_or_several_runs(tiny_ckpt_ro, text, tmp_path):
    from memengine.engine.app.curves import SIZE

    for name, lr in (("a", "1e-3"), ("b", "1e-2")):
        r = run("train", tiny_ckpt_ro, "--data", text, "-o", tmp_path / name, *TRAIN, "--max-steps", "4", "--lr", lr)
        assert r.exit_code == 0, r.stderr
    (tmp_path / "a" / "loss.png").unlink()
    r = run("plot", tmp_path / "a")
    assert r.exit_code == 0, r.stderr
    assert png_size(tmp_path / "a" / "loss.png") == SIZE
    r = run("plot", tmp_path / "a", tmp_path / "b", "-o", tmp_path / "both.png")
    assert r.exit_code == 0, r.stderr
    assert png_size(tmp_path / "both.png") == SIZE
    r = run("plot", tmp_path)
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "not a memengine run")


def _events(path):
    """The scalar values of a TensorBoard event file (TFRecord framing, Event protos)."""
    from tensorboardX.proto import event_pb2

    out = {}
    data = path.read_bytes()
    i = 0
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i:i + 8])
        ev = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
        i += 12 + n + 4
        for v in ev.summary.value:
            out.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return out


def test_report_to_tensorboard_writes_event_files(tiny_ckpt_ro, text, tmp_path):
    pytest.importorskip("tensorboardX")
    out = tmp_path / "out"
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", out, *TRAIN, "--max-steps", "4", "--report-to",
            "tensorboard", "--json")
    assert r.exit_code == 0, r.stderr
    files = list((out / "runs").glob("*/events.out.tfevents.*"))
    assert len(files) == 1
    scalars = _events(files[0])
    steps = [e for e in map(json.loads, r.stdout.splitlines()) if e["event"] == "step"]
    assert [s for s, _ in scalars["train/loss"]] == [e["step"] for e in steps] == [1, 2, 3, 4]
    assert [round(v, 4) for _, v in scalars["train/loss"]] == [round(e["loss"], 4) for e in steps]
    assert "train/learning_rate" in scalars and "train/grad_norm" in scalars and "eval/loss" in scalars
    assert (out / "model.safetensors").is_file()
