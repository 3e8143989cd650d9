"""Hostile situations around outputs, usage and signals: an OUT that is, contains or lies
inside an input; --force replacements killed at every instant between their renames;
leftovers of killed runs; file modes and fsync; unwritable OUT parents; usage errors;
Ctrl-C / SIGTERM during start-up, twice, and after OUT is complete; optimizer states that
do not fit the model.  (FIFOs and devices as inputs: tests/test_hostile_inputs.py.)

Kills at a precise instant run in a child process that SIGKILLs itself from inside the
rename it is about to make (nothing in the parent is at risk); a native wait the main
thread cannot leave is simulated with libc's sleep through ctypes.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import SAMPLE_TEXT
from memengine.engine.errors import MemengineError
from memengine.engine.io import staging
from safetensors.numpy import load_file, save_file
from test_cli import assert_one_line_error, run, tree_digest

REPO = Path(__file__).resolve().parents[1]
FAST = ["--seq-len", "32", "--batch-size", "2"]


def child_env() -> dict:
    env = dict(os.environ)
    env.pop("MEMENGINE_DEBUG", None)
    return env


def make_out(path: Path, tag: str) -> Path:
    path.mkdir(parents=True)
    (path / "README.md").write_text(tag)
    (path / "checkpoints" / "step-1").mkdir(parents=True)
    (path / "checkpoints" / "step-1" / "config.json").write_text(tag * 3)
    return path


def hidden(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


# ============================================================================ inputs vs OUT
def test_train_force_onto_the_directory_holding_the_data_refused(tiny_ckpt_ro, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    data = out / "notes.txt"
    data.write_text(SAMPLE_TEXT)
    r = run("train", tiny_ckpt_ro, "--data", data, "-o", out, "--force", "--epochs", "1", *FAST)
    assert r.exit_code == 2, r.stderr
    assert_one_line_error(r.stderr, "contains the --data file")
    assert data.read_text() == SAMPLE_TEXT


def test_out_inside_the_input_checkpoint_refused(tiny_ckpt, tmp_path, sample_text):
    before = tree_digest(tiny_ckpt)
    r = run("quantize", tiny_ckpt, "-o", tiny_ckpt / "f16")
    assert r.exit_code == 2, r.stderr
    assert_one_line_error(r.stderr, "lies inside the input checkpoint")
    r = run("train", tiny_ckpt, "--data", sample_text, "-o", tiny_ckpt / "tuned", "--epochs", "1", *FAST)
    assert r.exit_code == 2, r.stderr
    assert_one_line_error(r.stderr, "lies inside the input checkpoint")
    assert tree_digest(tiny_ckpt) == before


def test_out_through_a_symlink_to_the_input_refused(tiny_ckpt, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(tiny_ckpt)
    before = tree_digest(tiny_ckpt)
    r = run("quantize", tiny_ckpt, "-o", link, "--force")
    assert r.exit_code == 2, r.stderr
    assert_one_line_error(r.stderr, "is the input checkpoint")
    assert tree_digest(tiny_ckpt) == before


@pytest.mark.parametrize("which", ["tokenizer", "config", "val-data"])
def test_other_inputs_inside_out_refused(tiny_ckpt_ro, tmp_path, which):
    out = make_out(tmp_path / "out", "old")
    data = tmp_path / "d.txt"
    data.write_text(SAMPLE_TEXT)
    args = ["train", tiny_ckpt_ro, "--data", data, "-o", out, "--force", "--epochs", "1", *FAST]
    if which == "tokenizer":
        from tokenizers import Tokenizer, models, pre_tokenizers

        tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.save(str(out / "tokenizer.json"))
        args += ["--tokenizer", out / "tokenizer.json"]
    elif which == "config":
        (out / "train.yaml").write_text("lr: 0.001\n")
        args += ["--config", out / "train.yaml"]
    else:
        (out / "val.txt").write_text(SAMPLE_TEXT)
        args += ["--val-data", out / "val.txt"]
    before = tree_digest(out)
    r = run(*args)
    assert r.exit_code == 2, r.stderr
    assert_one_line_error(r.stderr, "contains the --")
    assert tree_digest(out) == before


def test_init_config_file_inside_out_refused(tmp_path):
    out = make_out(tmp_path / "out", "old")
    cfg = out / "shape.json"
    cfg.write_text(json.dumps({"vocab_size": 256, "hidden_size": 16, "state_size": 4, "num_hidden_layers": 1}))
    r = run("init", cfg, "-o", out, "--force")
    assert r.exit_code == 2, r.stderr
    assert_one_line_error(r.stderr, "contains the config file")
    assert cfg.is_file()


# ============================================================================ OUT's parent
def test_out_parent_is_a_file(tiny_ckpt_ro, tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    for args in (("init", "tiny", "-o", f / "o"), ("quantize", tiny_ckpt_ro, "-o", f / "deeper" / "o")):
        r = run(*args)
        assert r.exit_code == 2, r.stderr
        assert_one_line_error(r.stderr, "is a file, not a directory")


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES])
def test_out_on_an_unwritable_filesystem(tiny_ckpt_ro, tmp_path, monkeypatch, code):
    real_mkdir = os.mkdir

    def mkdir(path, *a, **k):
        if str(path).startswith(str(tmp_path)):
            raise OSError(code, os.strerror(code), str(path))
        return real_mkdir(path, *a, **k)

    monkeypatch.setattr(os, "mkdir", mkdir)
    for args in (("init", "tiny", "-o", tmp_path / "o"), ("quantize", tiny_ckpt_ro, "-o", tmp_path / "q")):
        r = run(*args)
        assert r.exit_code == 2, r.stderr
        assert_one_line_error(r.stderr, os.strerror(code))
    assert not (tmp_path / "o").exists()


# ============================================================================ --force swaps
KILL_CHILD = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from memengine.engine.io import staging
    out, mode, at = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    if mode == "renames":
        staging.exchange = lambda a, b: False
    calls = {"n": 0}
    real_rename = os.rename
    def rename(a, b):
        calls["n"] += 1
        if at == f"before-rename-{calls['n']}":
            os.kill(os.getpid(), signal.SIGKILL)
        real_rename(a, b)
        if at == f"after-rename-{calls['n']}":
            os.kill(os.getpid(), signal.SIGKILL)
    os.rename = rename
    real_exchange = staging.exchange
    def exchange(a, b):
        ok = real_exchange(a, b)
        if at == "after-exchange":
            os.kill(os.getpid(), signal.SIGKILL)
        return ok
    staging.exchange = exchange
    with staging.staged_output(out, force=True) as tmp:
        (tmp / "README.md").write_text("new")
        (tmp / "checkpoints" / "step-1").mkdir(parents=True)
        (tmp / "checkpoints" / "step-1" / "config.json").write_text("newnewnew")
        if at == "staging":
            os.kill(os.getpid(), signal.SIGKILL)
""")

