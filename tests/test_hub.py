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
from conftest import SAMPLE_TEXT, make_checkpoint
from memengine.engine.errors import MemengineError
from memengine.engine.io.checkpoint import load_checkpoint, save_checkpoint
from memengine.engine.io.resolve import public_path, resolve_checkpoint
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
    from memengine.engine.io.safetensors_io import read_header

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


# ----------------------------------------------------------------- info without the weights
def _header_json(path: Path) -> dict:
    """A safetensors file's header by plain json (not memengine's parser)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n])


@pytest.fixture
def online_hub(hf_home, tmp_path, monkeypatch):
    """Online, against a stand-in for the Hub: repo id -> a local checkpoint directory.
    snapshot_download copies the files its patterns select into a snapshot (local_files_only:
    only an earlier copy); get_safetensors_metadata returns the weight files' headers, parsed
    with json into huggingface_hub's own classes. Records which files were fetched."""
    import fnmatch
    import shutil

    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub import errors as herr
    from huggingface_hub.utils import SafetensorsFileMetadata, SafetensorsRepoMetadata, TensorInfo

    root, _ = hf_home
    repos = {"org/remote": root / "a", "org/remote-sharded": root / "b"}
    fetched: list = []

    def snapshot_download(repo_id, revision=None, cache_dir=None, allow_patterns=None, local_files_only=False):
        dest = tmp_path / "snapshots" / repo_id.replace("/", "--")
        if local_files_only:
            if not dest.is_dir():
                raise herr.LocalEntryNotFoundError(f"{repo_id} is not cached")
            return str(dest)
        dest.mkdir(parents=True, exist_ok=True)
        for f in repos[repo_id].iterdir():
            if any(fnmatch.fnmatch(f.name, p) for p in allow_patterns):
                shutil.copy(f, dest / f.name)
                fetched.append(f.name)
        return str(dest)

    def get_safetensors_metadata(repo_id, revision=None):
        src = repos[repo_id]
        index = src / "model.safetensors.index.json"
        wm = json.loads(index.read_text())["weight_map"] if index.exists() else None
        files = sorted(set(wm.values())) if wm else ["model.safetensors"]
        fm = {}
        for f in files:
            h = _header_json(src / f)
            meta = h.pop("__metadata__", {})
            fm[f] = SafetensorsFileMetadata(metadata=meta, tensors={
                k: TensorInfo(dtype=v["dtype"], shape=v["shape"], data_offsets=tuple(v["data_offsets"]))
                for k, v in h.items()})
        return SafetensorsRepoMetadata(metadata=None, sharded=wm is not None,
                                       weight_map=wm or {k: "model.safetensors" for k in fm["model.safetensors"].tensors},
                                       files_metadata=fm)

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", get_safetensors_metadata)
    return root, fetched


@pytest.mark.parametrize("repo_id,local", [("org/remote", "a"), ("org/remote-sharded", "b")])
def test_info_on_an_uncached_id_reads_the_headers_from_the_hub(online_hub, repo_id, local, monkeypatch):
    """`info` on a model id whose weights are not cached fetches the small files only and
    shows what `info` on the same checkpoint on disk shows: config, tensors, dtypes, parameters."""
    from memengine.engine.app.plan import ENV_MAX_MEMORY

    monkeypatch.setenv(ENV_MAX_MEMORY, "8G")   # one budget for both plans (not the host's free memory)
    root, fetched = online_hub
    by_id = run("info", repo_id, "--json")
    by_path = run("info", root / local, "--json")
    assert by_id.exit_code == 0, by_id.stderr
    a, b = json.loads(by_id.stdout), json.loads(by_path.stdout)
    for key in ("config", "parameters", "tensors", "dtypes", "model_type", "weight_files", "plan"):
        assert a[key] == b[key], key
    assert a["weights_downloaded"] is False and b["weights_downloaded"] is True
    assert fetched and not [f for f in fetched if f.endswith(".safetensors")], fetched
    data = sum(max(v["data_offsets"][1] for k, v in _header_json(root / local / f).items() if k != "__metadata__")
               for f in b["weight_files"])
    assert a["bytes"] >= data and a["bytes"] < b["bytes"]


def test_info_on_a_downloaded_id_uses_the_files(online_hub, monkeypatch, tmp_path):
    """Once a run has fetched the weights, `info` reads them from the cache, not the Hub."""
    import huggingface_hub

    root, fetched = online_hub
    data = tmp_path / "d.txt"
    data.write_text(SAMPLE_TEXT)
    assert run("eval", "org/remote", "--data", data, "--seq-len", "64").exit_code == 0
    assert "model.safetensors" in fetched

    def no_hub(*a, **k):
        raise AssertionError("the Hub was asked for headers the cache has")

    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", no_hub)
    r = run("info", "org/remote", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["weights_downloaded"] is True


def test_info_on_an_id_without_safetensors_is_one_line(online_hub, monkeypatch):
    import huggingface_hub
    from huggingface_hub import errors as herr

    def not_safetensors(repo_id, revision=None):
        raise herr.NotASafetensorsRepoError(f"'{repo_id}' is not a safetensors repo")

    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", not_safetensors)
    r = run("info", "org/remote")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "has no model.safetensors")
