"""Hostile model, config, tokenizer and run inputs are refused before any work: exit 2 and one
`error:` line naming the file, tensor or key, never a hang, a traceback, an internal error
or the OOM killer.

Cases that could hang or exhaust memory when the protection is missing run in a child
process with a time limit and an address-space limit (or, for FIFOs, beside a thread that
releases a blocked reader), so a regression fails instead of stalling the suite.
New engine modules are imported inside the tests that need them.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY, make_checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from memengine.cli.main import app
from memengine.engine.errors import MemengineError
from memengine.engine.io.checkpoint import load_checkpoint
from memengine.engine.io.tokenizer import load_tokenizer
from memengine.engine.models.mamba1.config import MambaConfig
from memengine.engine.models import load_config
from typer.testing import CliRunner

DEEP = "[" * 100_000 + "]" * 100_000
DIGITS = "9" * 5000
# nine levels of ten: 10^9 strings once expanded
BOMB = "".join(f"  - &{c} [{', '.join(['*' + p] * 10) if p else ', '.join(['x'] * 10)}]\n"
               for p, c in zip([""] + list("abcdefgh"), "abcdefghi"))


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def run_limited(*args, timeout=60, memory=4 << 30):
    """The CLI in a child process with a wall-clock and an address-space limit."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    env = dict(os.environ)
    env.pop("MEMENGINE_DEBUG", None)
    r = subprocess.run([sys.executable, "-m", "memengine.cli.main", *[str(a) for a in args]], capture_output=True,
                       text=True, env=env, timeout=timeout, preexec_fn=limit)
    return r.returncode, r.stderr