# (mode, instant): every point a SIGKILL can land between the steps of a replacement
KILL_POINTS = [("exchange", "staging"), ("exchange", "after-exchange"), ("exchange", "before-rename-1"),
               ("exchange", "after-rename-1"),
               ("renames", "staging"), ("renames", "before-rename-1"), ("renames", "after-rename-1"),
               ("renames", "after-rename-2"), ("renames", "before-rename-3"), ("renames", "after-rename-3")]


@pytest.mark.parametrize("mode,at", KILL_POINTS)
def test_force_replacement_killed_at_any_instant_keeps_old_or_new(tmp_path, mode, at):
    if mode == "exchange" and not sys.platform.startswith("linux"):
        pytest.skip("renameat2 is Linux's")
    out = make_out(tmp_path / "out", "old")
    p = subprocess.run([sys.executable, "-c", KILL_CHILD, str(out), mode, at], capture_output=True, text=True,
                       env=child_env(), timeout=60)
    assert p.returncode in (0, -signal.SIGKILL), p.stderr
    # at every instant: the old or the new OUT is at the path, complete ...
    if out.exists():
        got = (out / "README.md").read_text()
        assert got in ("old", "new")
        assert (out / "checkpoints" / "step-1" / "config.json").read_text() == got * 3
        tag = got
    else:  # ... or, between the two renames, the old one is kept complete beside it
        tag = None
        assert mode == "renames" and at in ("after-rename-1", "before-rename-2"), hidden(tmp_path)
    # and the next run recognises the leftovers: cleans them, or puts the old OUT back
    notes = staging.recover(out)
    assert (out / "README.md").read_text() == (tag or "old")
    assert (out / "checkpoints" / "step-1" / "config.json").read_text() == (tag or "old") * 3
    assert hidden(tmp_path) == [], notes
    if tag is None:
        assert any("restored" in n for n in notes)


