"""Selective scan kernels vs a numpy float64 sequential oracle (forward) and torch float64
autograd of the same formula (backward).  The kernels have one path each; the backward's
channel sums run with and without subgroups."""

import numpy as np
import pytest
import torch
from memengine.engine.kernels import scan as scan_mod
from memengine.engine.kernels.scan import CHUNK, scan_state_shape, selective_scan_backward, selective_scan_forward

SHAPES = [  # B, L, Di, N, R
    (1, 1, 37, 5, 3),
    (2, 7, 37, 16, 4),
    (3, 300, 19, 5, 2),     # several chunks, a partial last one
    (1, 130, 40, 16, 1),    # R % 4 != 0: the 8-lane scan reads Bm|Cm as scalars (BC4 0)
    (2, 129, 33, 16, 8),    # last chunk of one step, odd Di (a partial channel block)
    (1, 70, 20, 21, 2),     # more states than one pass over workgroup memory holds (16)
    (1, 9, 17, 300, 2),     # state_size beyond any model's: scan.MAX_N is None
    (2, 200, 13, 8, 4),     # the 8-lane scan's state sizes (N <= 16, N % 4 == 0): 8 and 4,
    (1, 65, 9, 4, 4),       # two blocks of 8 channels, the second with one live lane
    (1, 70, 11, 12, 4),     # 12: three of the 8-lane scan's four groups of states
    (1, 90, 24, 8, 3),      # E 48's time_step_rank (3): Bm|Cm as scalars, rows at odd offsets
]
def make_inputs(B, L, Di, N, R, seed=0, scale_delta=1.0, bias_shift=0.0):
    rng = np.random.default_rng(seed)
    M = B * L
    return dict(
        u=rng.standard_normal((M, Di)),
        delta=rng.standard_normal((M, Di)) * scale_delta,
        dt_bias=rng.standard_normal(Di) * 0.5 - 2.0 + bias_shift,
        A_log=np.log(rng.uniform(0.5, 8.0, (Di, N))),
        D=rng.standard_normal(Di),
        xdbl=rng.standard_normal((M, R + 2 * N)),
        xz=rng.standard_normal((M, 2 * Di)) * 2.0,
    )


def softplus_np(x):
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))


def oracle_forward(p, B, L, Di, N, R):
    dt = softplus_np(p["delta"] + p["dt_bias"]).reshape(B, L, Di)
    A = -np.exp(p["A_log"])
    u = p["u"].reshape(B, L, Di)
    Bm = p["xdbl"][:, R:R + N].reshape(B, L, N)
    Cm = p["xdbl"][:, R + N:].reshape(B, L, N)
    z = p["xz"][:, Di:].reshape(B, L, Di)
    y = np.zeros((B, L, Di))
    for b in range(B):
        s = np.zeros((Di, N))
        for t in range(L):
            s = np.exp(dt[b, t][:, None] * A) * s + (dt[b, t] * u[b, t])[:, None] * Bm[b, t][None, :]
            y[b, t] = s @ Cm[b, t] + p["D"] * u[b, t]
    y = y * (z / (1 + np.exp(-z)))
    return y.reshape(B * L, Di)


def torch_forward(p, B, L, Di, N, R):
    dt = torch.nn.functional.softplus(p["delta"] + p["dt_bias"]).reshape(B, L, Di)
    A = -torch.exp(p["A_log"])
    u = p["u"].reshape(B, L, Di)
    Bm = p["xdbl"][:, R:R + N].reshape(B, L, N)
    Cm = p["xdbl"][:, R + N:].reshape(B, L, N)
    z = p["xz"][:, Di:].reshape(B, L, Di)
    s = torch.zeros(B, Di, N, dtype=torch.float64)
    ys = []
    for t in range(L):
        s = torch.exp(dt[:, t, :, None] * A) * s + (dt[:, t] * u[:, t])[:, :, None] * Bm[:, t, None, :]
        ys.append(torch.einsum("bdn,bn->bd", s, Cm[:, t]) + p["D"] * u[:, t])
    y = torch.stack(ys, 1) * torch.nn.functional.silu(z)
    return y.reshape(B * L, Di)


def relerr(got, want):
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def gpu_forward(rt, p, B, L, Di, N, R):
    t = {k: rt.upload(v.astype(np.float32)) for k, v in p.items()}
    y = rt.upload(np.full((B * L, Di), np.nan, np.float32))        # every element must be written
    states = rt.upload(np.full(scan_state_shape(B, L, Di, N), np.nan, np.float32))
    rec = rt.recorder()
    selective_scan_forward(rec, y, states, t["u"], t["delta"], t["dt_bias"], t["A_log"], t["D"],
                           t["xdbl"], t["xz"], B=B, L=L, Di=Di, N=N, R=R)
    rec.submit()
    return rt.read(y).astype(np.float64), t, states