def run_python_limited(code: str, timeout=60, memory=4 << 30):
    """Python `code` in a child process with a wall-clock and an address-space limit."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (memory, memory)))
    return r.returncode, r.stderr


def one_error(stderr: str, *needles: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    errs = [ln for ln in lines if ln.startswith("error:")]
    assert len(errs) == 1 and "Traceback" not in stderr and "internal error" not in stderr, stderr
    for n in needles:
        assert n.lower() in errs[0].lower(), (n, errs[0])
    return errs[0]


def refused(fn, *needles: str) -> str:
    with pytest.raises(MemengineError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n.lower() in msg.lower(), (n, msg)
    return msg


@contextlib.contextmanager
def fifo(path: Path, release_after: float = 3.0):
    """A named pipe at `path`. Should a reader block opening it (the bug), a thread opens it
    for writing after `release_after` seconds so the reader sees end-of-file and the test
    fails on its assertions instead of hanging."""
    os.mkfifo(path)
    done = threading.Event()

    def release():
        if done.wait(release_after):
            return
        while not done.wait(0.1):
            with contextlib.suppress(OSError):
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))

    t = threading.Thread(target=release, daemon=True)
    t.start()
    t0 = time.monotonic()
    try:
        yield path
    finally:
        done.set()
        t.join()
    assert time.monotonic() - t0 < release_after, "a reader blocked on the FIFO"


def write_config(d: Path, **changes) -> Path:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def tiny_dict(**changes) -> dict:
    return {**TINY, **changes}


# ===================================================================== safetensors files
def test_cli_refuses_bytes_appended_to_the_weights(tiny_ckpt):
    with open(tiny_ckpt / "model.safetensors", "ab") as f:
        f.write(b"\0" * 16)
    r = run("info", tiny_ckpt)
    assert r.exit_code == 2
    one_error(r.stderr, "model.safetensors", "belong to no tensor")


# ===================================================================== regular files only
@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
def test_fifo_in_checkpoint_directory_refused(tiny_ckpt, name):
    (tiny_ckpt / name).unlink(missing_ok=True)
    with fifo(tiny_ckpt / name):
        refused(lambda: (load_checkpoint(tiny_ckpt), load_tokenizer(tiny_ckpt)), name, "a FIFO (named pipe)")


def test_fifo_shard_index_refused(tiny_ckpt):
    (tiny_ckpt / "model.safetensors").unlink()
    with fifo(tiny_ckpt / "model.safetensors.index.json"):
        refused(lambda: load_checkpoint(tiny_ckpt), "model.safetensors.index.json", "a FIFO (named pipe)")


def test_fifo_as_model_file_config_or_tokenizer_refused(tmp_path):
    with fifo(tmp_path / "w.safetensors") as p:
        refused(lambda: load_checkpoint(p), "w.safetensors", "a FIFO (named pipe)")
    with fifo(tmp_path / "c.json") as p:
        refused(lambda: load_config(p), "c.json", "a FIFO (named pipe)")
    with fifo(tmp_path / "tok.json") as p:
        refused(lambda: load_tokenizer(None, str(p)), "tok.json", "a FIFO (named pipe)")


def test_cli_fifo_model_file_does_not_hang(tmp_path):
    os.mkfifo(tmp_path / "w.safetensors")
    rc, err = run_limited("info", tmp_path / "w.safetensors", timeout=60)
    assert rc == 2
    one_error(err, "w.safetensors", "a FIFO (named pipe)")


def test_device_as_config_or_model_refused(tmp_path):
    # /dev/zero as an init CONFIG used to be read until memory ran out
    rc, err = run_limited("init", "/dev/zero", "-o", tmp_path / "o", timeout=60, memory=2 << 30)
    assert rc == 2
    one_error(err, "/dev/zero", "character device")
    refused(lambda: load_checkpoint("/dev/zero"), "/dev/zero", "character device")


# ===================================================================== sizes checked against each other
def test_config_claiming_a_billion_layers_refused_quickly(tiny_ckpt):
    write_config(tiny_ckpt, num_hidden_layers=10**9)
    t0 = time.monotonic()
    rc, err = run_limited("info", tiny_ckpt, timeout=60)
    assert rc == 2
    one_error(err, "num_hidden_layers", "backbone.layers.1.")
    assert time.monotonic() - t0 < 30


def test_bare_file_with_a_huge_layer_index_refused(tmp_path, tiny_ckpt_ro):
    from safetensors.numpy import load_file, save_file

    t = load_file(str(tiny_ckpt_ro / "model.safetensors"))
    t["backbone.layers.999999999.norm.weight"] = t["backbone.layers.0.norm.weight"]
    save_file(t, str(tmp_path / "w.safetensors"))  # no metadata: the shape is inferred from the names
    rc, err = run_limited("info", tmp_path / "w.safetensors", timeout=60)
    assert rc == 2
    one_error(err, "layer 1 has no tensors")


def test_init_beyond_host_memory_refused(tmp_path):
    # 2^31-1 x 4096 f32 embeddings: 32 TiB
    (tmp_path / "c.json").write_text(json.dumps(tiny_dict(vocab_size=2**31 - 1, hidden_size=4096)))
    r = run("init", tmp_path / "c.json", "-o", tmp_path / "o")
    assert r.exit_code == 2
    one_error(r.stderr, "host memory", "available")
    assert not (tmp_path / "o").exists()


def test_init_with_ten_million_layers_refused_by_the_estimate(tmp_path):
    # 1.6e8 parameters would fit, the bookkeeping of 10^8 tensors would not
    (tmp_path / "c.json").write_text(json.dumps(tiny_dict(hidden_size=1, expand=1, state_size=1, vocab_size=2,
                                                          time_step_rank=1, num_hidden_layers=10**7)))
    rc, err = run_limited("init", tmp_path / "c.json", "-o", tmp_path / "o", timeout=60)
    assert rc == 2
    one_error(err, "host memory", "num_hidden_layers")


def test_vocabulary_of_a_trillion_refused(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps(tiny_dict(vocab_size=10**12)))
    r = run("init", tmp_path / "c.json", "-o", tmp_path / "o")
    assert r.exit_code == 2
    one_error(r.stderr, "vocab_size")


def _sparse_checkpoint(d: Path, cfg: MambaConfig) -> Path:
    """A checkpoint whose weights file declares every tensor of `cfg` (F32) over a sparse
    data buffer: terabytes on paper, a few kilobytes on disk."""
    from memengine.engine.models.mamba1.config import expected_shapes

    header, off = {}, 0
    for name, shape in expected_shapes(cfg).items():
        n = 4 * int(np.prod(shape))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    d.mkdir()
    with open(d / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        f.truncate(8 + len(h) + off)
    (d / "config.json").write_text(cfg.to_json())
    return d


def test_weights_beyond_host_memory_refused_before_reading(tmp_path):
    # a 2^30 x 1024 embedding: 4 TiB of float32
    cfg = MambaConfig.from_dict(tiny_dict(vocab_size=2**30, hidden_size=1024, state_size=4))
    d = _sparse_checkpoint(tmp_path / "big", cfg)
    rc, err = run_limited("quantize", d, "-o", tmp_path / "q", timeout=60)
    assert rc == 2
    one_error(err, "model.safetensors", "host memory")
    # info reads the config and the headers only: it describes the checkpoint
    r = subprocess.run([sys.executable, "-m", "memengine.cli.main", "info", str(d), "--json"], capture_output=True,
                       text=True, timeout=60, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (4 << 30,) * 2))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["parameters"] == cfg.n_params > 2**30 * 1024


def test_host_memory_check_reads_memavailable(tmp_path, monkeypatch, tiny_ckpt_ro):
    from memengine.engine import hostmem

    (tmp_path / "meminfo").write_text("MemTotal:  1000 kB\nMemFree:  10 kB\nMemAvailable:     16 kB\n")
    assert hostmem.available_bytes(str(tmp_path / "meminfo"))[0] == 16 * 1024
    monkeypatch.setattr(hostmem, "MEMINFO", str(tmp_path / "meminfo"))
    refused(lambda: load_checkpoint(tiny_ckpt_ro), "host memory", "16.0 KiB")


# ===================================================================== parser limits
@pytest.mark.parametrize("value, needle", [(DEEP, "nested"), (DIGITS, "5,000 characters")])
def test_init_config_json_parser_limits(tmp_path, value, needle):
    text = json.dumps(tiny_dict())[:-1] + f', "x": {value}}}'
    (tmp_path / "c.json").write_text(text)
    r = run("init", tmp_path / "c.json", "-o", tmp_path / "o")
    assert r.exit_code == 2
    one_error(r.stderr, "c.json", needle)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(depth=st.integers(0, 3000), digits=st.integers(1, 6000), yaml=st.booleans())
def test_fuzz_config_files_only_parse_or_refuse(tmp_path, depth, digits, yaml):
    """Any nesting depth and number length: a config file loads or is refused in one line
    (never RecursionError or Python's int-string ValueError)."""
    value = "[" * depth + "1" * digits + "]" * depth
    p = tmp_path / ("c.yaml" if yaml else "c.json")
    p.write_text(json.dumps(tiny_dict())[:-1] + f', "x": {value}}}')  # JSON is YAML too
    try:
        cfg = load_config(p)
    except MemengineError as e:
        assert str(p) in str(e) and "\n" not in str(e)
        assert depth + 1 > 64 or digits > 100, str(e)  # the value sits inside the top-level object: one more level
    else:
        assert cfg.hidden_size == TINY["hidden_size"]


@pytest.mark.parametrize("ext", ["json", "yaml"])
def test_config_nesting_limit_is_the_same_in_json_and_yaml(tmp_path, ext):
    """63 lists inside the top-level object (64 collections) load; 64 lists are refused."""
    p = tmp_path / f"c.{ext}"
    for depth, ok in ((63, True), (64, False)):
        p.write_text(json.dumps(tiny_dict())[:-1] + f', "x": {"[" * depth + "1" + "]" * depth}}}')
        if ok:
            assert load_config(p).hidden_size == TINY["hidden_size"]
        else:
            with pytest.raises(MemengineError, match="nested"):
                load_config(p)


@pytest.mark.parametrize("value, needle", [(DEEP, "nested"), (DIGITS, "5,000 characters")])
def test_checkpoint_json_parser_limits(tiny_ckpt, value, needle):
    text = (tiny_ckpt / "config.json").read_text().rstrip()[:-1] + f', "x": {value}}}'
    (tiny_ckpt / "config.json").write_text(text)
    refused(lambda: load_checkpoint(tiny_ckpt), "config.json", needle)


def test_index_json_parser_limits(tiny_ckpt):
    (tiny_ckpt / "model.safetensors").unlink()
    (tiny_ckpt / "model.safetensors.index.json").write_text('{"weight_map": {}, "metadata": ' + DEEP + "}")
    refused(lambda: load_checkpoint(tiny_ckpt), "index.json", "nested")


def test_metadata_config_with_a_huge_number(tmp_path, tiny_ckpt_ro):
    from safetensors.numpy import load_file, save_file

    cfg = json.dumps(tiny_dict())[:-1] + f', "x": {DIGITS}}}'
    save_file(load_file(str(tiny_ckpt_ro / "model.safetensors")), str(tmp_path / "w.safetensors"),
              metadata={"config": cfg})
    refused(lambda: load_checkpoint(tmp_path / "w.safetensors"), "w.safetensors", "5,000 characters")


@pytest.mark.parametrize("body, needle", [
    (f"vocab_size: 256\nx:\n{BOMB}", "an alias (*"),
    ("vocab_size: 256\nx: " + DEEP + "\n", "nested"),
    (f"vocab_size: {DIGITS}\n", "5,000 characters"),
    ("vocab_size: 256\nvocab_size: 512\n", "duplicate key"),
])
def test_init_yaml_config_limits(tmp_path, body, needle):
    (tmp_path / "c.yaml").write_text(body)
    r = run("init", tmp_path / "c.yaml", "-o", tmp_path / "o")
    assert r.exit_code == 2
    one_error(r.stderr, "c.yaml", needle)


def test_option_file_alias_bomb_not_expanded(tmp_path, tiny_ckpt_ro, sample_text):
    (tmp_path / "opts.yaml").write_text("lr:\n" + BOMB)
    rc, err = run_limited("train", tiny_ckpt_ro, "--data", sample_text, "-o", tmp_path / "o",
                          "--config", tmp_path / "opts.yaml", timeout=60)
    assert rc == 2
    one_error(err, "opts.yaml", "an alias (*")


@pytest.mark.parametrize("value, needle", [(DEEP, "nested"), (DIGITS, "5,000 characters")])
def test_jsonl_line_parser_limits(value, needle, tmp_path):
    from memengine.engine.io.data import read_documents

    (tmp_path / "d.jsonl").write_text('{"text": "ok"}\n{"text": "x", "y": ' + value + "}\n")
    refused(lambda: read_documents([str(tmp_path / "d.jsonl")]), "d.jsonl:2", needle)


# ===================================================================== shapes the kernels cannot run
@pytest.mark.parametrize("key, value", [("conv_kernel", 8)])
def test_shapes_beyond_the_kernels_refused_before_work(tmp_path, sample_text, key, value):
    d = make_checkpoint(tmp_path / "m", {key: value})
    r = run("eval", d, "--data", sample_text, "--seq-len", "16")
    assert r.exit_code == 2
    one_error(r.stderr, f"{key} {value}", "at most")


def test_state_size_limit_read_from_the_scan(monkeypatch):
    """The selective scan takes any state_size (scan.MAX_N is None); a limit set there is
    what check_kernel_limits enforces."""
    from memengine.engine.kernels import scan
    from memengine.engine.models.mamba1.config import check_kernel_limits

    cfg = MambaConfig.from_dict({**TINY, "state_size": 300})
    assert scan.MAX_N is None
    check_kernel_limits(cfg)
    monkeypatch.setattr(scan, "MAX_N", 256)
    refused(lambda: check_kernel_limits(cfg), "state_size 300", "at most 256")


def test_large_state_size_runs(tmp_path, sample_text):
    """state_size 300 (beyond the 256 of the earlier scan kernels) evaluates."""
    d = make_checkpoint(tmp_path / "m", {"state_size": 300})
    r = run("eval", d, "--data", sample_text, "--seq-len", "16", "--json")
    assert r.exit_code == 0, r.stderr
    assert np.isfinite(json.loads(r.stdout.strip().splitlines()[-1])["loss"])


@pytest.mark.parametrize("changes, needle", [
    ({"time_step_rank": 17}, "time_step_rank"),       # hidden_size is 16
    ({"vocab_size": 2**31}, "vocab_size"),
])
def test_nonsense_config_values_refused(changes, needle):
    refused(lambda: MambaConfig.from_dict({**TINY, **changes}), needle)


# ===================================================================== tokenizers
def _word_tokenizer(path: Path, n: int = 300, id_of_w5: int | None = None) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(n)}
    vocab["[UNK]"] = n
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    d = json.loads(tok.to_str())
    if id_of_w5 is not None:
        d["model"]["vocab"]["w5"] = id_of_w5
    path.write_text(json.dumps(d))
    return path