def test_next_run_cleans_leftovers_and_restores_old_out(tiny_ckpt_ro, tmp_path):
    """A CLI run after a replacement killed between its renames: the old OUT is back, the
    run's own check (not empty, no --force) sees it, and nothing hidden is left."""
    out = tmp_path / "q"
    r = run("quantize", tiny_ckpt_ro, "-o", out)
    assert r.exit_code == 0, r.stderr
    digest = tree_digest(out)
    os.rename(out, tmp_path / ".q.old-999999999-0a1b2c3d")  # a dead pid's old copy
    (tmp_path / ".q.tmp-999999999-deadbeef").mkdir()  # and its half-written staging
    r = run("quantize", tiny_ckpt_ro, "-o", out)
    assert r.exit_code == 2, r.stderr
    assert "restored" in r.stderr
    assert_one_line_error(r.stderr, "not empty")
    assert tree_digest(out) == digest
    assert hidden(tmp_path) == []


def test_a_live_runs_staging_directory_is_not_a_leftover(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tmp_path / f".o.tmp-{sleeper.pid}-00112233"
        live.mkdir()
        dead = tmp_path / ".o.tmp-999999999-00112233"
        dead.mkdir()
        staging.recover(tmp_path / "o")
        assert live.is_dir() and not dead.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_exchange_really_is_atomic_on_linux(tmp_path):
    if not sys.platform.startswith("linux"):
        pytest.skip("renameat2 is Linux's")
    a, b = make_out(tmp_path / "a", "A"), make_out(tmp_path / "b", "B")
    if not staging.exchange(a, b):
        pytest.skip("this filesystem has no RENAME_EXCHANGE")
    assert (a / "README.md").read_text() == "B" and (b / "README.md").read_text() == "A"


# ============================================================================ modes, fsync
@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_outputs_get_the_mode_the_umask_gives(tiny_ckpt_ro, tmp_path, umask):
    old = os.umask(umask)
    try:
        r = run("quantize", tiny_ckpt_ro, "-o", tmp_path / "q")
        assert r.exit_code == 0, r.stderr
    finally:
        os.umask(old)
    q = tmp_path / "q"
    assert stat.S_IMODE(q.stat().st_mode) == 0o777 & ~umask
    files = [p for p in q.rglob("*") if p.is_file()]
    assert files
    for p in files:
        assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~umask, p


def test_every_output_file_and_directory_fsynced_around_the_final_rename(tiny_ckpt_ro, tmp_path, monkeypatch):
    events = []
    fds = {}
    real_open, real_fsync, real_rename = os.open, os.fsync, os.rename
    real_exchange = staging.exchange

    def op(path, flags, *a, **k):
        fd = real_open(path, flags, *a, **k)
        fds[fd] = os.path.abspath(path)
        return fd

    def fsync(fd):
        events.append(("fsync", fds.get(fd, fd)))
        return real_fsync(fd)

    def rename(a, b, *x, **k):
        events.append(("rename", os.path.abspath(a), os.path.abspath(b)))
        return real_rename(a, b, *x, **k)

    def exchange(a, b):
        ok = real_exchange(a, b)
        if ok:
            events.append(("rename", os.path.abspath(a), os.path.abspath(b)))
        return ok

    monkeypatch.setattr(os, "open", op)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(staging, "exchange", exchange)
    out = tmp_path / "q"
    make_out(out, "old")
    r = run("quantize", tiny_ckpt_ro, "-o", out, "--force")
    assert r.exit_code == 0, r.stderr
    final = [i for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(out)]
    assert final, events
    k = final[-1]
    staged = Path(events[k][1])
    synced_before = {e[1] for e in events[:k] if e[0] == "fsync"}
    synced_after = {e[1] for e in events[k:] if e[0] == "fsync"}
    for p in out.rglob("*"):
        assert str(staged / p.relative_to(out)) in synced_before, p  # every file and subdirectory
    assert str(staged) in synced_before  # the OUT directory itself
    assert str(tmp_path) in synced_after  # its parent, after the rename


# ============================================================================ usage errors
@pytest.mark.parametrize("args,needle", [
    (["train", "CKPT", "--data", "D", "-o", "O", "--epochs", "0"], "--epochs"),
    (["train", "CKPT", "--data", "D", "-o", "O", "--lr", "abc"], "--lr"),
    (["train", "CKPT", "--data", "D", "-o", "O", "--config", "DIR"], "--config"),
    (["train", "CKPT", "--bogus"], "--bogus"),
    (["quantize"], "CKPT"),
    (["train", "CKPT", "--seq-len"], "--seq-len"),
    (["eval", "CKPT", "--batch-size", "1.5"], "--batch-size"),
    (["nosuchcommand"], "nosuchcommand"),
])
def test_usage_errors_are_one_line_exit_2(tiny_ckpt_ro, tmp_path, args, needle):
    subst = {"CKPT": str(tiny_ckpt_ro), "D": str(tmp_path / "d.txt"), "O": str(tmp_path / "o"),
             "DIR": str(tmp_path)}
    r = run(*[subst.get(a, a) for a in args])
    assert r.exit_code == 2, r.stderr
    assert_one_line_error(r.stderr, needle)
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "╭" not in r.stderr and "Usage:" not in r.stderr


def test_usage_error_in_a_real_process_is_one_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "memengine.cli", "train", "x", "--lr", "abc"], capture_output=True,
                       text=True, env=child_env(), timeout=120)
    assert p.returncode == 2
    assert p.stderr.startswith("error: ") and len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.parametrize("cmd", ["init", "info", "eval", "train", "adapt", "quantize", "demo"])
