"""What is on disk, always (issue 32 section 1, issue 30 item 2): inputs reached through
symlinks are never written, --force replaces only memengine's files, an in-place resume
keeps the user's files, an old OUT stays until a new one holds a complete checkpoint, one
writer per OUT, OUT's files change together, and Ctrl-C keeps the work.

Kills at a precise instant run in a child process that SIGKILLs itself (as in
tests/test_hostile_outputs.py); the parent only looks at what is left."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import SAMPLE_TEXT
from memengine.engine.io import staging
from safetensors.numpy import load_file
from test_cli import assert_one_line_error, run, tree_digest

FAST = ("--seq-len", "32", "--batch-size", "2")


def child_env() -> dict:
    env = dict(os.environ)
    env.pop("MEMENGINE_DEBUG", None)
    return env


def cli(*args) -> list:
    return [sys.executable, "-m", "memengine.cli.main", *[str(a) for a in args]]


@pytest.fixture
def text(tmp_path):
    p = tmp_path / "text.txt"
    p.write_text(SAMPLE_TEXT * 2)
    return p


def hidden(d: Path) -> list:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("."))


def weights(d: Path) -> dict:
    return load_file(str(Path(d) / "model.safetensors"))


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)


def memengine_out(path: Path, tag: str) -> Path:
    """A directory of only what memengine writes, marked `tag` (its README.md)."""
    path.mkdir(parents=True)
    (path / "README.md").write_text(tag)
    (path / "config.json").write_text("{}")
    return path


# ============================================================================ inputs by their real paths
def _hf_snapshot(tmp_path: Path, ckpt: Path) -> tuple[Path, Path]:
    """The Hugging Face cache layout: a snapshot directory of symlinks into blobs/."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snap"
    blobs.mkdir()
    snap.mkdir()
    shutil.copyfile(ckpt / "model.safetensors", blobs / "aaa")
    shutil.copyfile(ckpt / "config.json", blobs / "ccc")
    (snap / "model.safetensors").symlink_to("../blobs/aaa")
    (snap / "config.json").symlink_to("../blobs/ccc")
    return blobs, snap


@pytest.mark.parametrize("cmd", ["train", "quantize", "init-over-config"])
def test_an_input_reached_through_a_symlink_is_never_replaced(tiny_ckpt_ro, text, tmp_path, cmd):
    blobs, snap = _hf_snapshot(tmp_path, tiny_ckpt_ro)
    before = tree_digest(blobs)
    if cmd == "train":
        r = run("train", snap, "--data", text, "-o", blobs, "--force", *FAST, "--max-steps", "1")
    elif cmd == "quantize":
        r = run("quantize", snap, "-o", blobs, "--force")
    else:
        link = tmp_path / "cfg.json"
        link.symlink_to(blobs / "ccc")
        r = run("init", link, "-o", blobs, "--force")
    assert r.exit_code == 2, r.stderr
    assert_one_line_error(r.stderr, "contains")
    assert tree_digest(blobs) == before


def test_quantize_through_a_link_into_out_leaves_the_input_alone(tiny_ckpt_ro, tmp_path):
    """msym/model.safetensors points into victim/: quantize msym -o victim --force once
    turned the input into F16 in place."""
    victim = memengine_out(tmp_path / "victim", "old")
    shutil.copyfile(tiny_ckpt_ro / "model.safetensors", victim / "model.safetensors")
    msym = tmp_path / "msym"
    msym.mkdir()
    (msym / "model.safetensors").symlink_to(victim / "model.safetensors")
    shutil.copyfile(tiny_ckpt_ro / "config.json", msym / "config.json")
    before = tree_digest(victim)
    r = run("quantize", msym, "-o", victim, "--force")
    assert r.exit_code == 2, r.stderr
    assert_one_line_error(r.stderr, "contains the input checkpoint")
    assert tree_digest(victim) == before


def test_export_onto_a_linked_input_file_refused(tiny_ckpt_ro, tmp_path):
    pytest.importorskip("gguf")
    blobs, snap = _hf_snapshot(tmp_path, tiny_ckpt_ro)
    before = tree_digest(blobs)
    r = run("export", snap, "-o", blobs / "aaa", "--force")
    assert r.exit_code == 2, r.stderr
    assert tree_digest(blobs) == before


