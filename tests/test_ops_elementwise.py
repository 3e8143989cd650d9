"""Embedding, RMSNorm, causal conv1d+SiLU, SiLU/softplus and cross-entropy kernels
against numpy / torch float64 autograd.

Every test checks forward values, backward values, the ACC / WRITE contract (ACC outputs
are pre-filled with random data; WRITE outputs with garbage; untouched regions with a
sentinel) and runs with odd sizes.  Parameters and ACC gradients are placed as views at
unaligned offsets inside larger "flat" buffers, as the model does.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from memengine.engine.kernels import conv1d, lanes
from memengine.engine.kernels.activation import silu_backward, silu_forward, softplus_backward, softplus_forward
from memengine.engine.kernels.conv1d import conv1d_backward, conv1d_forward
from memengine.engine.kernels.cross_entropy import cross_entropy
from memengine.engine.kernels.embedding import EmbeddingBackward, embedding_forward
from memengine.engine.kernels.rmsnorm import rmsnorm_backward, rmsnorm_forward

SENTINEL = 12345.0



def _rng(seed):
    return np.random.default_rng(seed)


def _t64(a, grad=False):
    return torch.tensor(np.asarray(a), dtype=torch.float64, requires_grad=grad)


class Flat:
    """A flat buffer holding one array at an unaligned element offset, sentinel-filled
    around it, so that writes outside the view are caught."""

    def __init__(self, rt, arr, front=3, back=5):
        arr = np.ascontiguousarray(arr, np.float32)
        self.arr, self.front, self.back = arr, front, back
        full = np.full(front + arr.size + back, SENTINEL, np.float32)
        full[front:front + arr.size] = arr.reshape(-1)
        self.base = rt.upload(full)
        self.view = self.base.view(arr.shape, front)
        self.rt = rt

    def read(self):
        full = self.rt.read(self.base)
        assert np.all(full[:self.front] == SENTINEL), "write before the view"
        assert np.all(full[self.front + self.arr.size:] == SENTINEL), "write after the view"
        return full[self.front:self.front + self.arr.size].reshape(self.arr.shape)


def _check(name, got, want, atol, rtol=0.0):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    err = np.abs(got - want)
    rel = err / np.maximum(np.abs(want), 1e-30)
    print(f"{name:40s} max abs err {err.max() if err.size else 0:.3e}  max rel err {rel.max() if rel.size else 0:.3e}")
    assert np.all(np.isfinite(got)), name
    np.testing.assert_allclose(got, want, atol=atol, rtol=rtol, err_msg=name)


# ----------------------------------------------------------------------------- activations
ACT_X = np.concatenate([
    _rng(0).standard_normal(1237) * 6,
    [-100.0, -80.0, -30.0, -20.0, -17.0, -5.0, -1e-3, -1e-7, 0.0, 1e-7, 1e-3, 5.0, 19.99, 20.0, 20.01, 30.0, 88.0, 100.0],
]).astype(np.float32)



@pytest.fixture(params=["cpu", "cpu-tree", "gpu"])
def row_wg(request, monkeypatch, rt):
    """The invocations per row of rmsnorm and cross entropy as lanes.row_workgroup chooses
    them on CPU adapters (8 up to rows of 2048; where those 8 are one subgroup they sum by
    shuffles, `cpu-tree` through workgroup memory instead) and elsewhere (the shaders' sizes)."""
    monkeypatch.setattr(rt.kernels, "row_workgroup", request.param.split("-")[0])
    monkeypatch.setattr(rt.kernels, "row_subgroups", False if request.param == "cpu-tree" else None)
    return request.param

@pytest.mark.parametrize("kind", ["silu", "softplus"])
def test_activation_forward_backward(rt, kind):
    x = ACT_X
    n = x.size
    g = _rng(1).standard_normal(n).astype(np.float32)
    acc0 = _rng(2).standard_normal(n).astype(np.float32)
    fx = Flat(rt, x, front=1)
    out = Flat(rt, np.full(n, -7.0, np.float32), front=2)  # WRITE over garbage
    dx = Flat(rt, acc0, front=5)                            # ACC
    gt = rt.upload(g)
    fwd, bwd = (silu_forward, silu_backward) if kind == "silu" else (softplus_forward, softplus_backward)
    rec = rt.recorder()
    fwd(rec, out.view, fx.view)
    bwd(rec, dx.view, gt, fx.view)
    rec.submit()

    xt = _t64(x, grad=True)
    y = F.silu(xt) if kind == "silu" else F.softplus(xt, beta=1.0, threshold=20.0)
    y.backward(_t64(g))
    # softplus of very negative x is ~exp(x): relative accuracy matters there
    _check(f"{kind} forward", out.read(), y.detach().numpy(), atol=1e-6, rtol=2e-6)
    _check(f"{kind} backward (ACC)", dx.read() - acc0.astype(np.float64), xt.grad.numpy(), atol=2e-6, rtol=1e-5)


def test_softplus_stable_small_and_large(rt):
    x = np.array([-60.0, -25.0, -18.0, -12.0, -3.0, 25.0, 1e4, 3e38], np.float32)
    xt, out = rt.upload(x), rt.upload(np.zeros_like(x))
    rec = rt.recorder()
    softplus_forward(rec, out, xt)
    rec.submit()
    got = rt.read(out)
    want = F.softplus(_t64(x), threshold=20.0).numpy()
    # relative accuracy down to exp(-60) (a cancelling log(1 + e) is off by ~1% at x = -12);
    # the bound is exp()'s own accuracy on the GPU (Vulkan allows 3 + 2|x| ulp)
    _check("softplus extremes (relative)", got, want, atol=0.0, rtol=1e-5)


# ----------------------------------------------------------------------------- embedding
@pytest.mark.parametrize("M,V,E,front", [(70, 259, 37, 7), (1, 259, 37, 7), (300, 50, 130, 7),
                                         (70, 259, 64, 8)])
def test_embedding(rt, M, V, E, front):
    r = _rng(M + E)
    W = r.standard_normal((V, E)).astype(np.float32)
    ids = r.integers(0, min(V, 12), M).astype(np.int32)  # many repeated tokens
    ids[: min(M, 3)] = V - 1
    if M > 5:
        ids[5] = -1                                      # padding: zero row, no gradient
    if M > 6:
        ids[6] = V + 3                                   # outside the table: zero row, no gradient
    G = r.standard_normal((M, E)).astype(np.float32)
    DW0 = r.standard_normal((V, E)).astype(np.float32)
    w = Flat(rt, W, front=front)
    dw = Flat(rt, DW0, front=1)
    out = rt.upload(np.full((M, E), -3.0, np.float32))
    idt, gt = rt.upload(ids), rt.upload(G)
    eb = EmbeddingBackward(rt, M)
    # a first, different batch: prepare must fully replace the previous CSR
    eb.prepare(r.integers(0, V, M).astype(np.int32))
    eb.prepare(ids)
    rec = rt.recorder()
    embedding_forward(rec, out, idt, w.view)
    eb.record(rec, dw.view, gt)
    rec.submit()
    want = np.where(((ids >= 0) & (ids < V))[:, None], W[np.clip(ids, 0, V - 1)], 0.0)
    _check(f"embedding forward M={M} E={E}", rt.read(out), want, atol=0.0)

    wt = _t64(W, grad=True)
    keep = (ids >= 0) & (ids < V)
    F.embedding(torch.tensor(ids[keep], dtype=torch.long), wt).backward(_t64(G[keep]))
    got1 = dw.read()
    _check(f"embedding backward (ACC) M={M} E={E}", got1 - DW0.astype(np.float64), wt.grad.numpy(), atol=1e-5, rtol=1e-6)
    w.read()

    # deterministic (no atomics): two passes into zeroed buffers are bit-identical
    z1, z2 = rt.zeros((V, E)), rt.zeros((V, E))
    rec = rt.recorder()
    eb.record(rec, z1, gt)
    eb.record(rec, z2, gt)
    rec.submit()
    a1, a2 = rt.read(z1), rt.read(z2)
    assert np.array_equal(a1, a2)
    assert np.all(a1[np.setdiff1d(np.arange(V), ids[keep])] == 0.0), "gradient for a token not in the batch"


# ----------------------------------------------------------------------------- rmsnorm
def _rms_ref(X, W, G, eps):
    x, w = _t64(X, True), _t64(W, True)
    y = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    y.backward(_t64(G))
    rstd = 1.0 / np.sqrt((X.astype(np.float64) ** 2).mean(-1) + eps)
    return y.detach().numpy(), rstd, x.grad.numpy(), w.grad.numpy()


@pytest.mark.parametrize("M,E", [(70, 37), (1, 37), (513, 256), (5, 1000)])
def test_rmsnorm(rt, M, E, row_wg):
    r = _rng(M * 7 + E)
    eps = 1e-5
    X = (r.standard_normal((M, E)) * 2 + 0.3).astype(np.float32)
    W = r.standard_normal(E).astype(np.float32)
    G = r.standard_normal((M, E)).astype(np.float32)
    DX0 = r.standard_normal((M, E)).astype(np.float32)   # residual gradient already in dx
    DW0 = r.standard_normal(E).astype(np.float32)
    w, dw = Flat(rt, W, front=3), Flat(rt, DW0, front=6)
    xt, gt, dx = rt.upload(X), rt.upload(G), rt.upload(DX0)
    out, rstd = rt.upload(np.full((M, E), 9.0, np.float32)), rt.upload(np.full(M, 9.0, np.float32))
    copy = rt.upload(np.full((M, E), 7.0, np.float32))
    rec = rt.recorder()
    rmsnorm_forward(rec, out, rstd, xt, w.view, eps, copy=copy)
    rmsnorm_backward(rec, dx, dw.view, gt, xt, w.view, rstd)
    rec.submit()
    y, rs, gx, gw = _rms_ref(X, W, G, eps)
    np.testing.assert_array_equal(rt.read(copy), X)   # the residual stream's copy: the same bits
    _check(f"rmsnorm forward M={M} E={E}", rt.read(out), y, atol=2e-6, rtol=2e-6)
    _check(f"rmsnorm rstd M={M} E={E}", rt.read(rstd), rs, atol=0, rtol=2e-6)
    _check(f"rmsnorm dx (ACC) M={M} E={E}", rt.read(dx) - DX0.astype(np.float64), gx, atol=5e-6, rtol=1e-5)
    _check(f"rmsnorm dweight (ACC) M={M} E={E}", dw.read() - DW0.astype(np.float64), gw,
           atol=2e-6 * np.sqrt(M) * 4, rtol=1e-5)
    w.read()


def test_row_sums_by_shuffles_equal_the_tree_bit_for_bit(rt, monkeypatch):
    """8 invocations per row summing by subgroup shuffles (CPU adapters whose subgroup is 8)
    pair the values as the workgroup-memory tree does: the same bits, rmsnorm and cross
    entropy (max and sum)."""
    if not lanes.cpu_lanes(rt):
        pytest.skip(f"row sums by shuffles are for CPU adapters with 8-lane subgroups; this is {rt.describe()}")
    monkeypatch.setattr(rt.kernels, "row_workgroup", "cpu")
    r = _rng(11)
    M, E, V = 37, 200, 300
    X = (r.standard_normal((M, E)) * 3).astype(np.float32)
    W = r.standard_normal(E).astype(np.float32)
    L = (r.standard_normal((M, V)) * 4).astype(np.float32)
    T = r.integers(0, V, size=M).astype(np.int32)
    got = {}
    for sg in (None, False):
        monkeypatch.setattr(rt.kernels, "row_subgroups", sg)
        w = Flat(rt, W)
        xt, out, rstd = rt.upload(X), rt.empty((M, E)), rt.empty((M,))
        lg, tg, loss = rt.upload(L), rt.upload(T), rt.empty((M,))
        sc = rt.upload(np.ones(1, np.float32))
        rec = rt.recorder()
        rmsnorm_forward(rec, out, rstd, xt, w.view, 1e-5)
        cross_entropy(rec, loss, lg, tg, sc, want_grad=True)
        rec.submit()
        got[sg] = [rt.read(out), rt.read(rstd), rt.read(loss), rt.read(lg)]
    sg8 = [k for k in rt._pipelines if ("SG8", 1) in k[2]]
    # (the runtime's pipelines of the whole session: the gated norm's too, where it ran)
    assert {"rmsnorm", "cross_entropy"} <= {k[0] for k in sg8}, sg8
    for a, b in zip(got[None], got[False]):
        np.testing.assert_array_equal(a, b)


def test_rmsnorm_many_rows_grid_fold(rt):
    """M > 65535 rows: one workgroup per row must be folded into (x, y)."""
    M, E = 66000, 3
    r = _rng(5)
    X = r.standard_normal((M, E)).astype(np.float32)
    W = r.standard_normal(E).astype(np.float32)
    G = r.standard_normal((M, E)).astype(np.float32)
    xt, wt, gt = rt.upload(X), rt.upload(W), rt.upload(G)
    out, rstd, dx, dw = rt.zeros((M, E)), rt.zeros((M,)), rt.zeros((M, E)), rt.zeros((E,))
    rec = rt.recorder()
    rmsnorm_forward(rec, out, rstd, xt, wt, 1e-6)
    rmsnorm_backward(rec, dx, dw, gt, xt, wt, rstd)
    rec.submit()
    y, _, gx, gw = _rms_ref(X, W, G, 1e-6)
    _check("rmsnorm forward M=66000", rt.read(out), y, atol=5e-6, rtol=1e-5)
    _check("rmsnorm dx M=66000", rt.read(dx), gx, atol=1e-5, rtol=1e-4)
    _check("rmsnorm dweight M=66000", rt.read(dw), gw, atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("M,ld,col,E", [(9, 23, 5, 4), (130, 300, 0, 37), (3, 11, 10, 1)])
def test_rmsnorm_column_slice(rt, M, ld, col, E, row_wg):
    """The norm over columns col..col+E of [M, ld] matrices (falcon_mamba's dt/B/C norms):
    only that slice of out and dx is touched."""
    r = _rng(M + ld + col)
    eps = 1e-6
    X = r.standard_normal((M, ld)).astype(np.float32)
    W = r.standard_normal(E).astype(np.float32)
    G = r.standard_normal((M, ld)).astype(np.float32)
    DX0 = r.standard_normal((M, ld)).astype(np.float32)
    xt, gt, wt, dx, dw = rt.upload(X), rt.upload(G), rt.upload(W), rt.upload(DX0), rt.zeros((E,))
    out, rstd = rt.upload(np.full((M, ld), 9.0, np.float32)), rt.zeros((M,))
    copy = rt.upload(np.full((M, ld), 7.0, np.float32))
    rec = rt.recorder()
    rmsnorm_forward(rec, out, rstd, xt, wt, eps, col=col, ld=ld, copy=copy)
    rmsnorm_backward(rec, dx, dw, gt, xt, wt, rstd, col=col, ld=ld)
    rec.submit()
    sl = slice(col, col + E)
    y, rs, gx, gw = _rms_ref(X[:, sl], W, G[:, sl], eps)
    got_out, got_dx = rt.read(out), rt.read(dx)
    _check("rmsnorm slice forward", got_out[:, sl], y, atol=2e-6, rtol=2e-6)
    _check("rmsnorm slice rstd", rt.read(rstd), rs, atol=0, rtol=2e-6)
    _check("rmsnorm slice dx (ACC)", got_dx[:, sl] - DX0[:, sl].astype(np.float64), gx, atol=5e-6, rtol=1e-5)
    _check("rmsnorm slice dweight", rt.read(dw), gw, atol=1e-5, rtol=1e-5)
    rest = np.ones(ld, bool)
    rest[sl] = False
    assert np.all(got_out[:, rest] == 9.0) and np.array_equal(got_dx[:, rest], DX0[:, rest])
    got_copy = rt.read(copy)
    assert np.array_equal(got_copy[:, sl], X[:, sl]) and np.all(got_copy[:, rest] == 7.0)


# ----------------------------------------------------------------------------- conv1d
@pytest.fixture(params=[8, 128])
def conv_kernels(request, monkeypatch):
    """conv1d's workgroups of 8 lanes (CPU adapters) and of 128 (GPUs)."""
    monkeypatch.setattr(conv1d, "SEQ_WG", request.param)
    return request.param


@pytest.mark.parametrize("B,L,Di,K,bias", [
    (2, 5, 75, 4, True), (3, 1, 75, 3, False), (2, 33, 40, 4, True), (1, 2, 7, 4, False), (4, 129, 16, 3, True),
    (2, 200, 9, 7, True),   # windows across the 64-step pieces of the sequential kernels, the largest K
])
def test_conv1d(rt, B, L, Di, K, bias, conv_kernels):
    M = B * L
    r = _rng(B * 1000 + L * 10 + K)
    XZ = r.standard_normal((M, 2 * Di)).astype(np.float32)
    W = (r.standard_normal((Di, K)) * 0.7).astype(np.float32)
    Bi = r.standard_normal(Di).astype(np.float32)
    G = r.standard_normal((M, Di)).astype(np.float32)
    DXZ0 = np.full((M, 2 * Di), SENTINEL, np.float32)
    DXZ0[:, :Di] = -5.0                                    # WRITE over garbage
    DW0 = r.standard_normal((Di, K)).astype(np.float32)
    DB0 = r.standard_normal(Di).astype(np.float32)

    w, b = Flat(rt, W, front=1), Flat(rt, Bi, front=2)
    dw, db = Flat(rt, DW0, front=3), Flat(rt, DB0, front=4)
    xz, gt, dxz = rt.upload(XZ), rt.upload(G), rt.upload(DXZ0)
    out, pre = rt.upload(np.full((M, Di), 8.0, np.float32)), rt.upload(np.full((M, Di), 8.0, np.float32))
    rec = rt.recorder()
    conv1d_forward(rec, out, pre, xz, w.view, b.view if bias else None, B=B, L=L, Di=Di, K=K)
    conv1d_backward(rec, dxz, dw.view, db.view if bias else None, gt, pre, xz, w.view, B=B, L=L, Di=Di, K=K)
    rec.submit()

    x = _t64(XZ[:, :Di].reshape(B, L, Di).transpose(0, 2, 1), True)
    wt, bt = _t64(W.reshape(Di, 1, K), True), _t64(Bi, True)
    p = F.conv1d(x, wt, bt if bias else None, padding=K - 1, groups=Di)[..., :L]
    y = F.silu(p)
    y.backward(_t64(G.reshape(B, L, Di).transpose(0, 2, 1)))
    rows = lambda t: t.detach().numpy().transpose(0, 2, 1).reshape(M, Di)  # noqa: E731
    tag = f"B={B} L={L} Di={Di} K={K} bias={bias}"
    _check(f"conv1d pre {tag}", rt.read(pre), rows(p), atol=2e-6, rtol=2e-6)
    _check(f"conv1d out {tag}", rt.read(out), rows(y), atol=2e-6, rtol=2e-6)
    D = rt.read(dxz)
    _check(f"conv1d dx {tag}", D[:, :Di], x.grad.numpy().transpose(0, 2, 1).reshape(M, Di), atol=5e-6, rtol=1e-5)
    assert np.all(D[:, Di:] == SENTINEL), "conv1d_backward touched the z columns of dxz"
    _check(f"conv1d dweight (ACC) {tag}", dw.read() - DW0.astype(np.float64), wt.grad.numpy().reshape(Di, K),
           atol=2e-6 * np.sqrt(M) * 4, rtol=1e-5)
    got_db = db.read()
    if bias:
        _check(f"conv1d dbias (ACC) {tag}", got_db - DB0.astype(np.float64), bt.grad.numpy(),
               atol=2e-6 * np.sqrt(M) * 4, rtol=1e-5)
    else:
        assert np.array_equal(got_db, DB0)
    w.read(), b.read()


# ----------------------------------------------------------------------------- cross-entropy
def _ce_ref(X, T, scale):
    x = _t64(X, True)
    t = torch.tensor(np.where(T < 0, -100, T), dtype=torch.long)
    loss = F.cross_entropy(x, t, ignore_index=-100, reduction="none")
    (loss.sum() * scale).backward()
    return loss.detach().numpy(), x.grad.numpy()


@pytest.mark.parametrize("Mc,V,shift,spread", [
    (9, 259, 0.0, 3.0), (3, 50280, 0.0, 4.0), (6, 259, 1e4, 5.0), (5, 1000, -3e4, 30.0), (2, 1, 0.0, 1.0),
])
def test_cross_entropy(rt, Mc, V, shift, spread, row_wg):
    r = _rng(Mc * 31 + V)
    X = (r.standard_normal((Mc, V)) * spread + shift).astype(np.float32)
    T = r.integers(0, V, Mc).astype(np.int32)
    T[-1] = V - 1
    if Mc > 2:
        T[1] = -100                                           # ignored
    nvalid = int((T >= 0).sum())
    scale = np.float32(1.0 / (nvalid + 4))                   # valid count of the whole batch
    # the chunk's loss rows / targets are views into batch-wide buffers
    loss_all = Flat(rt, np.full(Mc, -9.0, np.float32), front=5)
    tgt_all = rt.upload(np.concatenate([np.array([0, 1, 2], np.int32), T, np.array([7], np.int32)]))
    tgt = tgt_all.view((Mc,), 3)
    sc = Flat(rt, np.array([scale], np.float32), front=1)

    xt = rt.upload(X)
    rec = rt.recorder()
    cross_entropy(rec, loss_all.view, xt, tgt, sc.view, want_grad=False)
    rec.submit()
    lref, gref = _ce_ref(X, T, float(scale))
    tag = f"Mc={Mc} V={V} shift={shift:g}"
    _check(f"cross_entropy loss (no grad) {tag}", loss_all.read(), lref, atol=2e-6, rtol=2e-6)
    assert np.array_equal(rt.read(xt), X), "want_grad=False must leave logits intact"

    loss_all2 = Flat(rt, np.full(Mc, -9.0, np.float32), front=5)
    rec = rt.recorder()
    cross_entropy(rec, loss_all2.view, xt, tgt, sc.view, want_grad=True)
    rec.submit()
    _check(f"cross_entropy loss {tag}", loss_all2.read(), lref, atol=2e-6, rtol=2e-6)
    dl = rt.read(xt)
    _check(f"cross_entropy dlogits {tag}", dl, gref, atol=2e-8, rtol=1e-5)
    for i in np.flatnonzero(T < 0):
        assert np.all(dl[i] == 0.0)
    sc.read()


def test_cross_entropy_many_rows_grid_fold(rt):
    Mc, V = 66000, 5
    r = _rng(9)
    X = r.standard_normal((Mc, V)).astype(np.float32)
    T = r.integers(-1, V, Mc).astype(np.int32)
    scale = np.float32(1.0 / max(1, (T >= 0).sum()))
    xt, tt, lt, st = rt.upload(X), rt.upload(T), rt.zeros((Mc,)), rt.upload(np.array([scale], np.float32))
    rec = rt.recorder()
    cross_entropy(rec, lt, xt, tt, st, want_grad=True)
    rec.submit()
    lref, gref = _ce_ref(X, T, float(scale))
    _check("cross_entropy loss Mc=66000", rt.read(lt), lref, atol=2e-6, rtol=2e-6)
    _check("cross_entropy dlogits Mc=66000", rt.read(xt), gref, atol=1e-11, rtol=1e-5)


@pytest.mark.parametrize("Mc,V", [(9, 259), (4, 50280), (7, 3)])
def test_cross_entropy_eval_top_k(rt, Mc, V, row_wg):
    """cross_entropy_eval: the same loss rows, and top-1/top-5 hits as torch.topk gives them
    (random logits have no ties), 0 for ignored rows; the hit views sit in one buffer at
    unaligned offsets, as the evaluation's per-chunk views do."""
    r = _rng(Mc * 7 + V)
    X = (r.standard_normal((Mc, V)) * 3).astype(np.float32)
    T = r.integers(0, V, Mc).astype(np.int32)
    T[0] = int(np.argmax(X[0]))                      # a certain top-1 hit
    T[1] = -100                                      # ignored
    if V > 6:
        T[2] = int(np.argsort(-X[2])[3])             # 4th largest: top-5, not top-1
    scale = np.float32(1.0)
    loss = Flat(rt, np.full(Mc, -9.0, np.float32), front=3)
    gap = Mc + 2
    hits = Flat(rt, np.full(gap + Mc, -7.0, np.float32), front=5)
    top1, top5 = hits.base.view((Mc,), 5), hits.base.view((Mc,), 5 + gap)
    xt, tt, st = rt.upload(X), rt.upload(T), rt.upload(np.array([scale], np.float32))
    rec = rt.recorder()
    cross_entropy(rec, loss.view, xt, tt, st, want_grad=False, hits=(top1, top5))
    rec.submit()
    lref, _ = _ce_ref(X, T, 1.0)
    _check(f"cross_entropy_eval loss Mc={Mc} V={V}", loss.read(), lref, atol=2e-6, rtol=2e-6)
    k = min(5, V)
    topk = torch.topk(torch.tensor(X), k, dim=1).indices.numpy()
    want1 = np.array([float(t >= 0 and topk[i, 0] == t) for i, t in enumerate(T)])
    want5 = np.array([float(t >= 0 and t in topk[i]) for i, t in enumerate(T)])
    got = hits.read()
    assert np.array_equal(got[:Mc], want1), (got[:Mc], want1)
    assert np.array_equal(got[gap:gap + Mc], want5), (got[gap:], want5)
    assert np.all(got[Mc:gap] == -7.0), "wrote between the two hit views"
    assert want1[0] == 1 and want1[1] == 0 and want5[1] == 0
    if V > 6:
        assert want1[2] == 0 and want5[2] == 1
    assert np.array_equal(rt.read(xt), X)
