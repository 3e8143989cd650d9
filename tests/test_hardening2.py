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


# ----------------------------------------------------------------------------- issue 32, sections 2-4
def test_a_lora_rank_above_full_rank_is_refused_at_once(tiny_ckpt_ro, text, tmp_path):
    import time

    t0 = time.perf_counter()
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", tmp_path / "o", "--lora-rank", "1000000")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "--lora-rank 1000000")
    assert "at most 16" in r.stderr   # in_proj of the tiny test model: min(E 16, 2 Di 64)
    assert time.perf_counter() - t0 < 20 and not (tmp_path / "o").exists()
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", tmp_path / "o", "--lora-rank", "16", "--max-steps", "1",
            "--seq-len", "32")
    assert r.exit_code == 0, r.stderr


@pytest.mark.parametrize("sig,code,word", [("SIGTERM", 143, "terminated (SIGTERM)"), ("SIGINT", 130, "interrupted")])
def test_generate_stopped_by_a_signal_is_one_line_and_its_status(tiny_ckpt_ro, sig, code, word):
    import signal
    import subprocess
    import sys
    import time

    from test_safety import child_env, cli

    p = subprocess.Popen(cli("generate", tiny_ckpt_ro, "-p", "the", "-n", "1000000"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        assert p.stdout.read(1)   # generating
        time.sleep(0.5)
        p.send_signal(getattr(signal, sig))
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == code, err
    assert_one_line_error(err, f"{word} after")
    # one line for the stop (issue 30, item 8): no summary line besides the error
    said = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("adapter:")]
    assert len(said) == 1 and "tokens/s" in said[0], err
    assert sys.platform != "win32"


def test_a_valid_240_character_output_name_works(tiny_ckpt_ro, text, tmp_path):
    out = tmp_path / ("o" * 240)
    r = run("quantize", tiny_ckpt_ro, "-o", out)
    assert r.exit_code == 0, r.stderr
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", out, "--force", "--seq-len", "32", "--max-steps", "2",
            "--save-every", "1")
    assert r.exit_code == 0, r.stderr
    assert (out / "checkpoints" / "step-2").is_dir()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_vocabulary_below_256_with_two_documents_and_the_byte_tokenizer(tmp_path):
    from conftest import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "small-vocab", {"vocab_size": 128})
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("the keeper counted ships. " * 20)
    b.write_text("and wrote each name. " * 20)
    r = run("train", ckpt, "--data", a, "--data", b, "-o", tmp_path / "o", "--seq-len", "32", "--max-steps", "2")
    assert r.exit_code == 0, r.stderr
    r = run("eval", ckpt, "--data", a, "--data", b, "--seq-len", "32")
    assert r.exit_code == 0, r.stderr


