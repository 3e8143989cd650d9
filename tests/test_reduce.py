"""Deterministic two-stage reductions (engine/ops/reduce.py) against numpy float64."""

import numpy as np
import pytest
from memengine.engine.kernels.reduce import sum_into, sumsq_into
from memengine.engine.runtime import Tensor

SIZES = [1, 2, 255, 256, 257, 65536, 65537, 1_000_003]   # multiples of 4 take reduce_partial4



def _run(rt, fn, out, x, **kw):
    rec = rt.recorder()
    fn(rec, out, x, **kw)
    rec.submit()
    return rt.read(out)


def _data(n, seed):
    # non-zero mean so that a lost / duplicated workgroup partial shows up clearly
    return (np.random.default_rng(seed).standard_normal(n) + 0.25).astype(np.float32)


def _check_sum(got, x, start=0.0, scale=1.0):
    want = start + scale * x.astype(np.float64).sum()
    tol = 1e-6 * abs(scale) * np.abs(x.astype(np.float64)).sum() + 1e-6 * abs(start) + 1e-7
    assert abs(float(got) - want) <= tol, (float(got), want, tol)


@pytest.mark.parametrize("n", SIZES)
def test_sum_and_sumsq_match_numpy(rt, n):
    x = _data(n, n)
    xt = rt.upload(x)
    out = rt.upload(np.array([3.0], np.float32))  # ACC: adds into the existing value
    got = _run(rt, sum_into, out, xt)[0]
    _check_sum(got, x, start=3.0)

    out2 = rt.zeros((1,))
    got2 = _run(rt, sumsq_into, out2, xt)[0]
    want2 = (x.astype(np.float64) ** 2).sum()
    assert abs(float(got2) - want2) <= 1e-6 * want2, (got2, want2)
    rt.free(xt)


@pytest.mark.parametrize("n", [257, 65537, 1_000_003])
def test_offset_views_and_scales(rt, n):
    """x is a view at an unaligned and at an aligned element offset inside a buffer whose other
    elements are huge: anything read outside the view ruins the sum."""
    al = int(rt.limits.get("min-storage-buffer-offset-alignment", 256)) // 4
    for off in (37, 2 * al):
        buf = np.full(n + off + 300, 1e6, np.float32)
        x = _data(n, n + off)
        buf[off:off + n] = x
        bt = rt.upload(buf)
        view = bt.view((n,), off)
        # out and the scale tensor are views too
        ob = rt.upload(np.array([9e9, 9e9, 9e9, 0.5, 9e9], np.float32))
        out = ob.view((1,), 3)
        st_buf = rt.upload(np.array([7.0, -2.0], np.float32))
        st = st_buf.view((1,), 1)
        got = _run(rt, sum_into, out, view, scale=0.5, scale_tensor=st)
        _check_sum(got[0], x, start=0.5, scale=-1.0)
        np.testing.assert_array_equal(rt.read(ob)[[0, 1, 2, 4]], np.float32(9e9))

        out2 = rt.zeros((1,))
        got = _run(rt, sumsq_into, out2, view)[0]
        want = (x.astype(np.float64) ** 2).sum()
        assert abs(float(got) - want) <= 1e-6 * want
        for t in (bt, ob, st_buf, out2):
            rt.free(t)


def test_deterministic_and_no_allocation_per_call(rt):
    x = _data(1_000_003, 11)
    xt = rt.upload(x)
    out = rt.zeros((1,))
    _run(rt, sum_into, out, xt)
    nbytes, nuni = rt.bytes_allocated, len(rt._uniforms)
    results = []
    for _ in range(3):
        rec = rt.recorder()
        rec.clear(out)
        sum_into(rec, out, xt)
        sumsq_into(rec, out, xt)
        rec.submit()
        results.append(rt.read(out).view(np.uint32)[0])
    assert len(set(results)) == 1, results
    assert rt.bytes_allocated == nbytes and len(rt._uniforms) == nuni
    rt.free(xt)


def test_more_than_2_pow_24_elements(rt):
    """> 16.7M elements: u32 indexing and accuracy where a sequential f32 sum would stall."""
    n = (1 << 24) + 1001
    x = np.ones(n, np.float32)
    x[::3] = 2.0
    xt = rt.upload(x)
    out = rt.zeros((1,))
    got = _run(rt, sum_into, out, xt)[0]
    want = x.astype(np.float64).sum()
    assert abs(float(got) - want) <= 4.0, (got, want)  # f32 spacing at 2.2e7 is 2
    rt.free(xt)


def test_input_larger_than_one_binding_is_split(rt, monkeypatch):
    """Pretend storage bindings are tiny: x is reduced in several stage-1 pieces that write
    disjoint partial ranges (the path used for > max-binding inputs)."""
    n = 100_007
    buf = np.full(n + 50, 1e6, np.float32)
    x = _data(n, 3)
    buf[13:13 + n] = x
    bt = rt.upload(buf)
    monkeypatch.setattr(rt, "max_binding", 64 * 1024)
    out = rt.zeros((1,))
    got = _run(rt, sum_into, out, Tensor(bt.buffer, (n,), "f32", 13 * 4))[0]
    _check_sum(got, x)
    monkeypatch.undo()
    out2 = rt.zeros((1,))
    got2 = _run(rt, sum_into, out2, Tensor(bt.buffer, (n,), "f32", 13 * 4))[0]
    _check_sum(got2, x)
    rt.free(bt)
