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


def _cached(tmp_path, text: str):
    data = tmp_path / f"d{abs(hash(text)) % 10**8}.txt"
    data.write_text(text * 10)   # an entry of ~2.6 KB
    return tokens.token_file(tokens.resolve_sources([str(data)]), ByteTokenizer(), 256)


def test_the_cache_keeps_to_its_bound_least_recently_used_first(tmp_path, cache, monkeypatch):
    """MEMENGINE_CACHE_MAX_BYTES bounds the token cache: beyond it the least recently used
    entries go (a reuse counts as a use), never the one the run uses."""
    monkeypatch.setattr(tokens, "RECENT", 0.0)
    monkeypatch.setenv("MEMENGINE_CACHE_MAX_BYTES", "7000")   # two of the ~3 KB entries below, not three
    a = _cached(tmp_path, "a" + SAMPLE_TEXT)
    time.sleep(0.05)
    b = _cached(tmp_path, "b" + SAMPLE_TEXT)
    time.sleep(0.05)
    assert _cached(tmp_path, "a" + SAMPLE_TEXT).reused        # a used again: b is now the oldest
    time.sleep(0.05)
    c = _cached(tmp_path, "c" + SAMPLE_TEXT)
    assert sorted(entries(cache)) == sorted([a.path.name, c.path.name])
    assert not b.path.exists()
    monkeypatch.setenv("MEMENGINE_CACHE_MAX_BYTES", "1")       # the run's own entry always stays
    d = _cached(tmp_path, "d" + SAMPLE_TEXT)
    assert entries(cache) == [d.path.name]
    monkeypatch.setattr(tokens, "RECENT", 3600.0)               # ... and one used a moment ago by another run
    _cached(tmp_path, "e" + SAMPLE_TEXT)
    assert d.path.name in entries(cache)


def test_the_cache_bound_is_validated_before_any_work(tiny_ckpt_ro, tmp_path, cache, monkeypatch):
    data = tmp_path / "d.txt"
    data.write_text(SAMPLE_TEXT)
    monkeypatch.setattr(tokens, "_tokenize", lambda *a, **k: (_ for _ in ()).throw(AssertionError("tokenized")))
    for bad in ("lots", "0", "-5", "1.5"):
        r = run("eval", tiny_ckpt_ro, "--data", data, env={"MEMENGINE_CACHE_MAX_BYTES": bad})
        assert r.exit_code == 2, (bad, r.stderr)
        assert_one_line_error(r.stderr, "MEMENGINE_CACHE_MAX_BYTES")


def test_what_a_killed_run_left_in_the_cache_is_removed(tmp_path, cache):
    """A SIGKILLed run's partial token file and stdin spool (names with its pid) are removed by
    the next run; a live process's, and the current one's, are left alone."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (cache / "tokens" / f".tmp-{dead}-abc").mkdir(parents=True)
    (cache / "tokens" / f".tmp-{dead}-abc" / "tokens.bin").write_bytes(b"x" * 100)
    (cache / "spool").mkdir()
    (cache / "spool" / f"stream-{dead}-xyz").write_bytes(b"y" * 100)
    live = cache / "tokens" / f".tmp-{os.getpid()}-def"
    live.mkdir()
    old = cache / "spool" / "stream-q1w2e3"   # an older version's name (no pid): removed once a day old
    old.write_bytes(b"z")
    os.utime(old, (time.time() - 2 * 86400,) * 2)
    _cached(tmp_path, SAMPLE_TEXT)
    assert sorted(p.name for p in (cache / "tokens").iterdir() if p.name.startswith(".")) == [live.name]
    assert list((cache / "spool").iterdir()) == []


def test_the_held_out_draw_of_a_large_corpus_takes_the_memory_of_the_held_windows_only():
    """--val-fraction on more than PERMUTE_MAX windows: the held-out windows are the first k of
    a computed permutation, not numpy's choice (which permutes every window when k > n/50:
    80 MB for 10^7 windows); distinct, sorted, in range, reproducible from the seed."""
    import tracemalloc

    n = 10_000_000
    tracemalloc.start()
    try:
        held = sampler.held_out(n, 0.05, 7)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    k = 500_000
    assert held.size == k and held[0] >= 0 and held[-1] < n and np.all(np.diff(held) > 0)
    assert peak < 8 * k * 6, peak   # a few arrays of k, never one of n (8 bytes x 10^7 = 80 MB)
    assert np.array_equal(held, sampler.held_out(n, 0.05, 7)) and not np.array_equal(held, sampler.held_out(n, 0.05, 8))
    small = sampler.held_out(1000, 0.05, 7)   # up to PERMUTE_MAX: numpy's draw, as before
    rng = np.random.Generator(np.random.PCG64([7, 0x76616C]))
    assert np.array_equal(small, np.sort(rng.choice(1000, size=50, replace=False)))