@pytest.fixture(params=["lanes", "parallel"])
def forward_kernel(request, monkeypatch, rt):
    """the 8-lane scan (scan_lanes_*) where it runs (CPU adapters with 8-lane subgroups, N <= 16 and
    N % 4 == 0; elsewhere the parallel kernel again) and the parallel kernel."""
    monkeypatch.setattr(rt.kernels, "scan_lanes", request.param == "lanes")
    return request.param


@pytest.mark.parametrize("shape", SHAPES)
def test_forward_vs_numpy(rt, shape, forward_kernel):
    p = make_inputs(*shape, seed=sum(shape))
    want = oracle_forward(p, *shape)
    got, _, _ = gpu_forward(rt, p, *shape)
    e = relerr(got, want)
    print(f"forward {shape}: vs numpy float64 {e:.2e}")
    assert np.all(np.isfinite(got)) and e < 1e-4


@pytest.fixture(params=[True, False], ids=["subgroups", "workgroup-memory"])
def subgroups(request, monkeypatch, rt):
    """The parallel backward's channel sums through subgroup shuffles (where the adapter has
    them; lavapipe's subgroups of 8 take the shuffles for 3 of the 4 butterfly stages) and
    through workgroup memory only."""
    monkeypatch.setattr(rt.kernels, "scan_lanes", False)
    monkeypatch.setattr(rt.kernels, "scan_subgroups", request.param)
    return request.param


@pytest.fixture(params=["lanes", "subgroups", "workgroup-memory"])
def kernel(request, monkeypatch, rt):
    """Every backward: the 8-lane scan (where it runs; elsewhere the next one again),
    the parallel kernel with the channel sums through subgroup shuffles, and through
    workgroup memory only."""
    monkeypatch.setattr(rt.kernels, "scan_lanes", request.param == "lanes")
    monkeypatch.setattr(rt.kernels, "scan_subgroups", request.param != "workgroup-memory")
    return request.param


def run_backward(rt, p, B, L, Di, N, R, seed=1, raw=False, in_place=False):
    rng = np.random.default_rng(seed)
    M = B * L
    _, t, states = gpu_forward(rt, p, B, L, Di, N, R)
    dy = rng.standard_normal((M, Di))
    pre = {k: rng.standard_normal(s) for k, s in (("ddt_bias", (Di,)), ("dA_log", (Di, N)), ("dD", (Di,)))}
    SENT = 12345.0
    g = {k: rt.upload(v.astype(np.float32)) for k, v in pre.items()}
    g["du"] = rt.upload(np.full((M, Di), SENT, np.float32))
    g["ddelta"] = rt.upload(np.full((M, Di), SENT, np.float32))
    g["dxdbl"] = rt.upload(np.full((M, R + 2 * N), SENT, np.float32))
    g["dxz"] = rt.upload(np.full((M, 2 * Di), SENT, np.float32))
    tdy = rt.upload(dy.astype(np.float32))
    if in_place:   # dy given in du itself, as the model passes it
        rt.write(g["du"], dy.astype(np.float32))
        tdy = g["du"]
    rec = rt.recorder()
    selective_scan_backward(rec, g["du"], g["ddelta"], g["ddt_bias"], g["dA_log"], g["dD"], g["dxdbl"],
                            g["dxz"], tdy, states, t["u"], t["delta"], t["dt_bias"], t["A_log"], t["D"],
                            t["xdbl"], t["xz"], B=B, L=L, Di=Di, N=N, R=R)
    rec.submit()
    got = {k: rt.read(v).astype(np.float64) for k, v in g.items()}
    assert np.all(got["dxdbl"][:, :R] == SENT), "dxdbl columns 0..R must be untouched"
    assert np.all(got["dxz"][:, :Di] == SENT), "dxz columns 0..Di must be untouched"
    if raw:
        return got

    # torch autograd oracle on float32-rounded inputs
    tp = {k: torch.tensor(v.astype(np.float32).astype(np.float64), requires_grad=True) for k, v in p.items()}
    yt = torch_forward(tp, B, L, Di, N, R)
    yt.backward(torch.tensor(dy.astype(np.float32).astype(np.float64)))
    want = {k: v.grad.numpy() for k, v in tp.items()}

    errs = {
        "du": relerr(got["du"], want["u"]),
        "ddelta": relerr(got["ddelta"], want["delta"]),
        "ddt_bias": relerr(got["ddt_bias"] - pre["ddt_bias"].astype(np.float32), want["dt_bias"]),
        "dA_log": relerr(got["dA_log"] - pre["dA_log"].astype(np.float32), want["A_log"]),
        "dD": relerr(got["dD"] - pre["dD"].astype(np.float32), want["D"]),
        "dBC": relerr(got["dxdbl"][:, R:], want["xdbl"][:, R:]),
        "dz": relerr(got["dxz"][:, Di:], want["xz"][:, Di:]),
    }
    return errs