def test_tokenizer_ids_beyond_32_bits_refused(tmp_path):
    tok = load_tokenizer(None, str(_word_tokenizer(tmp_path / "tokenizer.json", id_of_w5=4_000_000_000)))
    refused(lambda: tok.encode("w1 w5"), "tokenizer.json", "4,000,000,000")


def test_cli_fifo_tokenizer_beside_checkpoint_not_skipped(tiny_ckpt, sample_text):
    # it used to be skipped in silence and the byte-level tokenizer used instead
    with fifo(tiny_ckpt / "tokenizer.json"):
        r = run("eval", tiny_ckpt, "--data", sample_text, "--seq-len", "16")
    assert r.exit_code == 2
    one_error(r.stderr, "tokenizer.json", "a FIFO (named pipe)")


def test_tokenizer_file_beyond_host_memory_refused(tiny_ckpt, sample_text):
    with open(tiny_ckpt / "tokenizer.json", "wb") as f:
        f.truncate(2**42)  # sparse: 4 TiB on paper
    rc, err = run_limited("eval", tiny_ckpt, "--data", sample_text, "--seq-len", "16", timeout=60)
    assert rc == 2
    one_error(err, "tokenizer.json", "host memory")


@pytest.mark.parametrize("kind", ["fifo", "deep"])
def test_tokenizer_config_read_with_bounds(tmp_path, kind):
    from memengine.engine.io.tokenizer import HFTokenizer

    tok = _word_tokenizer(tmp_path / "tokenizer.json")
    cfg = tmp_path / "tokenizer_config.json"
    if kind == "fifo":  # it used to be skipped in silence (and the end-of-text token guessed)
        with fifo(cfg):
            refused(lambda: HFTokenizer(tok), "tokenizer_config.json", "a FIFO (named pipe)")
    else:  # a RecursionError used to escape
        cfg.write_text('{"eos_token": "w1", "x": ' + DEEP + "}")
        refused(lambda: HFTokenizer(tok), "tokenizer_config.json", "nested")


