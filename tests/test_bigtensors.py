"""Tensors larger than one storage binding or one buffer: the range splitting of every kernel
wrapper against numpy with the limits forced down (each dispatch is checked against them),
and the parameter store in several buffers.  The whole model under forced limits is
checked against transformers in test_oracle.py."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import checked_limits
from memengine.engine.errors import MemengineError
from memengine.engine.kernels import matmul as mm
from memengine.engine.kernels.embedding import EmbeddingBackward, embedding_forward
from memengine.engine.models.store import FlatStore, store_layout
from memengine.engine.runtime import BindingError, parse_bytes, split

KIB4 = 4096


def test_split_is_one_range_when_everything_fits(rt):
    assert split(rt, 1000, lambda n: (4 * n,)) == [(0, 1000)]
    assert split(rt, 0, lambda n: (4 * n,)) == []
    t = rt.empty((10_000,))  # a buffer larger than the forced binding: splitting is on
    with rt.forced_limits(binding=KIB4):
        assert not rt.unsplit
        parts = split(rt, 10_000, lambda n: (4 * n, 4 * n), step=256)
        assert parts[0] == (0, 768) and sum(n for _, n in parts) == 10_000
        assert all(s % 256 == 0 for s, _ in parts)
        assert all(4 * n <= rt.max_binding - rt.storage_align + 4 for _, n in parts)
        with pytest.raises(BindingError, match="one row of x needs 8.0 KiB"):
            split(rt, 3, lambda n: (8192 * n,), unit="one row of x")
    rt.free(t)


def test_limits_only_go_down_and_env_values_parse(rt, monkeypatch):
    assert parse_bytes("64K", "X") == 65536 and parse_bytes("1.5MiB", "X") == 1572864
    with pytest.raises(MemengineError, match="MEMENGINE_MAX_BINDING_BYTES='lots'"):
        parse_bytes("lots", "MEMENGINE_MAX_BINDING_BYTES")
    before = (rt.max_binding, rt.max_buffer)
    with rt.forced_limits(binding=2 * rt.adapter_max_binding, buffer=8192):
        assert rt.max_buffer == 8192 and rt.max_binding == 8192  # a binding never exceeds a buffer
    assert (rt.max_binding, rt.max_buffer) == before
    monkeypatch.setenv("MEMENGINE_MAX_BINDING_BYTES", "16K")
    rt.apply_env_limits()
    try:
        assert rt.max_binding == 16384
    finally:
        monkeypatch.delenv("MEMENGINE_MAX_BINDING_BYTES")
        rt.apply_env_limits()
    assert rt.max_binding == rt.adapter_max_binding


def _mm(rt, a, b, c0, bias, M, N, K, ta, tb, acc, **kw):
    A, B, C = rt.upload(a), rt.upload(b), rt.upload(c0)
    Bi = rt.upload(bias) if bias is not None else None
    rec = rt.recorder()
    mm.matmul(rec, C, A, B, M=M, N=N, K=K, trans_a=ta, trans_b=tb, acc=acc, bias=Bi, **kw)
    n = rec.dispatches
    rec.submit()
    return rt.read(C), n


@pytest.mark.parametrize("M,N,K", [(150, 100, 40), (70, 37, 29), (20, 600, 24), (600, 12, 36)])
@pytest.mark.parametrize("ta,tb,acc", [(False, False, False), (False, True, True), (True, False, True),
                                        (True, True, False)])
def test_matmul_blocks_match_numpy(rt, monkeypatch, M, N, K, ta, tb, acc):
    """Row, column and reduction blocks (the reduction accumulated, the bias added once)."""
    rng = np.random.default_rng(M + N + K)
    a = rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32)
    b = rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32)
    c0 = rng.standard_normal((M, N)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    ref = (a.T if ta else a).astype(np.float64) @ (b.T if tb else b) + bias + (c0 if acc else 0)
    whole, n_whole = _mm(rt, a, b, c0, bias, M, N, K, ta, tb, acc)
    with checked_limits(rt, monkeypatch, KIB4):
        blocks, n_blocks = _mm(rt, a, b, c0, bias, M, N, K, ta, tb, acc)
    assert n_blocks > n_whole
    err = np.abs(blocks - ref).max() / np.abs(ref).max()
    assert err < 1e-5, err
    np.testing.assert_allclose(blocks, whole, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_linear_column_slices_in_blocks(rt, monkeypatch):
    """A strided column view (dt_proj reading x_proj's first R columns) split into blocks."""
    rng = np.random.default_rng(1)
    M, R, W, Di = 700, 8, 40, 12
    xdbl = rng.standard_normal((M, W)).astype(np.float32)
    w = rng.standard_normal((Di, R)).astype(np.float32)
    X, Wt, Y = rt.upload(xdbl), rt.upload(w), rt.empty((M, Di))
    with checked_limits(rt, monkeypatch, KIB4):
        rec = rt.recorder()
        mm.linear_forward(rec, Y, X, Wt, None, M=M, N=Di, K=R, ldx=W, x_col=4)
        assert rec.dispatches > 1
        rec.submit()
    np.testing.assert_allclose(rt.read(Y), xdbl[:, 4:4 + R] @ w.T, rtol=1e-5, atol=1e-5)


def test_embedding_by_vocabulary_and_row_ranges(rt, monkeypatch):
    rng = np.random.default_rng(2)
    V, E, M = 300, 24, 300
    w = rng.standard_normal((V, E)).astype(np.float32)
    ids = rng.integers(0, V, M).astype(np.int32)
    ids[[3, 50]] = [-1, V + 5]  # outside the table: zero rows, no gradient
    dout = rng.standard_normal((M, E)).astype(np.float32)
    W, I, D = rt.upload(w), rt.upload(ids, "i32"), rt.upload(dout)
    out = rt.upload(np.full((M, E), 7.0, np.float32))
    dw = rt.upload(np.ones((V, E), np.float32))
    back = EmbeddingBackward(rt, M)
    back.prepare(ids)
    with checked_limits(rt, monkeypatch, KIB4) as seen:
        rec = rt.recorder()
        embedding_forward(rec, out, I, W)
        back.record(rec, dw, D)
        rec.submit()
    assert seen["dispatches"] > 2
    want = np.where(((ids >= 0) & (ids < V))[:, None], w[np.clip(ids, 0, V - 1)], 0.0)
    np.testing.assert_array_equal(rt.read(out), want)
    dref = np.ones((V, E))
    for m, t in enumerate(ids):
        if 0 <= t < V:
            dref[t] += dout[m]
    np.testing.assert_allclose(rt.read(dw), dref, rtol=1e-5, atol=1e-5)


def test_store_takes_several_buffers(rt):
    shapes = {"a": (1000,), "b": (3, 300), "c": (7,), "d": (2000,)}
    where, sizes = store_layout(shapes, rt.storage_align // 4, 8192)
    assert len(sizes) == 2 and where["d"] == (1, 0)
    with pytest.raises(MemengineError, match="tensor d needs 7.8 KiB in one GPU buffer but the adapter.s largest buffer is 5.9 KiB"):
        store_layout(shapes, rt.storage_align // 4, 6000)
    with rt.forced_limits(buffer=8192):
        st = FlatStore(rt, shapes, "t")
        assert len(st.segments) == 2
        rng = np.random.default_rng(3)
        vals = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
        st.write(vals)
        got = st.read()
        for k in shapes:
            np.testing.assert_array_equal(got[k].reshape(shapes[k]), vals[k])
            np.testing.assert_array_equal(rt.read(st.views[k]), vals[k])


def test_selective_scan_by_sequence_ranges(rt, monkeypatch):
    """Forward and backward over ranges of whole sequences when a batch's windows exceed
    the binding (one sequence each here), against the numpy and torch float64 oracles of
    test_scan.py; the ACC gradients (dt_bias, A_log, D) add up over the ranges."""
    from test_scan import gpu_forward, make_inputs, oracle_forward, relerr, run_backward

    shape = (3, 300, 19, 5, 2)  # B, L, Di, N, R: xz is 45 KiB a sequence
    p = make_inputs(*shape, seed=11)
    with checked_limits(rt, monkeypatch, 64 * 1024) as seen:
        got, _, _ = gpu_forward(rt, p, *shape)
        assert seen.get("selective_scan_forward", 0) + seen.get("scan_lanes_forward", 0) == 3  # one per sequence
        errs = run_backward(rt, p, *shape)
    assert relerr(got, oracle_forward(p, *shape)) < 1e-4
    for k, v in errs.items():
        assert v < 2e-4, (k, v)


def test_split_k_inside_row_blocks(rt, monkeypatch):
    """A long-K product whose A does not fit the binding: row blocks, each on the split-K
    path (its partial products sized to the binding too), accumulated into C."""
    from memengine.engine.runtime import Recorder

    M, N, K = 48, 8, 4096
    rng = np.random.default_rng(5)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    c0 = rng.standard_normal((M, N)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    ref = a.astype(np.float64) @ b + bias + c0
    entries = []
    monkeypatch.setattr(rt.kernels, "matmul", "tiles")   # split-K is matmul_fast's (matmul_lanes never splits)
    with checked_limits(rt, monkeypatch, 256 * 1024):
        inner = Recorder.dispatch

        def counted(self, shader, entry, *args, **kw):
            entries.append(entry)
            return inner(self, shader, entry, *args, **kw)

        monkeypatch.setattr(Recorder, "dispatch", counted)
        got, _ = _mm(rt, a, b, c0, bias, M, N, K, False, False, True)
    assert entries.count("matmul_splitk_reduce") == 4 and entries.count("matmul_fast") == 4, entries
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < 1e-5, err


def test_cross_entropy_eval_hits_in_row_ranges(rt, monkeypatch):
    """Evaluation's top-1/top-5 hits when the logits exceed one binding (row ranges) equal
    numpy's ranks (a target is a top-k hit when fewer than k logits are strictly greater)."""
    from memengine.engine.kernels.cross_entropy import cross_entropy

    rng = np.random.default_rng(7)
    Mc, V = 37, 300                       # 1200-byte rows: 3 rows per 4 KiB binding
    logits = rng.standard_normal((Mc, V)).astype(np.float32)
    order = np.argsort(-logits, axis=1)   # targets of every rank class: top 1, top 5, neither
    targets = order[np.arange(Mc), rng.choice([0, 0, 2, 4, 5, 100], Mc)].astype(np.int32)
    rank = (logits > logits[np.arange(Mc), targets][:, None]).sum(1)
    lg = rt.upload(logits)
    tg = rt.upload(targets, "i32")
    scale = rt.upload(np.array([1.0], np.float32))
    loss = rt.empty((Mc,))
    hits = rt.zeros((2 * Mc,))
    with checked_limits(rt, monkeypatch, KIB4) as seen:
        rec = rt.recorder()
        cross_entropy(rec, loss, lg, tg, scale, want_grad=False, hits=(hits.view((Mc,)), hits.view((Mc,), Mc)))
        rec.submit()
    assert seen["dispatches"] > 1
    got = rt.read(hits)
    assert 0 < (rank < 1).sum() < (rank < 5).sum() < Mc
    np.testing.assert_array_equal(got[:Mc], (rank < 1).astype(np.float32))
    np.testing.assert_array_equal(got[Mc:], (rank < 5).astype(np.float32))
    ref = -(logits[np.arange(Mc), targets] - np.log(np.exp(logits.astype(np.float64)).sum(1)))
    np.testing.assert_allclose(rt.read(loss), ref, rtol=1e-5)
