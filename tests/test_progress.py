"""Progress and time left (issue 30, item 6): the ETA of the run and of the epoch and tokens/s
in the training status (the bar, and the line a log gets every 30 s), and a line for every
operation outside the loop that runs longer than ~2 s (tokenizing, loading, init, quantize)."""

from __future__ import annotations

import io
import time

from conftest import SAMPLE_TEXT
from memengine.engine.listener import Plan, Progress, Task, TaskMeter
from test_cli import run


def _ui():
    from memengine.cli.ui import UI

    err = io.StringIO()
    return UI(stderr=err, progress_interval=0.2), err


def test_the_status_line_has_tokens_per_second_and_both_etas():
    ui, err = _ui()
    view = ui.run_view()
    view.on_start(Plan(title="t", total_steps=100, steps_per_epoch=40, epochs=3, first_step=10, windows=4))
    view.on_progress(Progress(step=30, total_steps=100, epoch=1, step_in_epoch=30, steps_per_epoch=40, lr=1e-4,
                              last_loss=2.5, tokens=40_000, elapsed_s=10.0))
    # 20 steps in 10 s: 10 left in the epoch (5 s), 70 in the run (35 s); 4,000 tokens/s
    assert "4,000 tokens/s" in view.status and "ETA epoch 5s, run 35s" in view.status
    time.sleep(0.6)   # the progress-line timer of a log (every progress_interval without output)
    view.close()
    assert "4,000 tokens/s" in err.getvalue() and "ETA epoch 5s, run 35s" in err.getvalue()


def test_an_operation_over_two_seconds_gets_a_line_and_a_closing_line(monkeypatch):
    from memengine.cli import ui as cli_ui

    monkeypatch.setattr(cli_ui.TaskView, "SHOW_AFTER", 0.2)
    ui, err = _ui()
    with TaskMeter(ui.on_task, "initialising big", None):
        time.sleep(0.5)
    out = err.getvalue()
    assert "initialising big ..." in out and "initialising big: in" in out
    ui2, err2 = _ui()
    with TaskMeter(ui2.on_task, "quick", None):
        pass
    assert err2.getvalue() == ""
    ui3, err3 = _ui()
    ui3.on_task(Task("tokenizing d.txt", 50e6, 200e6, "bytes", elapsed_s=5.0))
    time.sleep(0.4)
    ui3.on_task(Task("tokenizing d.txt", 100e6, 200e6, "bytes", elapsed_s=10.0))
    assert "tokenizing d.txt  100.0 MB of 200.0 MB (50%), 10.0 MB/s, ETA 10s" in err3.getvalue()


def test_tokenizing_quantize_and_init_report_progress(tiny_ckpt_ro, tmp_path, monkeypatch):
    from memengine.engine.listener import Listener

    monkeypatch.setenv("MEMENGINE_CACHE_DIR", str(tmp_path / "cache"))   # tokenized here, not reused
    seen = []
    monkeypatch.setattr(Listener, "on_task", lambda self, t: seen.append(t))
    from memengine.cli.ui import UI

    monkeypatch.setattr(UI, "on_task", lambda self, t: seen.append(t))
    data = tmp_path / "d.txt"
    data.write_text(SAMPLE_TEXT)
    assert run("eval", tiny_ckpt_ro, "--data", data, "--seq-len", "16").exit_code == 0
    assert run("quantize", tiny_ckpt_ro, "-o", tmp_path / "q").exit_code == 0
    assert run("init", "tiny", "-o", tmp_path / "i").exit_code == 0
    names = {t.name.split(" ")[0] for t in seen if t.finished}
    assert {"hashing", "tokenizing", "loading", "converting", "initialising", "writing"} <= names, names
    done = [t.name for t in seen if t.finished]
    assert f"reading {tiny_ckpt_ro}" in done                # eval's checkpoint read (a bf16 130m: ~2 s)
    assert "writing the F16 checkpoint" in done              # quantize's write (a 130m: ~4 s)
    seen.clear()
    assert run("generate", tiny_ckpt_ro, "-p", "the", "-n", "2").exit_code == 0
    done = [t.name for t in seen if t.finished]
    assert f"reading {tiny_ckpt_ro}" in done and f"loading {tiny_ckpt_ro} onto the GPU" in done, done


def test_a_late_line_gives_the_rate_of_now_not_of_the_first_report(monkeypatch):
    """The line a log gets after SHOW_AFTER seconds ages the last report to now: one tensor of
    242 done after 0.3 s is 3 tensors/s, not the thousands of the instant the first began."""
    from memengine.cli import ui as cli_ui

    monkeypatch.setattr(cli_ui.TaskView, "SHOW_AFTER", 0.3)
    ui, err = _ui()
    ui.on_task(Task("converting", 1, 242, "tensors", elapsed_s=0.0003))
    time.sleep(0.6)
    line = next(ln for ln in err.getvalue().splitlines() if "converting" in ln)
    rate = float(line.split("), ")[1].split(" tensors/s")[0])
    assert rate < 10, line


def test_an_evaluation_gets_a_line_with_its_eta_once_it_runs_a_while(monkeypatch):
    """eval (not a terminal): its first progress line comes once the pass has run SHOW_AFTER
    seconds (it came 30 s in, with neither ETA nor rate), with the pass's ETA."""
    from memengine.cli import ui as cli_ui

    monkeypatch.setattr(cli_ui.TaskView, "SHOW_AFTER", 0.2)
    err = io.StringIO()
    ui = cli_ui.UI(stderr=err, progress_interval=60)   # no heartbeat line meanwhile
    view = ui.run_view()
    view.on_eval_progress("m", 1, 10)
    assert err.getvalue() == ""
    time.sleep(0.3)
    view.on_eval_progress("m", 2, 10)
    view.on_eval_progress("m", 3, 10)
    view.close()
    lines = [ln for ln in err.getvalue().splitlines() if "evaluating (m)" in ln]
    assert lines[0].strip().startswith("evaluating (m) 2/10, ETA "), lines
    assert len(lines) == 1, lines