def test_help_has_no_bool_noise(cmd):
    r = run(cmd, "--help")
    assert r.exit_code == 0
    assert "<bool>" not in r.stdout
    assert "--force" in r.stdout or cmd in ("info", "eval")


@pytest.mark.parametrize("alias,want", [("fp16", "F16"), ("half", "F16"), ("float16", "F16"), ("F16", "F16"),
                                        ("bf16", "BF16"), ("bfloat16", "BF16"), ("BF16", "BF16")])
def test_quantize_dtype_aliases(tiny_ckpt_ro, tmp_path, alias, want):
    r = run("quantize", tiny_ckpt_ro, "-o", tmp_path / "q", "--dtype", alias)
    assert r.exit_code == 0, r.stderr
    from safetensors import safe_open

    with safe_open(str(tmp_path / "q" / "model.safetensors"), "np") as f:
        dt = {str(f.get_slice(k).get_dtype()) for k in f.keys()}
    assert dt == {want}


@pytest.mark.parametrize("alias", ["fp32", "float", "int8", "f8"])
def test_quantize_dtype_not_a_16_bit_target(tiny_ckpt_ro, tmp_path, alias):
    r = run("quantize", tiny_ckpt_ro, "-o", tmp_path / "q", "--dtype", alias)
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, f"--dtype {alias}")


def test_dtype_aliases_one_table():
    from memengine.engine.io.codec import DTYPE_ALIASES, normalize_dtype

    assert {normalize_dtype(a) for a in ("fp16", "half", "float16")} == {"F16"}
    assert {normalize_dtype(a) for a in ("bf16", "bfloat16")} == {"BF16"}
    assert {normalize_dtype(a) for a in ("fp32", "float32", "float")} == {"F32"}
    assert set(DTYPE_ALIASES.values()) == {"F16", "BF16", "F32"}