def test_train_json_into_head_exits_quietly_and_keeps_its_checkpoint(tiny_ckpt_ro, text, tmp_path):
    """`train ... --json --save-every 2 | head -1`: 141, nothing said, the checkpoint kept."""
    import subprocess
    import sys

    from test_safety import child_env

    out = tmp_path / "o"
    cmd = (f"{sys.executable} -m memengine.cli.main train {tiny_ckpt_ro} --data {text} -o {out} --json "
           f"--seq-len 32 --max-steps 40 --save-every 2 --log-every 3 2>{tmp_path / 'err'} | head -1; "
           "echo ${PIPESTATUS[0]}")
    p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=child_env(), timeout=300)
    first, code = p.stdout.strip().splitlines()
    assert json.loads(first)["event"] in ("step", "checkpoint")
    assert code == "141"
    err = (tmp_path / "err").read_text()
    assert "error" not in err.lower() and "Traceback" not in err
    steps = [d.name for d in (out / "checkpoints").iterdir()]
    assert steps == ["step-2"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []   # no lock file left
    r = run("train", "--resume", out, "--max-steps", "4")   # what it kept is resumable
    assert r.exit_code == 0, r.stderr


def test_the_readme_says_what_a_broken_pipe_leaves():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    row = next(ln for ln in readme.splitlines() if ln.startswith("| 141 |"))
    assert "nothing written" not in row and "checkpoint" in row


EARLY_SIGNAL = """
import os, signal, sys
sys.argv = ["memengine", "info", sys.argv[1]]
import memengine.cli          # the console script's first import: from here on a signal is one line
os.kill(os.getpid(), signal.SIGINT)
import memengine.engine.app.run   # a long import: the signal lands in it
from memengine.cli import main
main()
"""


def test_a_signal_in_the_first_milliseconds_prints_no_traceback(tiny_ckpt_ro):
    import subprocess
    import sys

    from test_safety import child_env

    p = subprocess.run([sys.executable, "-c", EARLY_SIGNAL, str(tiny_ckpt_ro)], capture_output=True, text=True,
                       env=child_env(), timeout=120)
    assert p.returncode == 130, p.stderr
    assert_one_line_error(p.stderr, "interrupted while starting; nothing was written")


@pytest.mark.parametrize("sig,code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_eval_stopped_by_a_signal_says_it_in_one_line(tiny_ckpt_ro, tmp_path, sig, code):
    """Issue 30, item 8: eval interrupted mid-way prints one line (and the signal's status)."""
    import signal
    import subprocess
    import time

    from conftest import SAMPLE_TEXT
    from test_safety import child_env, cli

    data = tmp_path / "big.txt"
    data.write_text(SAMPLE_TEXT * 600)
    p = subprocess.Popen(cli("eval", tiny_ckpt_ro, "--data", data, "--seq-len", "16"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={**child_env(), "MEMENGINE_CACHE_DIR": str(tmp_path)})
    try:
        assert p.stderr.readline().startswith("adapter:")
        time.sleep(3)
        p.send_signal(getattr(signal, sig))
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == code, err
    said = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("  ")]   # not progress lines
    assert len(said) == 1 and said[0].startswith("error: ") and "nothing was written" in said[0], err
    assert out == ""


def test_a_sigint_at_any_early_moment_of_the_real_console_script(tiny_ckpt_ro):
    """Ctrl-C sent to the installed `memengine` console script 0-400 ms after it was started:
    killed by the signal before the interpreter handles it (no output; the shell's 130), or
    exactly one `error:` line and exit 130 once memengine's package is imported. A traceback
    can only come from the interpreter's own start-up before any memengine code (its io and
    site modules, setuptools' editable finder of a development install: README, "Ctrl-C /
    SIGTERM keep the work"), never with a frame of memengine's."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from test_safety import child_env

    script = Path(sys.executable).parent / "memengine"
    if not script.exists():
        pytest.skip("no console script beside the interpreter")
    src = str(Path(__file__).resolve().parents[1])
    outcomes = []
    for delay in (0.0, 0.003, 0.006, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.2, 0.4):
        p = subprocess.Popen([str(script), "info", str(tiny_ckpt_ro)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=child_env())
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
        said = [ln for ln in err.splitlines() if ln.strip()]
        if "Traceback" in err:
            frames = [ln for ln in said if ln.lstrip().startswith("File ")]
            ours = [f for f in frames if f.split('"')[1].startswith((f"{src}/cli/", f"{src}/engine/"))]
            assert ours == [], err   # the interpreter's start, not memengine's code
            kind = "interpreter"
        elif p.returncode == -signal.SIGINT:
            assert said == [], err
            kind = "killed"
        else:
            assert p.returncode in (0, 130), (delay, p.returncode, err)
            if p.returncode == 130:
                assert_one_line_error(err, "interrupted")
                assert [ln for ln in said if not ln.startswith(("adapter:", "memory budget"))] == [
                    next(ln for ln in said if ln.startswith("error:"))], err
            kind = str(p.returncode)
        outcomes.append((delay, kind))
    assert outcomes[-1][1] in ("130", "0"), outcomes   # 400 ms in: memengine's own handling


@pytest.mark.parametrize("var,value", [("MEMENGINE_MATMUL", "bogus"), ("MEMENGINE_SHADER_CHECKS", "maybe"),
                                       ("MEMENGINE_MAX_STREAM_BYTES", "x"), ("MEMENGINE_CACHE_MAX_BYTES", "lots"),
                                       ("MEMENGINE_CACHE_DIR", "FILE")])
def test_every_memengine_variable_is_validated_in_one_line(tiny_ckpt_ro, text, tmp_path, var, value):
    """Issue 32, section 3: a MEMENGINE_* variable the run reads, set to nonsense, is one line
    naming it and exit 2 (MEMENGINE_MATMUL and MEMENGINE_SHADER_CHECKS were taken silently, a
    MEMENGINE_DIST_TIMEOUT that is no number stopped every command with a traceback)."""
    from test_cli import run_proc

    if value == "FILE":
        value = str(text)   # a regular file, not a directory
    r = run_proc("eval", tiny_ckpt_ro, "--data", text, "--seq-len", "32",
                 env_extra={var: value, **({} if var == "MEMENGINE_CACHE_DIR" else
                                            {"MEMENGINE_CACHE_DIR": str(tmp_path / "c")})})
    assert r.returncode == 2, r.stderr
    assert_one_line_error(r.stderr, var)
    if var == "MEMENGINE_CACHE_DIR":
        assert "is a file, not a directory" in r.stderr


def test_the_distributed_timeouts_are_validated_where_they_are_read(tiny_ckpt_ro, text, tmp_path, monkeypatch):
    from memengine.engine.errors import MemengineError
    from memengine.engine.train import distributed
    from test_cli import run_proc

    r = run_proc("info", tiny_ckpt_ro, env_extra={"MEMENGINE_DIST_TIMEOUT": "abc"})   # imported by every command
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    for bad in ("abc", "0", "-3", "nan", "inf"):
        monkeypatch.setenv("MEMENGINE_DIST_TIMEOUT", bad)
        with pytest.raises(MemengineError, match="MEMENGINE_DIST_TIMEOUT"):
            distributed.env_seconds("MEMENGINE_DIST_TIMEOUT", 600)
    monkeypatch.setenv("MEMENGINE_DIST_TIMEOUT", "90")
    assert distributed.env_seconds("MEMENGINE_DIST_TIMEOUT", 600) == 90.0
    monkeypatch.delenv("MEMENGINE_DIST_TIMEOUT")
    assert distributed.env_seconds("MEMENGINE_DIST_TIMEOUT", 600) == 600.0
    r = run_proc("train", tiny_ckpt_ro, "--data", text, "-o", tmp_path / "o", "--nproc-per-node", "2",
                 "--max-steps", "1", "--seq-len", "32", env_extra={"MEMENGINE_DIST_SHUTDOWN_S": "abc"})
    assert r.returncode == 2, r.stderr
    assert_one_line_error(r.stderr, "MEMENGINE_DIST_SHUTDOWN_S")


def test_generate_prompt_from_an_endless_stdin_is_refused_bounded(tiny_ckpt_ro):
    """`generate --prompt - < /dev/zero` read all of it into memory (killed by the kernel at
    23 GB after 100 s here): stdin is read in pieces up to PROMPT_MAX_BYTES, then one line."""
    import subprocess
    import sys
    import time

    from memengine.engine.app.generate import PROMPT_MAX_BYTES
    from test_safety import child_env, cli

    # the command runs under a small Python parent that reports its peak: a child forked from
    # this test process would count this process's own memory in its ru_maxrss (Linux keeps
    # the high-water mark across exec), hundreds of MB late in the suite
    probe = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]).returncode; "
             "sys.stderr.write('maxrss %d\\n' % resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r)")
    t0 = time.monotonic()
    with open("/dev/zero", "rb") as zero:
        p = subprocess.run([sys.executable, "-c", probe, *cli("generate", tiny_ckpt_ro, "--prompt", "-", "-n", "2")],
                           stdin=zero, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=child_env())
    lines = p.stderr.decode().splitlines()
    maxrss_kb = int(lines[-1].split()[1])
    err = "\n".join(lines[:-1]) + "\n"
    assert p.returncode == 2, err
    assert_one_line_error(err, "--prompt -: more than")
    assert time.monotonic() - t0 < 60
    assert maxrss_kb * 1024 < 4 * PROMPT_MAX_BYTES + (400 << 20), maxrss_kb   # not the stream's size
