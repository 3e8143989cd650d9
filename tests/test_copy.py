"""Recorder.copy / clear as dispatches (shaders/copy.wgsl, what GPUs take) against numpy,
through bindings smaller than the tensors, and a training run that is the same to the bit
either way."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from memengine.engine.app.options import TrainOptions
from memengine.engine.models.mamba1.config import MambaConfig
from memengine.engine.models.mamba1.init import init_weights
from memengine.engine.models.lm import LanguageModel
from memengine.engine.train.loop import fit


@contextlib.contextmanager
def by_dispatch(rt, on: bool):
    saved = rt.copy_by_dispatch
    rt.copy_by_dispatch = on
    try:
        yield
    finally:
        rt.copy_by_dispatch = saved


@pytest.mark.parametrize("binding", [None, 4096])
def test_copies_and_clears_as_dispatches_match_numpy(rt, binding):
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**32, size=5000, dtype=np.uint32)
    words[:4] = [0x7FC00001, 0xFF800000, 0x80000000, 0x7F800001]   # NaN payloads, -inf, -0 as f32
    src = rt.upload(words, "u32")
    dst = rt.upload(np.full(6000, 7, np.uint32), "u32")
    want = np.full(6000, 7, np.uint32)
    with by_dispatch(rt, True), rt.forced_limits(binding):
        rec = rt.recorder()
        # (src start, dst start, words): windows that begin off the binding alignment, one
        # longer than a 4 KiB binding, one word
        for s, d, n in ((3, 5, 1500), (0, 2000, 4999), (4999, 5999, 1)):
            n = min(n, 5000 - s, 6000 - d)
            rec.copy(src.view((n,), s), dst.view((n,), d))
            want[d:d + n] = words[s:s + n]
        rec.clear(dst.view((1200,), 77))
        want[77:1277] = 0
        rec.submit()
    got = rt.read(dst)
    np.testing.assert_array_equal(got, want)


def test_copies_as_dispatches_keep_the_compute_pass(rt):
    a, b = rt.upload(np.arange(64, dtype=np.float32)), rt.zeros((64,))
    with by_dispatch(rt, True):
        rec = rt.recorder()
        rec.clear(b)
        p = rec._compute_pass()
        rec.copy(a, b)
        rec.clear(a.view((4,), 8))
        assert rec._pass is p
        rec.submit()
    with by_dispatch(rt, False):
        rec = rt.recorder()
        p = rec._compute_pass()
        rec.copy(a, b)   # a buffer copy ends the pass
        assert rec._pass is None
        rec.submit()


def test_training_is_the_same_to_the_bit_with_copies_as_dispatches(rt):
    cfg = MambaConfig(vocab_size=256, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4)
    text = np.frombuffer(b"copies between passes, copies inside them. " * 4, np.uint8).astype(np.int32)
    wins = [(text[i:i + 24], text[i + 1:i + 25]) for i in range(0, 96, 24)]
    runs = []
    for on in (False, True):
        with by_dispatch(rt, on):
            model = LanguageModel(rt, cfg, init_weights(cfg, 3))
            loop = fit(model, wins, TrainOptions(epochs=2, lr=3e-3, batch_size=2, seq_len=24, shuffle=False))
            runs.append(([e["loss"] for e in loop.state.history if e["event"] == "epoch"], model.state_dict()))
    (l0, s0), (l1, s1) = runs
    assert l0 == l1
    for n in s0:
        np.testing.assert_array_equal(s0[n].view(np.uint32), s1[n].view(np.uint32), err_msg=n)