# ============================================================================ optimizer state
def _opt_case(case: str, shapes: dict) -> dict:
    name = "backbone.layers.0.mixer.x_proj.weight"
    shp = shapes[name]
    st = {f"{name}.exp_avg": np.zeros(shp, np.float32), f"{name}.exp_avg_sq": np.zeros(shp, np.float32),
          "__step__": np.array([3], np.int64)}
    if case == "unknown":
        st["something.else"] = np.zeros(2, np.float32)
    elif case == "unpaired":
        del st[f"{name}.exp_avg_sq"]
    elif case == "shape":
        st[f"{name}.exp_avg"] = np.zeros((3, 3), np.float32)
        st[f"{name}.exp_avg_sq"] = np.zeros((3, 3), np.float32)
    elif case == "step-empty":
        st["__step__"] = np.zeros(0, np.int64)
    elif case == "step-negative":
        st["__step__"] = np.array([-4], np.int64)
    elif case == "step-nan":
        st["__step__"] = np.array([np.nan], np.float32)
    elif case == "step-fraction":
        st["__step__"] = np.array([2.5], np.float64)
    elif case == "step-missing":
        del st["__step__"]
    elif case == "nan":
        st[f"{name}.exp_avg"][0, 0] = np.nan
    elif case == "inf":
        st[f"{name}.exp_avg_sq"][0, 0] = np.inf
    elif case == "negative":
        st[f"{name}.exp_avg_sq"][0, 0] = -1.0
    elif case == "absent-param":
        st["backbone.layers.7.mixer.x_proj.weight.exp_avg"] = np.zeros(shp, np.float32)
        st["backbone.layers.7.mixer.x_proj.weight.exp_avg_sq"] = np.zeros(shp, np.float32)
    elif case == "float64":
        st[f"{name}.exp_avg"] = st[f"{name}.exp_avg"].astype(np.float64)
    return st


OPT_CASES = {"unknown": "something.else", "unpaired": "x_proj.weight.exp_avg", "shape": "has shape",
             "step-empty": "__step__", "step-negative": "__step__", "step-nan": "__step__",
             "step-fraction": "__step__", "step-missing": "__step__", "nan": "NaN", "inf": "infinite",
             "negative": "negative", "absent-param": "backbone.layers.7", "float64": "float32"}


@pytest.mark.parametrize("case", sorted(OPT_CASES))
def test_optimizer_state_checked_before_use(tiny_ckpt, sample_text, tmp_path, case):
    from memengine.engine.io.checkpoint import load_checkpoint
    from memengine.engine.models.mamba1.config import expected_shapes

    shapes = dict(expected_shapes(load_checkpoint(tiny_ckpt).config))
    save_file(_opt_case(case, shapes), str(tiny_ckpt / "optimizer.safetensors"))
    for kind in ("train", "adapt"):
        r = run(kind, tiny_ckpt, "--data", sample_text, "-o", tmp_path / kind, "--epochs", "1", *FAST)
        assert r.exit_code == 2, (kind, r.stderr)
        assert_one_line_error(r.stderr, OPT_CASES[case])
        assert "optimizer.safetensors" in r.stderr
        assert not (tmp_path / kind).exists()


def test_a_valid_optimizer_state_still_resumes(tiny_ckpt, sample_text, tmp_path):
    from memengine.engine.io.checkpoint import load_checkpoint
    from memengine.engine.models.mamba1.config import expected_shapes

    shapes = dict(expected_shapes(load_checkpoint(tiny_ckpt).config))
    save_file(_opt_case("valid", shapes), str(tiny_ckpt / "optimizer.safetensors"))
    r = run("train", tiny_ckpt, "--data", sample_text, "-o", tmp_path / "o", "--epochs", "1", *FAST)
    assert r.exit_code == 0, r.stderr
    assert "resuming optimizer state" in r.stderr
    st = load_file(str(tmp_path / "o" / "optimizer.safetensors"))
    assert int(st["__step__"][0]) > 3