def test_a_data_file_linked_from_out_refused(tiny_ckpt_ro, tmp_path):
    out = memengine_out(tmp_path / "out", "old")
    (out / "corpus.txt").write_text(SAMPLE_TEXT)
    link = tmp_path / "d.txt"
    link.symlink_to(out / "corpus.txt")
    r = run("train", tiny_ckpt_ro, "--data", link, "-o", out, "--force", *FAST)
    assert r.exit_code == 2
    assert (out / "corpus.txt").read_text() == SAMPLE_TEXT


# ============================================================================ --force: only memengine's files
def test_force_refuses_a_directory_holding_other_files(tiny_ckpt_ro, text, tmp_path):
    out = tmp_path / "thesis"
    out.mkdir()
    (out / "thesis.txt").write_text("years of work")
    (out / "sub").mkdir()
    (out / "sub" / "notes.md").write_text("more")
    (out / ".git").mkdir()
    before = tree_digest(out)
    for args in (("train", tiny_ckpt_ro, "--data", text, "-o", out, "--force", *FAST),
                 ("quantize", tiny_ckpt_ro, "-o", out, "--force"),
                 ("init", "tiny", "-o", out, "--force")):
        r = run(*args)
        assert r.exit_code == 2, r.stderr
        assert_one_line_error(r.stderr, "memengine did not write")
        assert "thesis.txt" in r.stderr and ".git/" in r.stderr
    assert tree_digest(out) == before


def test_force_still_replaces_a_memengine_output(tiny_ckpt_ro, text, tmp_path):
    out = tmp_path / "q"
    assert run("quantize", tiny_ckpt_ro, "-o", out).exit_code == 0
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", out, "--force", *FAST, "--max-steps", "2",
            "--save-every", "1")
    assert r.exit_code == 0, r.stderr
    assert (out / "trainer_state.json").is_file() and (out / "checkpoints" / "step-2").is_dir()
    assert hidden(tmp_path) == []


def test_demo_force_keeps_what_the_demo_did_not_write(tmp_path):
    wd = tmp_path / "wd"
    (wd / "base").mkdir(parents=True)
    (wd / "base" / "thesis.txt").write_text("mine")
    (wd / "trained").mkdir()
    (wd / "trained" / "results.csv").write_text("a,b")
    r = run("demo", "--workdir", wd, "--force")
    assert r.exit_code == 2, r.stderr
    assert_one_line_error(r.stderr, "base/thesis.txt")
    assert (wd / "base" / "thesis.txt").read_text() == "mine"
    assert (wd / "trained" / "results.csv").read_text() == "a,b"


# ============================================================================ an in-place resume
def test_an_in_place_resume_keeps_the_users_files(tiny_ckpt_ro, text, tmp_path):
    out = tmp_path / "out"
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", out, *FAST, "--max-steps", "2", "--save-every", "2")
    assert r.exit_code == 0, r.stderr
    (out / "eval_results.json").write_text('{"mine": 1}')
    shutil.copyfile(out / "model.safetensors", out / "backup.safetensors")
    backup = (out / "backup.safetensors").read_bytes()
    r = run("train", "--resume", out, "--max-steps", "4")
    assert r.exit_code == 0, r.stderr
    assert (out / "eval_results.json").read_text() == '{"mine": 1}'
    assert (out / "backup.safetensors").read_bytes() == backup
    assert json.loads((out / "trainer_state.json").read_text())["step"] == 4
    assert {p.name for p in (out / "checkpoints").iterdir()} == {"step-2", "step-4"}


# ============================================================================ --force --save-every
FIRST_CHECKPOINT_KILL = textwrap.dedent("""
    import os, signal, sys
    import memengine.engine.app.run as run
    which = int(sys.argv[1])
    real = run._Run.write_checkpoint
    calls = {"n": 0}
    def write_checkpoint(self, directory, final):
        calls["n"] += 1
        if calls["n"] == which:
            (directory / "config.json").write_text("{}")   # half a checkpoint
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, directory, final)
    run._Run.write_checkpoint = write_checkpoint
    sys.argv = ["memengine"] + sys.argv[2:]
    from memengine.cli import main
    main()
""")


