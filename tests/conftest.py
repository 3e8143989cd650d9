"""Shared fixtures: tiny checkpoints made with the engine's own init (lavapipe is slow, so
the models are very small: E=16, one layer, byte vocabulary)."""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the oracle never downloads anything
import shutil
import tempfile

# token files (engine/io/tokens.py) go to a cache of the test session, not the user's
os.environ.setdefault("MEMENGINE_CACHE_DIR", tempfile.mkdtemp(prefix="memengine-cache-"))
from pathlib import Path

import pytest

TINY = {
    "vocab_size": 256,
    "hidden_size": 16,
    "state_size": 4,
    "num_hidden_layers": 1,
    "expand": 2,
    "conv_kernel": 4,
    "time_step_rank": "auto",
    "use_bias": False,
    "use_conv_bias": True,
    "tie_word_embeddings": True,
}

SAMPLE_TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, "
    "it was the age of foolishness, it was the epoch of belief, it was the epoch of "
    "incredulity, it was the season of Light, it was the season of Darkness.\n"
)


def make_checkpoint(out_dir: Path, overrides: dict | None = None, seed: int = 0) -> Path:
    from memengine.engine.io.checkpoint import save_checkpoint
    from memengine.engine.models.mamba1.config import MambaConfig
    from memengine.engine.models.mamba1.init import init_weights

    cfg = MambaConfig.from_dict({**TINY, **(overrides or {})})
    tensors = init_weights(cfg, seed)
    save_checkpoint(Path(out_dir), cfg, tensors, dtype="F32")
    return Path(out_dir)


@pytest.fixture(scope="session")
def _tiny_master(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture
def tiny_ckpt(_tiny_master, tmp_path) -> Path:
    """A private copy of the tiny checkpoint (tests may corrupt or inspect it)."""
    dst = tmp_path / "tiny"
    shutil.copytree(_tiny_master, dst)
    return dst


@pytest.fixture(scope="session")
def tiny_ckpt_ro(_tiny_master) -> Path:
    """The shared tiny checkpoint; do not modify."""
    return _tiny_master


@pytest.fixture
def sample_text(tmp_path) -> Path:
    p = tmp_path / "sample.txt"
    p.write_text(SAMPLE_TEXT, encoding="utf-8")
    return p


@pytest.fixture(scope="session")
def rt():
    """The GPU runtime on whatever adapter wgpu finds (MEMENGINE_DEVICE selects another)."""
    from memengine.engine.runtime import get_runtime

    return get_runtime()


@contextlib.contextmanager
def checked_limits(rt, monkeypatch, binding: int, buffer: int | None = None):
    """Force the runtime's limits down and check every dispatch against them: each storage
    binding of a model tensor must fit the forced binding limit (wgpu itself only checks
    the adapter's real limit, so without this a kernel that did not split would pass).
    Kernel scratch is exempt (it is sized against the adapter's limit).  Yields a dict
    counting the dispatches, in all and per entry point."""
    from memengine.engine.runtime import Recorder, Tensor

    seen = {"dispatches": 0}
    orig = Recorder.dispatch

    def checked(self, shader, entry, bindings, groups, constants=None):
        scratch = {id(t.buffer) for t in rt._scratch.values()}
        for i, r in bindings.items():
            if isinstance(r, Tensor) and id(r.buffer) not in scratch:
                assert r.nbytes <= rt.max_binding, (
                    f"{shader}.{entry} binding {i} ({r.name}) is {r.nbytes} bytes, over {rt.max_binding}")
        seen["dispatches"] += 1
        seen[entry] = seen.get(entry, 0) + 1
        return orig(self, shader, entry, bindings, groups, constants)

    with rt.forced_limits(binding, buffer):
        monkeypatch.setattr(Recorder, "dispatch", checked)
        try:
            yield seen
        finally:
            monkeypatch.setattr(Recorder, "dispatch", orig)