def test_tokenizer_config_beyond_its_size_refused(tiny_ckpt, sample_text):
    _word_tokenizer(tiny_ckpt / "tokenizer.json", n=200)
    with open(tiny_ckpt / "tokenizer_config.json", "wb") as f:
        f.truncate(2**42)  # sparse: 4 TiB on paper, read whole before
    rc, err = run_limited("eval", tiny_ckpt, "--data", sample_text, "--seq-len", "16", timeout=60)
    assert rc == 2
    one_error(err, "tokenizer_config.json", "at most")


# ===================================================================== run files (--resume, optimizer state, data)
@pytest.mark.parametrize("kind", ["fifo", "deep"])
def test_trainer_state_read_with_bounds(tmp_path, kind):
    from memengine.engine.train.snapshots import STATE_FILE, read_state

    p = tmp_path / STATE_FILE
    if kind == "fifo":  # opening it used to block until a writer came
        with fifo(p):
            refused(lambda: read_state(tmp_path), "--resume", STATE_FILE, "a FIFO (named pipe)")
    else:  # a RecursionError used to escape
        p.write_text('{"format": "memengine-trainer-state", "step": 1, "x": ' + DEEP + "}")
        refused(lambda: read_state(tmp_path), "--resume", STATE_FILE, "nested")


