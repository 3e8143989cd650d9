"""Corpora bigger than memory (issue 32, section 2): the data tokenized once into a
memory-mapped token file in the cache, reused by later runs and --resume; stdin and FIFOs
streamed with a size cap and interrupt checks; a run's host memory bounded whatever the
corpus size; the window order of a large corpus computed, not stored."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import SAMPLE_TEXT
from memengine.engine.io import tokens
from memengine.engine.io.tokenizer import ByteTokenizer
from memengine.engine.train import sampler
from test_cli import assert_one_line_error, run


def entries(cache) -> list:
    d = cache / "tokens"
    return sorted(p.name for p in d.iterdir() if not p.name.startswith(".")) if d.is_dir() else []


@pytest.fixture
def cache(tmp_path, monkeypatch):
    c = tmp_path / "cache"
    monkeypatch.setenv("MEMENGINE_CACHE_DIR", str(c))
    return c


def test_the_token_file_is_made_once_and_reused_by_later_runs_and_resume(tiny_ckpt_ro, tmp_path, cache,
                                                                         monkeypatch):
    data = tmp_path / "d.txt"
    data.write_text(SAMPLE_TEXT * 4)
    args = ("--data", data, "--seq-len", "32", "--batch-size", "2", "--save-every", "2")
    assert run("train", tiny_ckpt_ro, "-o", tmp_path / "a", *args, "--max-steps", "2").exit_code == 0
    made = entries(cache)
    assert len(made) == 1
    meta = json.loads((cache / "tokens" / made[0] / "meta.json").read_text())
    assert meta["dtype"] == "uint8" and meta["tokens"] == len((SAMPLE_TEXT * 4).encode())

    def no_tokenizing(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(tokens, "_tokenize", no_tokenizing)
    r = run("train", tiny_ckpt_ro, "-o", tmp_path / "a", *args, "--max-steps", "4", "--resume", tmp_path / "a")
    assert r.exit_code == 0, r.stderr
    assert run("eval", tiny_ckpt_ro, "--data", data, "--seq-len", "32").exit_code == 0
    assert entries(cache) == made
    # other data, or another tokenizer, is another token file
    monkeypatch.undo()
    monkeypatch.setenv("MEMENGINE_CACHE_DIR", str(cache))
    data.write_text(SAMPLE_TEXT * 5)
    assert run("eval", tiny_ckpt_ro, "--data", data, "--seq-len", "32").exit_code == 0
    assert len(entries(cache)) == 2


def test_a_damaged_cache_entry_is_made_again(tmp_path, cache):
    data = tmp_path / "d.txt"
    data.write_text(SAMPLE_TEXT)
    src = tokens.resolve_sources([str(data)])
    tf = tokens.token_file(src, ByteTokenizer(), 256)
    with open(tf.path / "tokens.bin", "r+b") as f:
        f.truncate(10)
    again = tokens.token_file(src, ByteTokenizer(), 256)
    assert not again.reused and again.size == len(SAMPLE_TEXT) and again.sha256 == tf.sha256


def test_stdin_beyond_the_cap_is_one_line_and_bounded(tiny_ckpt_ro, tmp_path, cache):
    env = dict(os.environ, MEMENGINE_MAX_STREAM_BYTES=str(8 << 20))
    env.pop("MEMENGINE_DEBUG", None)
    with open("/dev/zero", "rb") as zero:
        r = subprocess.run([sys.executable, "-m", "memengine.cli.main", "eval", str(tiny_ckpt_ro), "--data", "-"],
                           stdin=zero, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2
    assert_one_line_error(r.stderr, "stdin: more than 8,388,608 bytes")
    assert not list((cache / "spool").iterdir())


def test_a_signal_while_stdin_is_read_stops_the_command(tiny_ckpt_ro, tmp_path, cache):
    env = dict(os.environ)
    env.pop("MEMENGINE_DEBUG", None)
    with open("/dev/zero", "rb") as zero:
        p = subprocess.Popen([sys.executable, "-m", "memengine.cli.main", "eval", str(tiny_ckpt_ro), "--data", "-"],
                             stdin=zero, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (cache / "spool").is_dir():
            time.sleep(0.1)
        time.sleep(1.5)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
    assert p.returncode == 143, err
    assert "Traceback" not in err
    assert not list((cache / "spool").iterdir())


def test_a_runs_host_memory_does_not_grow_with_the_corpus(tiny_ckpt_ro, tmp_path, cache):
    """Peak RSS of a few steps on 1 MB and on 256 MB of text: within 48 MB of each other (the
    old reader held the text, its int32 ids and every window: 20-50x the file)."""
    line = (SAMPLE_TEXT * 8).encode()
    peaks = {}
    for name, size in (("small", 1 << 20), ("large", 256 << 20)):
        data = tmp_path / f"{name}.txt"
        with open(data, "wb") as f:
            for _ in range(size // len(line)):
                f.write(line)
        code = ("import resource, sys\nfrom memengine.cli import main\nsys.argv = ['memengine', 'train', "
                f"{str(tiny_ckpt_ro)!r}, '--data', {str(data)!r}, '-o', {str(tmp_path / name)!r}, '--seq-len', "
                "'64', '--batch-size', '2', '--max-steps', '3', '-q']\n"
                "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
                "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        peaks[name] = int(r.stdout.split()[-1]) * 1024
    assert peaks["large"] - peaks["small"] < 48 << 20, peaks


def test_the_order_of_a_large_corpus_is_a_permutation_computed_where_read():
    n = sampler.PERMUTE_MAX * 3 // 2 + 7
    o = sampler.WindowOrder(n, 1 << 16, seed=3, shuffle=True)
    seen = []
    state = None
    for step in range(o.steps_per_epoch):
        epoch, k, idx = o.next()
        if step == 5:
            state = o.state()
        seen.append(idx)
    allv = np.concatenate(seen)
    assert allv.size == n and np.unique(allv).size == n and allv.min() == 0 and allv.max() == n - 1
    assert not isinstance(o.perm, np.ndarray)
    assert (allv[:1000] != np.arange(1000)).any()
    # resumed from the state after step 6, the order carries on exactly
    r = sampler.WindowOrder(n, 1 << 16, seed=3, shuffle=True, state=state)
    assert np.array_equal(r.next()[2], seen[6])
    # the next epoch is another order
    assert not np.array_equal(o.next()[2], seen[0])
    # up to PERMUTE_MAX the order is numpy's permutation, as before
    small = sampler.WindowOrder(100, 10, seed=3, shuffle=True)
    assert np.array_equal(np.concatenate([small.next()[2] for _ in range(10)]),
                          np.random.Generator(np.random.PCG64(3)).permutation(100))
