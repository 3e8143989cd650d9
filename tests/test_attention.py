"""The attention, RoPE and SwiGLU kernels (engine/kernels/attention.py, rope.py, swiglu.py)
against torch autograd in float64: causal softmax attention with grouped KV heads (GQA
ratios 1, 2, 3 and 4), head dims 4..256, lengths that are no multiple of the kernels' blocks
and past one segment (so that the online state carries across dispatches), partial and full
rotary dims, and the residual multiplier folded into the output."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from memengine.engine.errors import MemengineError  # noqa: E402
from memengine.engine.kernels import attention, rope, swiglu  # noqa: E402


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def torch_attention(q, k, v, B, L, Hq, Hkv, D, scale):
    q = q.reshape(B, L, Hq, D).transpose(1, 2)
    k = k.reshape(B, L, Hkv, D).transpose(1, 2).repeat_interleave(Hq // Hkv, dim=1)
    v = v.reshape(B, L, Hkv, D).transpose(1, 2).repeat_interleave(Hq // Hkv, dim=1)
    s = (q @ k.transpose(2, 3)) * scale
    mask = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)
    s = s.masked_fill(mask, float("-inf"))
    p = torch.softmax(s, -1)
    lse = torch.logsumexp(s, -1)                       # [B, Hq, L]
    o = (p @ v).transpose(1, 2).reshape(B * L, Hq * D)
    return o, lse.permute(0, 2, 1).reshape(B * L, Hq)


CASES = [   # B, L, Hq, Hkv, D, segment budget (None: the default)
    (2, 7, 3, 1, 4, None),
    (1, 37, 6, 2, 12, 100),     # GQA 3, several key segments of a few keys
    (2, 19, 4, 4, 8, 60),
    (1, 70, 8, 2, 128, 3000),   # the real head_dim, GQA 4, segments of ~23 keys
    (2, 150, 4, 2, 68, 900),    # several blocks and segments of one block, 2 column chunks
    (1, 97, 2, 1, 256, None),   # the largest head_dim
]


@pytest.mark.parametrize("B,L,Hq,Hkv,D,budget", CASES)
def test_attention_forward_backward_against_torch(rt, monkeypatch, B, L, Hq, Hkv, D, budget):
    if budget is not None:
        monkeypatch.setattr(attention, "LOOP_BUDGET", budget)
    M = B * L
    g = torch.Generator().manual_seed(B * 100 + L)
    q = torch.randn(M, Hq * D, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(M, Hkv * D, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(M, Hkv * D, dtype=torch.float64, generator=g, requires_grad=True)
    do = torch.randn(M, Hq * D, dtype=torch.float64, generator=g)
    scale, r = 0.7 / D ** 0.5, 1.7
    o_ref, lse_ref = torch_attention(q, k, v, B, L, Hq, Hkv, D, scale)
    (o_ref * do).sum().backward()
    f32 = lambda t: t.detach().numpy().astype(np.float32)
    tq, tk, tv = rt.upload(f32(q)), rt.upload(f32(k)), rt.upload(f32(v))
    to, tl, ts = rt.empty((M, Hq * D)), rt.empty((M, Hq)), rt.empty((M, Hq))
    rec = rt.recorder()
    attention.attention_forward(rec, to, tl, tq, tk, tv, ts, B=B, L=L, Hq=Hq, Hkv=Hkv, D=D, scale=scale)
    rec.submit()
    o, lse = rt.read(to).reshape(M, Hq * D), rt.read(tl).reshape(M, Hq)
    assert rel(o, o_ref.detach().numpy()) < 1e-5 and rel(lse, lse_ref.detach().numpy()) < 1e-5
    # the backward from o scaled by r (the residual multiplier folded in), do / r given
    tos = rt.upload((o * r).astype(np.float32))
    tdo = rt.upload(f32(do))
    dq, dk, dv, delta = rt.empty((M, Hq * D)), rt.empty((M, Hkv * D)), rt.empty((M, Hkv * D)), rt.empty((M, Hq))
    rec = rt.recorder()
    attention.attention_backward(rec, dq, dk, dv, delta, tdo, tos, tl, tq, tk, tv, B=B, L=L, Hq=Hq, Hkv=Hkv, D=D,
                                 scale=scale, o_scale=r)
    rec.submit()
    for name, ours, ref in (("dq", dq, q.grad), ("dk", dk, k.grad), ("dv", dv, v.grad)):
        e = rel(rt.read(ours).reshape(ref.shape), ref.numpy())
        print(f"  {name} max rel err {e:.2e}")
        assert e < 1e-4, name


SG_CASES = [   # B, L, Hq, Hkv, D, v's and dO's magnitudes (their f16 copies' scales take them), trend
    (1, 37, 4, 2, 32, 1.0, 1e-4, 0.0),
    (2, 45, 3, 3, 16, 3e4, 1e-6, 0.0),     # GQA 1, two sequences, a partial block each
    (2, 150, 6, 2, 64, 1e-3, 10.0, 0.0),   # GQA 3, several blocks of 64 rows and of 32 keys
    (1, 130, 2, 1, 32, 1.0, 1.0, 0.04),    # scores rising along the keys: a row's max moves late
]


@pytest.mark.parametrize("B,L,Hq,Hkv,D,vmag,gmag,trend", SG_CASES)
def test_attention_on_subgroup_matrices_against_torch(rt, B, L, Hq, Hkv, D, vmag, gmag, trend):
    """shaders/attention_sgmat.wgsl (--precision mixed on adapters with f16 subgroup matrices)
    against torch autograd in float64: o, lse, dq, dk, dv within 8 f16 roundings (q, k, v and
    dO cast with their own scale slots, p and ds rounded to f16 in the kernels), at magnitudes
    of v and dO far outside f16's range unscaled, and with scores that rise along the keys (the
    last row's max passing its first block's by more than 11, twice the threshold of a one-walk
    forward that rescales lazily, which gave wrong results on the H100 and is not kept).  Where
    the adapter has no subgroup matrices the kernels run emulated (tests/sgmat_emulation.py)."""
    import contextlib

    from sgmat_emulation import emulated

    from memengine.engine.kernels.matmul import F16Scales, cast_f16

    if not rt.has_f16:
        pytest.skip("the adapter lacks shader-f16")
    M, P = B * L, attention.SG_PAD_ROWS
    g = torch.Generator().manual_seed(B * 1000 + L)
    q = torch.randn(M, Hq * D, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(M, Hkv * D, dtype=torch.float64, generator=g)
    if trend:   # q . k grows by about trend * D * |mean q| a key
        with torch.no_grad():
            q += 2.0
            k += trend * torch.arange(M, dtype=torch.float64)[:, None]
    k.requires_grad_()
    v = (torch.randn(M, Hkv * D, dtype=torch.float64, generator=g) * vmag).requires_grad_()
    do = torch.randn(M, Hq * D, dtype=torch.float64, generator=g) * gmag
    scale, r = 0.7 / D ** 0.5, 1.7
    o_ref, lse_ref = torch_attention(q, k, v, B, L, Hq, Hkv, D, scale)
    (o_ref * do).sum().backward()
    if trend:   # the last row's first-block max against a later block's, head 0
        s0 = (q[:L, :D] @ k[:L, :D].T).detach() * scale
        assert s0[L - 1, 64:96].max() > s0[L - 1, :32].max() + 2 * 5.5
    f32 = lambda t: t.detach().numpy().astype(np.float32)
    ctx = contextlib.nullcontext() if rt.has_subgroup_matrix else emulated(rt, attention.SG_SHADER)
    with ctx:
        assert attention.takes_subgroup_matrices(rt, D)
        sc = F16Scales(rt, ["q", "k", "v", "do"])
        tq, tk, tv, tdo = (rt.upload(f32(x)) for x in (q, k, v, do))
        q16, do16 = rt.zeros((M + P, Hq * D), "f16"), rt.zeros((M + P, Hq * D), "f16")
        k16, v16 = rt.zeros((M + P, Hkv * D), "f16"), rt.zeros((M + P, Hkv * D), "f16")
        rt.write(q16, np.full((M + P) * Hq * D, np.nan, np.float16))   # the padding is the kernel's to clear
        to, tl = rt.empty((M, Hq * D)), rt.empty((M, Hq))
        rec = rt.recorder()
        for dst, src, n in ((q16, tq, "q"), (k16, tk, "k"), (v16, tv, "v")):
            cast_f16(rec, dst, src, scale=sc[n])
        attention.attention_forward_f16(rec, to, tl, q16, k16, v16, B=B, L=L, Hq=Hq, Hkv=Hkv, D=D, scale=scale)
        rec.submit()
        o, lse = rt.read(to).reshape(M, Hq * D), rt.read(tl).reshape(M, Hq)
        tos = rt.upload((o * r).astype(np.float32))
        dq, dk, dv, delta = rt.empty((M, Hq * D)), rt.empty((M, Hkv * D)), rt.empty((M, Hkv * D)), rt.empty((M, Hq))
        rec = rt.recorder()
        cast_f16(rec, do16, tdo, scale=sc["do"])
        attention.attention_backward_f16(rec, dq, dk, dv, delta, tdo, tos, tl, q16, k16, v16, do16, B=B, L=L,
                                         Hq=Hq, Hkv=Hkv, D=D, scale=scale, o_scale=r)
        rec.submit()
    bound = 8 * 2.0 ** -11
    for name, ours, ref in (("o", o, o_ref), ("lse", lse, lse_ref), ("dq", rt.read(dq), q.grad),
                            ("dk", rt.read(dk), k.grad), ("dv", rt.read(dv), v.grad)):
        e = rel(np.asarray(ours).reshape(ref.shape), ref.detach().numpy())
        print(f"  {name} max rel err {e:.2e} (bound {bound:.2e})")
        assert 1e-6 < e < bound, name


def test_attention_refuses_head_dims_it_does_not_run():
    for D, hq, hkv in ((6, 2, 1), (260, 2, 2), (8, 4, 3)):
        with pytest.raises(MemengineError) as e:
            attention.check_shape(D, hq, hkv, "cfg.json")
        assert "\n" not in str(e.value) and "cfg.json" in str(e.value)


@pytest.mark.parametrize("D,R", [(8, 8), (12, 6), (16, 8)])
def test_rope_forward_backward_against_transformers(rt, D, R):
    from transformers.models.bamba.modeling_bamba import apply_rotary_pos_emb

    B, L, H, theta, off = 2, 9, 3, 500.0, 5
    table = rope.rope_table(L + off, R, theta)
    inv = torch.tensor(rope.inv_freq(R, theta))
    pos = torch.arange(L, dtype=torch.float32)
    freqs = pos[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().double()[None], emb.sin().double()[None]
    g = torch.Generator().manual_seed(D)
    x = torch.randn(B, H, L, D, dtype=torch.float64, generator=g, requires_grad=True)
    y_ref, _ = apply_rotary_pos_emb(x, x, cos, sin)
    dy = torch.randn(B, H, L, D, dtype=torch.float64, generator=g)
    (y_ref * dy).sum().backward()
    flat = lambda t: t.detach().permute(0, 2, 1, 3).reshape(B * L, H * D).numpy().astype(np.float32)
    tt = rt.upload(table)
    tx = rt.upload(flat(x))
    rec = rt.recorder()
    rope.rope_forward(rec, tx, tt, rows=B * L, L=L, heads=H, D=D, R=R, ld=H * D)
    rec.submit()
    assert rel(rt.read(tx).reshape(B * L, H * D), flat(y_ref)) < 1e-6
    td = rt.upload(flat(dy))
    rec = rt.recorder()
    rope.rope_backward(rec, td, tt, rows=B * L, L=L, heads=H, D=D, R=R, ld=H * D)
    rec.submit()
    assert rel(rt.read(td).reshape(B * L, H * D), flat(x.grad)) < 1e-6
    # a decode step at position off + 2 is the table's row off + 2
    one = rt.upload(flat(x)[2:3])
    rec = rt.recorder()
    rope.rope_forward(rec, one, tt, rows=1, L=1, heads=H, D=D, R=R, ld=H * D, pos0=2)
    rec.submit()
    np.testing.assert_allclose(rt.read(one).reshape(-1), rt.read(tx).reshape(B * L, H * D)[2], rtol=1e-6, atol=1e-6)


def test_swiglu_against_torch(rt):
    rows, I, r = 7, 5, 0.6
    g = torch.Generator().manual_seed(3)
    gu = torch.randn(rows, 2 * I, dtype=torch.float64, generator=g, requires_grad=True)
    out_ref = r * torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
    dout = torch.randn(rows, I, dtype=torch.float64, generator=g)
    (out_ref * dout).sum().backward()
    tg = rt.upload(gu.detach().numpy().astype(np.float32))
    to, tdg = rt.empty((rows, I)), rt.empty((rows, 2 * I))
    rec = rt.recorder()
    swiglu.swiglu_forward(rec, to, tg, rows=rows, I=I, r=r)
    swiglu.swiglu_backward(rec, tdg, rt.upload(dout.numpy().astype(np.float32)), tg, rows=rows, I=I, r=r)
    rec.submit()
    assert rel(rt.read(to).reshape(rows, I), out_ref.detach().numpy()) < 1e-6
    assert rel(rt.read(tdg).reshape(rows, 2 * I), gu.grad.numpy()) < 1e-6
