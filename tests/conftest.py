"""Shared fixtures: tiny checkpoints made with the engine's own init (lavapipe is slow, so
the models are very small: E=16, one layer, byte vocabulary)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the oracle never downloads anything
import shutil
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
    from memengine.engine.checkpoint import save_checkpoint
    from memengine.engine.config import MambaConfig
    from memengine.engine.init import init_weights

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
    from memengine.engine.gpu import get_runtime

    return get_runtime()