@pytest.mark.parametrize("which", [1, 2])
def test_force_with_save_every_keeps_the_old_out_until_a_checkpoint_is_complete(tiny_ckpt_ro, text, tmp_path,
                                                                                which):
    out = tmp_path / "out"
    assert run("train", tiny_ckpt_ro, "--data", text, "-o", out, *FAST, "--max-steps", "1").exit_code == 0
    (out / "README.md").write_text("OLD")
    p = subprocess.run([sys.executable, "-c", FIRST_CHECKPOINT_KILL, str(which), "train", tiny_ckpt_ro, "--data",
                        text, "-o", out, "--force", *FAST, "--max-steps", "6", "--save-every", "2"],
                       capture_output=True, text=True, env=child_env(), timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr
    staging.recover(out)
    if which == 1:   # killed while writing the first checkpoint: the old OUT, whole
        assert (out / "README.md").read_text() == "OLD"
        assert (out / "model.safetensors").is_file()
    else:            # killed in the second: the new OUT, its first checkpoint complete and resumable
        assert not (out / "README.md").exists()
        assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-2"]
        r = run("train", "--resume", out, "--max-steps", "4")
        assert r.exit_code == 0, r.stderr
    assert hidden(tmp_path) == []


# ============================================================================ one writer per OUT
HOLD_LOCK = textwrap.dedent("""
    import sys, time
    from memengine.engine.io import staging
    staging.lock_output(sys.argv[1])
    print("locked", flush=True)
    time.sleep(120)
""")


def test_a_second_writer_of_an_out_is_refused_and_a_killed_one_leaves_nothing_stuck(tiny_ckpt_ro, text, tmp_path):
    out = tmp_path / "out"
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", out, *FAST, "--max-steps", "2", "--save-every", "2")
    assert r.exit_code == 0, r.stderr
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out)], stdout=subprocess.PIPE, text=True,
                              env=child_env())
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = tree_digest(out)
        for args in (("train", "--resume", out, "--max-steps", "4"),
                     ("train", tiny_ckpt_ro, "--data", text, "-o", out, "--force", *FAST),
                     ("quantize", tiny_ckpt_ro, "-o", out, "--force")):
            r = run(*args)
            assert r.exit_code == 2, r.stderr
            assert_one_line_error(r.stderr, f"another memengine run (pid {holder.pid}) is writing it")
        assert tree_digest(out) == before
    finally:
        holder.kill()
        holder.wait()
    # the kernel dropped the dead holder's lock: the next run goes ahead and tidies up
    r = run("train", "--resume", out, "--max-steps", "4")
    assert r.exit_code == 0, r.stderr
    assert hidden(tmp_path) == []


def test_an_out_whose_parents_do_not_exist_yet_is_written_and_locked(tiny_ckpt_ro, tmp_path):
    out = tmp_path / "a" / "b" / "q"
    r = run("quantize", tiny_ckpt_ro, "-o", out)
    assert r.exit_code == 0, r.stderr
    assert (out / "model.safetensors").is_file() and hidden(out.parent) == []


def test_a_live_run_is_not_resumed_under_its_feet(tiny_ckpt_ro, text, tmp_path):
    """train --resume OUT while the original run still writes OUT: refused (both once exited 0
    and the original's result was replaced)."""
    out = tmp_path / "live"
    p = subprocess.Popen(cli("train", tiny_ckpt_ro, "--data", text, "-o", out, *FAST, "--epochs", "500",
                             "--save-every", "2"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env=child_env())
    try:
        deadline = time.time() + 120
        while time.time() < deadline and "saved checkpoint" not in p.stderr.readline():
            pass
        r = run("train", "--resume", out, "--max-steps", "100")
        assert r.exit_code == 2, r.stderr
        assert_one_line_error(r.stderr, "another memengine run")
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=120)


