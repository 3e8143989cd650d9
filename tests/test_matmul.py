"""The matmul kernels against numpy, and the fast kernels (matmul_fast's tiles; matmul_lanes
where the adapter is a CPU with 8-lane subgroups) against the plain reference."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from memengine.engine.kernels import matmul as mm
from memengine.engine.kernels.lanes import cpu_lanes


def run(rt, mode, a, b, c0, bias, M, N, K, ta, tb, acc=True, **kw):
    old = rt.kernels.matmul
    rt.kernels.matmul = mode
    try:
        A, B, C = rt.upload(a), rt.upload(b), rt.upload(c0)
        Bi = rt.upload(bias) if bias is not None else None
        rec = rt.recorder()
        mm.matmul(rec, C, A, B, M=M, N=N, K=K, trans_a=ta, trans_b=tb, acc=acc, bias=Bi, **kw)
        rec.submit()
        n = len(rt._pipelines)
        return rt.read(C), n
    finally:
        rt.kernels.matmul = old


@pytest.mark.parametrize("M,N,K", [(1, 4, 4), (132, 76, 68), (300, 260, 64), (8, 128, 1536), (7, 37, 13),
                                   (256, 19, 96), (130, 3, 250)])   # (CPU: matmul_lanes_any)
@pytest.mark.parametrize("ta,tb", list(itertools.product([False, True], [False, True])))
def test_fast_and_reference_match_numpy(rt, M, N, K, ta, tb):
    rng = np.random.default_rng(M * 7 + N)
    a = rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32)
    b = rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32)
    c0 = rng.standard_normal((M, N)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    ref = (a.T if ta else a).astype(np.float64) @ (b.T if tb else b) + bias + c0
    plain, _ = run(rt, "reference", a, b, c0, bias, M, N, K, ta, tb)
    e_plain = np.abs(plain - ref).max() / np.abs(ref).max()
    assert e_plain < 1e-5
    for mode in ("auto", "tiles"):   # auto: matmul_lanes where it runs, else the same tiles
        fast, _ = run(rt, mode, a, b, c0, bias, M, N, K, ta, tb)
        e_fast = np.abs(fast - ref).max() / np.abs(ref).max()
        e_pair = np.abs(fast - plain).max() / np.abs(ref).max()
        print(f"\n{M}x{N}x{K} ta={ta} tb={tb} {mode}: fast {e_fast:.1e} plain {e_plain:.1e} "
              f"fast-vs-plain {e_pair:.1e}")
        assert e_fast < 1e-5 and e_pair < 1e-5


@pytest.mark.parametrize("acc,with_bias", [(False, False), (False, True), (True, False)])
def test_epilogue_flags_match_numpy(rt, acc, with_bias):
    """The store flags (accumulate, bias) in every combination (matmul_lanes takes them as
    pipeline constants); the test above covers both on."""
    rng = np.random.default_rng(3)
    M, N, K = 70, 44, 36
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    c0 = rng.standard_normal((M, N)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32) if with_bias else None
    ref = a.astype(np.float64) @ b + (bias if with_bias else 0) + (c0 if acc else 0)
    for mode in ("auto", "tiles", "reference"):
        got, _ = run(rt, mode, a, b, c0, bias, M, N, K, False, False, acc=acc)
        assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5, mode


def test_fast_path_is_taken_for_aligned_shapes(rt):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 32)).astype(np.float32)
    b = rng.standard_normal((32, 16)).astype(np.float32)
    A, B, C = rt.upload(a), rt.upload(b), rt.empty((64, 16))
    rec = rt.recorder()
    mm.matmul(rec, C, A, B, M=64, N=16, K=32)
    rec.submit()
    want = ("matmul", "matmul_lanes") if cpu_lanes(rt) else ("matmul", "matmul_fast")
    assert any(k[:2] == want for k in rt._pipelines)
    np.testing.assert_allclose(rt.read(C), a @ b, rtol=1e-5, atol=1e-5)


def test_lanes_kernel_runs_on_cpu_adapters(rt):
    """On a CPU adapter with subgroups (lavapipe) the probe finds the 8 lanes matmul_lanes needs."""
    if "cpu" not in rt.adapter_type.lower() or not rt.has_subgroups:
        pytest.skip(f"matmul_lanes is for CPU adapters with subgroups; this is {rt.describe()}")
    assert cpu_lanes(rt)


def test_column_slices_and_strides(rt):
    """x_proj's dt columns feed dt_proj through a strided view; dX lands in a column slice."""
    rng = np.random.default_rng(1)
    M, R, W, Di = 20, 8, 40, 12
    xdbl = rng.standard_normal((M, W)).astype(np.float32)
    w = rng.standard_normal((Di, R)).astype(np.float32)
    for mode in ("auto", "tiles", "reference"):
        rt.kernels.matmul = mode
        try:
            X, Wt, Y = rt.upload(xdbl), rt.upload(w), rt.empty((M, Di))
            rec = rt.recorder()
            mm.linear_forward(rec, Y, X, Wt, None, M=M, N=Di, K=R, ldx=W, x_col=4)
            rec.submit()
            np.testing.assert_allclose(rt.read(Y), xdbl[:, 4:4 + R] @ w.T, rtol=1e-5, atol=1e-5)
        finally:
            rt.kernels.matmul = "auto"