@pytest.mark.parametrize("shape", SHAPES)
def test_backward_vs_torch(rt, shape, kernel):
    p = make_inputs(*shape, seed=sum(shape) + 7)
    errs = run_backward(rt, p, *shape)
    print(f"backward {shape} {kernel}: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    for k, v in errs.items():
        assert v < 2e-4, (k, v)


def test_backward_in_place(rt, kernel):
    """dy given in du (read there, overwritten by du): the same bits as dy in its own tensor."""
    shape = (2, 70, 21, 16, 3)
    p = make_inputs(*shape, seed=5)
    apart = run_backward(rt, p, *shape, raw=True)
    inside = run_backward(rt, p, *shape, raw=True, in_place=True)
    for k in apart:
        assert np.array_equal(apart[k], inside[k]), k


def test_large_inputs_stable(rt, kernel):
    """delta+bias far above softplus' threshold (20) and far below zero."""
    shape = (2, 33, 21, 16, 3)
    B, L, Di, N, R = shape
    p = make_inputs(*shape, seed=3, scale_delta=30.0)
    p["dt_bias"][: Di // 2] = 25.0     # dt huge: exp(dt*A) underflows to 0
    p["dt_bias"][Di // 2:] = -40.0     # dt ~ exp(-40)
    want = oracle_forward(p, *shape)
    got, _, _ = gpu_forward(rt, p, *shape)
    assert np.all(np.isfinite(got))
    e = relerr(got, want)
    print(f"large inputs forward: {e:.2e}")
    assert e < 1e-4
    errs = run_backward(rt, p, *shape)
    print("large inputs backward: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    for k, v in errs.items():
        assert np.isfinite(v) and v < 2e-4, (k, v)


def test_parameter_views_at_unaligned_offsets(rt):
    """dt_bias/A_log/D and their ACC gradients as views into flat buffers at odd offsets."""
    shape = (2, 9, 13, 3, 2)
    B, L, Di, N, R = shape
    M = B * L
    p = make_inputs(*shape, seed=11)
    t = {k: rt.upload(p[k].astype(np.float32)) for k in ("u", "delta", "xdbl", "xz")}
    offs = {"dt_bias": 3, "A_log": 3 + Di + 5, "D": 3 + Di + 5 + Di * N + 1}
    flat = np.zeros(offs["D"] + Di + 7, np.float32)
    for k, o in offs.items():
        flat[o:o + p[k].size] = p[k].ravel()
    fb = rt.upload(flat)
    for k, o in offs.items():
        t[k] = fb.view(p[k].shape, o)
    y = rt.empty((M, Di))
    states = rt.empty(scan_state_shape(B, L, Di, N))
    rec = rt.recorder()
    selective_scan_forward(rec, y, states, t["u"], t["delta"], t["dt_bias"], t["A_log"], t["D"], t["xdbl"], t["xz"],
                           B=B, L=L, Di=Di, N=N, R=R)
    rec.submit()
    e = relerr(rt.read(y), oracle_forward(p, *shape))
    print(f"views forward: {e:.2e}")
    assert e < 1e-4
    gflat = np.random.default_rng(5).standard_normal(flat.size).astype(np.float32)
    gb = rt.upload(gflat)
    gv = {k: gb.view(p[k].shape, o) for k, o in offs.items()}
    dy = np.random.default_rng(6).standard_normal((M, Di))
    outs = [rt.empty((M, Di)), rt.empty((M, Di)), gv["dt_bias"], gv["A_log"], gv["D"],
            rt.zeros((M, R + 2 * N)), rt.zeros((M, 2 * Di))]
    rec = rt.recorder()
    selective_scan_backward(rec, *outs, rt.upload(dy.astype(np.float32)), states, t["u"], t["delta"], t["dt_bias"],
                            t["A_log"], t["D"], t["xdbl"], t["xz"], B=B, L=L, Di=Di, N=N, R=R)
    rec.submit()
    got = rt.read(gb).astype(np.float64)
    tp = {k: torch.tensor(v.astype(np.float32).astype(np.float64), requires_grad=True) for k, v in p.items()}
    torch_forward(tp, *shape).backward(torch.tensor(dy.astype(np.float32).astype(np.float64)))
    want = gflat.astype(np.float64).copy()
    for k, o in offs.items():
        want[o:o + p[k].size] += tp[k].grad.numpy().ravel()
    e = relerr(got, want)
    print(f"views backward (flat gradient buffer): {e:.2e}")
    assert e < 1e-5


@pytest.mark.parametrize("shape", [(3, 300, 19, 5, 2), (2, 129, 33, 16, 3), (1, 70, 20, 21, 2)])
def test_forward_saved_states(rt, shape, forward_kernel):
    """The forward writes the true state before every chunk of CHUNK steps (the contract the
    backward and the decoder rely on)."""
    B, L, Di, N, R = shape
    p = make_inputs(*shape, seed=sum(shape) + 21)
    _, _, states = gpu_forward(rt, p, *shape)
    got = rt.read(states).astype(np.float64)
    dt = softplus_np(p["delta"].astype(np.float32).astype(np.float64) + p["dt_bias"].astype(np.float32)).reshape(B, L, Di)
    A = -np.exp(p["A_log"].astype(np.float32).astype(np.float64))
    u = p["u"].astype(np.float32).reshape(B, L, Di)
    Bm = p["xdbl"].astype(np.float32)[:, R:R + N].reshape(B, L, N)
    want = np.zeros_like(got)
    for b in range(B):
        s = np.zeros((Di, N))
        for t in range(L):
            if t % CHUNK == 0:
                want[b, t // CHUNK] = s
            s = np.exp(dt[b, t][:, None] * A) * s + (dt[b, t] * u[b, t])[:, None] * Bm[b, t][None, :]
    e = relerr(got, want)
    print(f"saved states {shape}: {e:.2e}")
    assert e < 1e-5


def test_butterfly_takes_subgroups_where_there_are_some(rt, subgroups):
    """The channel sums use subgroup shuffles across min(subgroup size, 16) lanes when the
    adapter has subgroups (lavapipe: 8) and workgroup memory otherwise or when told to."""
    shape = (1, 9, 20, 4, 2)
    run_backward(rt, make_inputs(*shape, seed=2), *shape, raw=True)
    lanes = scan_mod.butterfly_lanes(rt, *shape[:4])
    print(f"butterfly lanes: {lanes} (subgroups={subgroups}, adapter has them: {rt.has_subgroups})")
    if subgroups and rt.has_subgroups:
        assert lanes in (2, 4, 8, 16)
    else:
        assert lanes == 1


def test_lanes_kernels_run_on_cpu_adapters(rt, monkeypatch):
    """On a CPU adapter with 8-lane subgroups (lavapipe) the scans of eligible state sizes
    take the 8-lane scan, forward and backward."""
    from memengine.engine.kernels.lanes import cpu_lanes
    from memengine.engine.runtime import Recorder
    if not cpu_lanes(rt):
        pytest.skip(f"the 8-lane scan is for CPU adapters with 8-lane subgroups; this is {rt.describe()}")
    seen = []
    inner = Recorder.dispatch
    monkeypatch.setattr(Recorder, "dispatch", lambda self, sh, en, *a, **k: (seen.append(en), inner(self, sh, en, *a, **k)))
    shape = (1, 9, 20, 16, 4)
    run_backward(rt, make_inputs(*shape, seed=2), *shape, raw=True)
    assert "scan_lanes_forward" in seen and "scan_lanes_backward" in seen, seen
    assert "selective_scan_backward" not in seen
    seen.clear()   # Bm|Cm not at a multiple of 4 (R = 2): the 8-lane scan still (scalar loads)
    shape = (1, 9, 20, 16, 2)
    run_backward(rt, make_inputs(*shape, seed=2), *shape, raw=True)
    assert "scan_lanes_backward" in seen and "selective_scan_backward" not in seen, seen


def test_workgroup_memory_leaves_room_for_two_workgroups_an_sm():
    """The module's workgroup memory (the backward uses every array of it) stays at or under
    24 KiB: the H200's driver runs two of the backward's workgroups on an SM only
    then (benchmarks/results/h200/diagnostics/scan_occupancy.txt; 30 KiB ran one, 1.5x slower)."""
    import re
    from pathlib import Path

    text = (Path(scan_mod.__file__).parents[2] / "shaders" / "selective_scan.wgsl").read_text()
    size = {"f32": 4, "u32": 4, "vec2<f32>": 8, "vec4<f32>": 16}
    total = 0
    for kind, n in re.findall(r"^var<workgroup> \w+: array<([\w<>]+), (\d+)>;", text, re.M):
        total += size[kind] * int(n)
    total += 4 * len(re.findall(r"^var<workgroup> \w+: atomic<u32>;", text, re.M))
    assert total >= 20000, total   # the arrays were found
    assert total <= 24 * 1024, total
