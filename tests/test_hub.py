"""Model ids resolved through huggingface_hub's cache, built here by hand in the cache's own
layout (blobs, symlinked snapshots, refs) under a temporary HF_HOME.  HF_HUB_OFFLINE=1
throughout: no test touches the network."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memengine.engine.checkpoint import load_checkpoint, save_checkpoint
from memengine.engine.errors import MemengineError
from memengine.engine.resolve import public_path, resolve_checkpoint

from conftest import SAMPLE_TEXT, make_checkpoint
from test_cli import assert_one_line_error, run

MAIN = "1" * 40
TAGGED = "2" * 40


def add_to_cache(hub_cache: Path, repo_id: str, ref: str, commit: str, src: Path) -> Path:
    """Put the files of `src` into the cache as huggingface_hub stores a download of them."""
    repo = hub_cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    for f in src.iterdir():
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    return snap


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_home")
    cache = root / "hub"
    a = make_checkpoint(root / "a", seed=0)
    other = load_checkpoint(make_checkpoint(root / "b0", seed=1))
    sharded = save_checkpoint(root / "b", other.config, other.tensors, max_shard_size="8KB")
    add_to_cache(cache, "org/tiny", "main", MAIN, a)
    add_to_cache(cache, "org/tiny", "v1", TAGGED, sharded)  # a tag whose snapshot is sharded
    return root, cache


@pytest.fixture
def in_cache(hf_home, monkeypatch):
    """In-process: point huggingface_hub at the temporary cache (it reads HF_HOME at import)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home[1]))
    assert constants.HF_HUB_OFFLINE
    return hf_home


def test_resolve_revisions(in_cache):
    root, cache = in_cache
    ref = resolve_checkpoint("org/tiny")
    assert ref.path == cache / "models--org--tiny" / "snapshots" / MAIN and ref.public_name == "org/tiny"
    assert load_checkpoint(ref.path).tensors.keys() == load_checkpoint(root / "a").tensors.keys()
    for rev, commit in (("v1", TAGGED), (TAGGED, TAGGED), (MAIN, MAIN)):
        ref = resolve_checkpoint("org/tiny", rev)
        assert ref.path.name == commit and ref.public_name == f"org/tiny@{rev}"
    ck = load_checkpoint(resolve_checkpoint("org/tiny", "v1").path)  # shards behind symlinks into blobs/
    assert len(ck.extra["weight_files"]) > 1


@pytest.mark.parametrize("spec,rev,match", [
    ("org/none", None, "checkpoint 'org/none' not found: no such local path, and no model id"),
    ("org/tiny", "v9", "no model id of that name \\(revision v9\\)"),
    ("no//such/thing", None, "neither a local path nor a model id"),
])
def test_resolve_missing(in_cache, spec, rev, match):
    with pytest.raises(MemengineError, match=match):
        resolve_checkpoint(spec, rev)


def test_revision_with_local_path_refused(tmp_path, tiny_ckpt_ro):
    with pytest.raises(MemengineError, match="--revision v1: .* is a local path"):
        resolve_checkpoint(str(tiny_ckpt_ro), "v1")


def test_public_names():
    assert public_path("/home/me/models/tiny") == "tiny"
    assert public_path("models/tiny") == "models/tiny"
    assert public_path("-") == "-"


def test_cli_on_ids_in_process(in_cache, tmp_path):
    root, _ = in_cache
    data = tmp_path / "d.txt"
    data.write_text(SAMPLE_TEXT)
    r = run("info", "org/tiny", "--revision", "v1", "--json")
    assert r.exit_code == 0, r.stderr
    assert len(json.loads(r.stdout)["weight_files"]) > 1
    by_id = run("eval", "org/tiny", "--data", data, "--seq-len", "64", "--json")
    by_path = run("eval", root / "a", "--data", data, "--seq-len", "64", "--json")
    assert by_id.exit_code == 0, by_id.stderr
    assert json.loads(by_id.stdout) == json.loads(by_path.stdout)
    out = tmp_path / "q"
    r = run("quantize", "org/tiny", "--revision", "v1", "-o", out)
    assert r.exit_code == 0, r.stderr
    from memengine.engine.safetensors_io import read_header

    assert read_header(out / "model.safetensors").metadata["memengine.quantized_from"] == "org/tiny@v1"
    r = run("eval", "org/missing", "--data", data)
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "org/missing")


def test_cli_id_through_hf_home(hf_home, tmp_path):
    """The real process: HF_HOME and HF_HUB_OFFLINE from the environment, as a user sets them."""
    root, _ = hf_home
    data = tmp_path / "d.txt"
    data.write_text(SAMPLE_TEXT)
    env = {**os.environ, "HF_HOME": str(root), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    env.pop("HUGGINGFACE_HUB_CACHE", None)
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "memengine.cli.main", "train", "org/tiny", "--data", str(data),
                        "-o", str(out), "--epochs", "1", "--seq-len", "64", "--json"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads((out / "memengine.json").read_text())["input"] == "org/tiny"
    p = subprocess.run([sys.executable, "-m", "memengine.cli.main", "info", "org/other"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2
    assert_one_line_error(p.stderr, "HF_HUB_OFFLINE=1")