# ============================================================================ OUT's files change together
PUBLISH_KILL = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from memengine.engine.io import staging
    out, mode, at = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    if mode == "renames":
        staging.exchange = lambda a, b: False
    calls = {"n": 0}
    real_rename, real_exchange, real_replace = os.rename, staging.exchange, os.replace
    def counted(fn):
        def inner(*a):
            calls["n"] += 1
            if calls["n"] == at:
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*a)
        return inner
    os.rename = counted(real_rename)
    os.replace = counted(real_replace)
    staging.exchange = counted(real_exchange)
    with staging.publish_files(out) as tmp:
        for name in ("model.safetensors", "trainer_state.json", "memengine.json"):
            (tmp / name).write_text("new")
    print("done", flush=True)
""")


def _old_run_dir(path: Path) -> Path:
    path.mkdir()
    for name in ("model.safetensors", "trainer_state.json", "memengine.json", "model-00001-of-00002.safetensors"):
        (path / name).write_text("old")
    (path / "checkpoints" / "step-2").mkdir(parents=True)
    (path / "checkpoints" / "step-2" / "trainer_state.json").write_text("ckpt")
    (path / "eval_results.json").write_text("mine")
    return path


@pytest.mark.parametrize("mode", ["exchange", "renames"])
def test_outs_files_change_together_or_not_at_all(tmp_path, mode):
    if mode == "exchange" and not sys.platform.startswith("linux"):
        pytest.skip("renameat2 is Linux's")
    seen = set()
    for at in range(1, 12):
        case = tmp_path / f"c{at}"
        case.mkdir()
        out = _old_run_dir(case / "out")
        p = subprocess.run([sys.executable, "-c", PUBLISH_KILL, str(out), mode, str(at)], capture_output=True,
                           text=True, env=child_env(), timeout=60)
        assert p.returncode in (0, -signal.SIGKILL), p.stderr
        # at every instant the files memengine writes are all of one step ...
        if out.exists():
            got = {(out / n).read_text() for n in ("model.safetensors", "trainer_state.json", "memengine.json")}
            assert len(got) == 1, (at, got)
        # ... and the next run finishes or undoes the change: one or the other, the user's files kept
        staging.recover(out)
        state = {(out / n).read_text() for n in ("model.safetensors", "trainer_state.json", "memengine.json")}
        assert len(state) == 1, (at, state)
        seen |= state
        assert (out / "eval_results.json").read_text() == "mine"
        assert (out / "checkpoints" / "step-2" / "trainer_state.json").read_text() == "ckpt"
        assert (out / "model-00001-of-00002.safetensors").exists() == (state == {"old"})
        assert hidden(case) == [], (at, hidden(case))
        if p.returncode == 0:
            break
    assert seen == {"old", "new"}


def test_an_in_place_resume_killed_in_its_final_swap_never_mixes_steps(tiny_ckpt_ro, text, tmp_path):
    out = tmp_path / "out"
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", out, *FAST, "--max-steps", "2", "--save-every", "2")
    assert r.exit_code == 0, r.stderr
    child = textwrap.dedent("""
        import os, signal, sys
        from memengine.engine.io import staging
        real = staging._put_in
        def put_in(tmp, out):
            if (tmp / staging.COMMIT_MARK).exists():   # the final commit, its entries moved
                os.kill(os.getpid(), signal.SIGKILL)
            return real(tmp, out)
        staging._put_in = put_in
        sys.argv = ["memengine"] + sys.argv[1:]
        from memengine.cli import main
        main()
    """)
    p = subprocess.run([sys.executable, "-c", child, "train", "--resume", out, "--max-steps", "4"],
                       capture_output=True, text=True, env=child_env(), timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr
    # before anything tidies up, OUT is still step 2 throughout
    assert json.loads((out / "trainer_state.json").read_text())["step"] == 2
    assert load_file(str(out / "optimizer.safetensors"))["__step__"][0] == 2
    # the next run finishes the commit first: step 4 throughout, checkpoints kept
    r = run("train", "--resume", out, "--max-steps", "4")
    assert r.exit_code == 0, r.stderr
    st = json.loads((out / "trainer_state.json").read_text())
    assert st["step"] == 4 and load_file(str(out / "optimizer.safetensors"))["__step__"][0] == 4
    assert json.loads((out / "memengine.json").read_text())["segments"][-1]["last_step"] == 4
    assert same_weights(out, out / "checkpoints" / "step-4")
    assert hidden(tmp_path) == []


# ============================================================================ Ctrl-C keeps the work
def _interrupted_run(tiny_ckpt, text, out: Path, sig, *extra) -> tuple[int, str]:
    p = subprocess.Popen(cli("train", tiny_ckpt, "--data", text, "-o", out, *FAST, "--max-steps", "100000",
                             *extra), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            line = p.stderr.readline()
            if not line or " -> " in line:   # the run's title: training starts
                break
        time.sleep(1.5)
        p.send_signal(sig)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, err


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_the_first_signal_writes_a_resumable_checkpoint(tiny_ckpt_ro, text, tmp_path, sig, code):
    out = tmp_path / "out"
    rc, err = _interrupted_run(tiny_ckpt_ro, text, out, sig)
    assert rc == code, err
    assert_one_line_error(err, "the last checkpoint is")
    assert f"--resume {out}" in err and "nothing was written" not in err
    assert "Ctrl-C again stops at once" in err
    steps = [int(d.name[5:]) for d in (out / "checkpoints").iterdir()]
    assert len(steps) == 1 and f"step-{steps[0]}" in err
    k = steps[0]
    # resumed, it ends exactly where a run never stopped ends
    r = run("train", "--resume", out, "--max-steps", str(k + 3))
    assert r.exit_code == 0, r.stderr
    ref = tmp_path / "ref"
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", ref, *FAST, "--max-steps", str(k + 3))
    assert r.exit_code == 0, r.stderr
    assert same_weights(out, ref)
    assert np.array_equal(load_file(str(out / "optimizer.safetensors"))["__step__"],
                          load_file(str(ref / "optimizer.safetensors"))["__step__"])


SECOND_SIGNAL = textwrap.dedent("""
    import ctypes, os, signal, sys, threading, time
    import memengine.engine.train.trainer as trainer
    sig = getattr(signal, sys.argv[1])
    real = trainer.Trainer.step
    calls = {"n": 0}
    libc = ctypes.CDLL(None)
    def step(self, *a, **k):
        calls["n"] += 1
        if calls["n"] <= 3:
            return real(self, *a, **k)
        os.kill(os.getpid(), sig)
        threading.Timer(0.5, lambda: os.kill(os.getpid(), sig)).start()
        t = time.time()
        while time.time() - t < 60:
            libc.sleep(1)   # native: the step never ends
        raise SystemExit("the second signal did not end the run")
    trainer.Trainer.step = step
    sys.argv = ["memengine"] + sys.argv[2:]
    from memengine.cli import main
    main()