@pytest.mark.parametrize("M,N,K,ta", [(80, 24, 4096, True), (48, 96, 2056, False), (130, 36, 3000, True)])
def test_split_k_matches_numpy_and_reference(rt, M, N, K, ta):
    """Weight-gradient shapes (few output tiles, long K) take the split-K path."""
    rng = np.random.default_rng(K)
    a = rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    c0 = rng.standard_normal((M, N)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    ref = (a.T if ta else a).astype(np.float64) @ b + bias + c0
    split, _ = run(rt, "tiles", a, b, c0, bias, M, N, K, ta, False)
    assert ("matmul", "matmul_splitk_reduce", ()) in rt._pipelines
    whole, _ = run(rt, "nosplit", a, b, c0, bias, M, N, K, ta, False)
    plain, _ = run(rt, "reference", a, b, c0, bias, M, N, K, ta, False)
    errs = [float(np.abs(x - ref).max() / np.abs(ref).max()) for x in (split, whole, plain)]
    print(f"\nsplit-K {M}x{N}x{K}: split {errs[0]:.1e} fast {errs[1]:.1e} plain {errs[2]:.1e}")
    assert max(errs) < 1e-5


def test_split_counts_are_the_ones_measured_fastest_on_the_h200():
    """The split-K estimate picks, for the products of a mamba-130m step at B 8, L 2048, the
    slice count that ran fastest when each was timed at 1-48 slices on the H200
    (benchmarks/results/h200/diagnostics/splitk_probe.txt); the products with many output
    tiles stay whole."""

    class Lim:
        max_binding = 2**31

    measured_best = {(1280, 768, 50280): 22, (768, 1536, 16384): 11, (3072, 768, 16384): 11,
                     (1536, 48, 16384): 22, (80, 1536, 16384): 22, (16384, 80, 1536): 2}
    for (M, N, K), s in measured_best.items():
        assert mm.splitk_slices(Lim, M, N, K)[0] == s, (M, N, K)
    for M, N, K in [(16384, 3072, 768), (16384, 768, 1536), (1280, 50280, 768), (50280, 768, 1280),
                    (16384, 1536, 768), (16384, 768, 3072), (16384, 1536, 48), (16384, 1536, 80)]:
        assert mm.splitk_slices(Lim, M, N, K) == (1, K), (M, N, K)


# every tile configuration matmul_fast may run with (fast_config's and the benchmarks')
CONFIGS = [
    dict(BM=128, BN=128, BK=16),
    dict(BM=80, BN=128, BK=16),     # x_proj's weight gradient (M 80)
    dict(BM=64, BN=128, BK=16),     # the smallest BM (bias gradients, M 1)
    dict(BM=128, BN=64, BK=16),     # dt_proj's weight and input gradients (N 48)
]


def test_fast_config_choices_are_covered(rt):
    """fast_config's picks for a model's products are among the tested configurations."""
    shapes = [(16384, 3072, 768), (80, 1536, 16384), (1536, 48, 16384), (16384, 48, 1536), (1, 96, 4096)]
    tested = [{**mm.BASE, **c} for c in CONFIGS]
    for M, N, K in shapes:
        assert mm.fast_config(rt, M, N, K) in tested, (M, N, K)


@pytest.mark.parametrize("offsets", [0, 1])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "{BM}x{BN}x{BK}".format(**c))
def test_every_tile_configuration_matches_numpy(rt, cfg, offsets):
    """Each configuration on partial tiles, all four transpose cases and a split-K product,
    with either form of the tile loads (matmul.py picks the offset form where A^T)."""
    cfg = {**mm.BASE, **cfg, "OFFSETS": offsets}
    assert mm.valid_config(cfg)
    rng = np.random.default_rng(5)
    old = rt.kernels.matmul_tiles
    rt.kernels.matmul_tiles = cfg
    try:
        for (M, N, K), (ta, tb) in zip([(132, 84, 68), (40, 136, 36), (72, 20, 100), (96, 56, 2100)],
                                       itertools.product([False, True], [False, True])):
            a = rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32)
            b = rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32)
            c0 = rng.standard_normal((M, N)).astype(np.float32)
            bias = rng.standard_normal(N).astype(np.float32)
            ref = (a.T if ta else a).astype(np.float64) @ (b.T if tb else b) + bias + c0
            got, _ = run(rt, "tiles", a, b, c0, bias, M, N, K, ta, tb)
            consts = {**cfg, "TA": int(ta), "TB": int(tb)}   # the layouts as constants
            assert ("matmul", "matmul_fast", tuple(sorted((k, int(v)) for k, v in consts.items()))) in rt._pipelines
            assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5, (M, N, K, ta, tb)
    finally:
        rt.kernels.matmul_tiles = old


def test_modules_with_and_without_naga_checks_give_the_same_bits(rt, monkeypatch):
    """Modules are compiled without naga's run-time checks (index clamps, loop counters);
    MEMENGINE_SHADER_CHECKS=1 puts them back. In-range kernels give the same bits both ways
    (every kernel a product may take on this adapter, on partial tiles)."""
    import os

    from memengine.engine import runtime as gpu

    assert not rt.shader_checks
    monkeypatch.setenv(gpu.ENV_SHADER_CHECKS, "1")
    checked = gpu.Runtime(os.environ.get("MEMENGINE_DEVICE", "auto"))
    assert checked.shader_checks
    made = []
    real = checked.device.create_shader_module
    monkeypatch.setattr(checked.device, "create_shader_module", lambda **k: made.append(k["label"]) or real(**k))
    rng = np.random.default_rng(11)
    M, N, K = 132, 84, 68
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((N, K)).astype(np.float32)
    c0 = rng.standard_normal((M, N)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    for mode in ("auto", "tiles", "reference"):
        ours, _ = run(rt, mode, a, b, c0, bias, M, N, K, False, True)
        theirs, _ = run(checked, mode, a, b, c0, bias, M, N, K, False, True)
        np.testing.assert_array_equal(ours, theirs, err_msg=mode)
    assert "matmul" in made   # the checked runtime took the ordinary path