def test_fifo_optimizer_state_not_skipped(tmp_path):
    from memengine.engine.train import optim_state

    p = tmp_path / optim_state.OPTIMIZER_FILE  # it used to be taken for no state at all
    with fifo(p):
        refused(lambda: optim_state.load(p, model=None), optim_state.OPTIMIZER_FILE, "a FIFO (named pipe)")


def test_optimizer_state_shapes_checked_before_its_data_is_read(tmp_path):
    from memengine.engine.train import optim_state

    p = tmp_path / optim_state.OPTIMIZER_FILE
    n = 2**40  # 4 TiB of moments on paper, in a sparse file the header tiles exactly
    header = json.dumps({"w.exp_avg": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]},
                         "w.exp_avg_sq": {"dtype": "F32", "shape": [4], "data_offsets": [4 * n, 4 * n + 16]}}).encode()
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + 4 * n + 16)
    # in a child: reading the data first (the bug) exhausts memory
    code = ("import sys\nfrom memengine.engine.train import optim_state\nfrom memengine.engine.errors import MemengineError\n"
            "class Model:\n    shapes = gpu_shapes = {'w': (4,)}\n"
            f"try:\n    optim_state.load({str(p)!r}, Model())\n"
            "except MemengineError as e:\n    print(f'error: {e}', file=sys.stderr)\n    sys.exit(2)\n")
    rc, err = run_python_limited(code, timeout=60)
    assert rc == 2
    one_error(err, "tensor 'w'", f"shape [{n}]")


@pytest.mark.parametrize("kind", ["device", "huge"])
def test_data_file_device_or_beyond_host_memory_refused(tmp_path, tiny_ckpt_ro, kind):
    data = "/dev/zero"  # read until memory ran out
    if kind == "huge":
        data = tmp_path / "big.txt"
        with open(data, "wb") as f:
            f.truncate(2**42)  # sparse: 4 TiB on paper
    rc, err = run_limited("eval", tiny_ckpt_ro, "--data", data, "--seq-len", "16", timeout=60)
    assert rc == 2
    # a data file is streamed into a token file on disk (engine/io/tokens.py): one beyond the
    # cache disk's free space is refused before it is read
    one_error(err, str(data), "character device" if kind == "device" else "bytes free")