""")


@pytest.mark.parametrize("sig,code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_second_signal_stops_at_once_and_says_what_is_on_disk(tiny_ckpt_ro, text, tmp_path, sig, code):
    out = tmp_path / "out"
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", SECOND_SIGNAL, sig, "train", tiny_ckpt_ro, "--data", text, "-o", out,
                        *FAST, "--max-steps", "50", "--save-every", "2"], capture_output=True, text=True,
                       env=child_env(), timeout=120)
    assert p.returncode == code, p.stderr
    assert time.monotonic() - t0 < 60
    assert_one_line_error(p.stderr, "stopped at once")
    assert f"the last checkpoint is {out}/checkpoints/step-2" in p.stderr, p.stderr
    assert "nothing was written" not in p.stderr
    assert hidden(tmp_path) == [] and hidden(out / "checkpoints") == []


def test_the_plan_line_names_the_checkpoint_policy_and_time_checkpoints_are_written(tiny_ckpt_ro, text, tmp_path):
    out = tmp_path / "out"
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", out, *FAST, "--max-steps", "3", "--dry-run", "--json")
    assert r.exit_code == 0, r.stderr
    plan = json.loads(r.stdout)["checkpoints"]
    assert plan["every_minutes"] == 30 and plan["on_interrupt"]
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", out, *FAST, "--max-steps", "3")
    assert "checkpoints every 30 min (--save-every-minutes), on Ctrl-C/SIGTERM" in r.stderr
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", tmp_path / "o2", *FAST, "--max-steps", "4",
            "--save-every-minutes", "1e-9")
    assert r.exit_code == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "o2" / "checkpoints").iterdir()) == ["step-1", "step-2", "step-3"]