# ============================================================================ signals
SIGNAL_CHILD = textwrap.dedent("""
    import os, signal, sys, time, importlib.abc
    when, sig = sys.argv[1], getattr(signal, sys.argv[2])
    def hit():
        os.kill(os.getpid(), sig)
        time.sleep(0.5)  # the handler runs here
    if when in ("imports", "exec"):  # while the command line's modules load
        class Hook(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "typer":
                    sys.meta_path.remove(self)
                    if when == "exec":  # inside code run by exec, as dataclasses and typing do
                        exec("hit()", {"hit": hit})
                    hit()
                return None
        sys.meta_path.insert(0, Hook())
    elif when in ("loading", "upload"):
        import memengine.engine.app.setup as setup
        import memengine.engine.runtime as gpu
        if when == "loading":
            real = setup.open_checkpoint
            def open_checkpoint(*a, **k):
                hit()
                return real(*a, **k)
            setup.open_checkpoint = open_checkpoint
            import memengine.engine.app.run as run
            run.open_checkpoint = open_checkpoint
        else:
            real_up = gpu.Runtime.upload
            def upload(self, *a, **k):
                hit()
                return real_up(self, *a, **k)
            gpu.Runtime.upload = upload
    elif when == "twice":  # the main thread stuck in a native wait; two signals
        import ctypes, threading
        import memengine.engine.train.trainer as trainer
        libc = ctypes.CDLL(None)
        def step(self, micro, lr):
            os.kill(os.getpid(), sig)
            threading.Timer(0.5, lambda: os.kill(os.getpid(), sig)).start()
            t = time.time()
            while time.time() - t < 60:
                libc.sleep(1)  # native: Python cannot run its handler inside
            raise SystemExit("the second signal did not end the run")
        trainer.Trainer.step = step
    elif when == "after-out":  # the signal lands once OUT is complete
        import memengine.engine.app.run as run
        real_summary = run.RunResult.summary
        calls = {"n": 0}
        def summary(self):
            calls["n"] += 1
            if calls["n"] == 2:  # the command line's, after run_train wrote OUT
                hit()
            return real_summary(self)
        run.RunResult.summary = summary
    sys.argv = ["memengine"] + sys.argv[3:]
    from memengine.cli import main
    main()
""")


def run_signal_child(when, sig, *args, timeout=120, tmp=None):
    """SIGNAL_CHILD run as `python -m` (how CPython ends depends on how its code was run)."""
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="sigchild-"))
    (root / "sigchild").mkdir()
    (root / "sigchild" / "__main__.py").write_text(SIGNAL_CHILD)
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-m", "sigchild", when, sig, *[str(a) for a in args]],
                           capture_output=True, text=True, env=env, timeout=timeout)
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return p, time.monotonic() - t0


@pytest.mark.parametrize("when", ["imports", "exec", "loading", "upload"])
@pytest.mark.parametrize("sig,code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_signal_during_startup_one_line(tiny_ckpt_ro, sample_text, tmp_path, when, sig, code):
    out = tmp_path / "o"
    p, _ = run_signal_child(when, sig, "train", tiny_ckpt_ro, "--data", sample_text, "-o", out, "--epochs", "1",
                            *FAST)
    assert p.returncode == code, p.stderr
    assert_one_line_error(p.stderr, "nothing was written")
    assert ("terminated (SIGTERM)" in p.stderr) == (sig == "SIGTERM")
    assert not out.exists() and hidden(tmp_path) == []


@pytest.mark.parametrize("sig,code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_second_signal_ends_a_stuck_run_at_once_and_cleanly(tiny_ckpt_ro, sample_text, tmp_path, sig, code):
    out = make_out(tmp_path / "o", "old")
    p, took = run_signal_child("twice", sig, "train", tiny_ckpt_ro, "--data", sample_text, "-o", out, "--force",
                               "--epochs", "1", *FAST)
    assert p.returncode == code, p.stderr
    assert "Traceback" not in p.stderr
    assert_one_line_error(p.stderr, "stopped at once")
    assert took < 30
    assert (out / "README.md").read_text() == "old" and hidden(tmp_path) == []


def test_interrupt_after_out_is_complete_says_so(tiny_ckpt_ro, sample_text, tmp_path):
    out = tmp_path / "o"
    p, _ = run_signal_child("after-out", "SIGINT", "train", tiny_ckpt_ro, "--data", sample_text, "-o", out,
                            "--epochs", "1", *FAST)
    assert p.returncode == 130, p.stderr
    assert_one_line_error(p.stderr, "written completely")
    assert "nothing was written" not in p.stderr
    import transformers

    transformers.MambaForCausalLM.from_pretrained(str(out))


# ============================================================================ a FIFO as --data
def test_fifo_as_data_is_read_like_stdin(tiny_ckpt_ro, tmp_path):
    """A FIFO is what a shell's <(command) gives: read to its end, like stdin (a device or a
    FIFO where a model file belongs is refused: tests/test_hostile_inputs.py)."""
    fifo = tmp_path / "data.txt"
    os.mkfifo(fifo)

    def writer():
        with open(fifo, "w") as f:
            f.write(SAMPLE_TEXT)

    threading.Thread(target=writer, daemon=True).start()
    r = run("eval", tiny_ckpt_ro, "--data", fifo, "--seq-len", "32", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1])["tokens"] > 100
