"""Causal depthwise conv1d + SiLU (shaders/conv1d.wgsl), the Mamba mixer's conv.

Left zero padding of K-1 per sequence: output t of batch row b sees inputs t-K+1 .. t of
the same row.  x is read from columns 0..Di of xz ([M, 2*Di], row stride 2*Di).
HF stores conv1d.weight as [Di, 1, K]; the same memory is our [Di, K].
"""

from __future__ import annotations

from ..gpu import Recorder, Tensor, bound, cdiv, pack

MAX_K = 7


def _chunks(M: int) -> tuple[int, int]:
    rpc = max(16, cdiv(M, 256))
    return rpc, cdiv(M, rpc)


def _params(M, L, Di, K, has_bias, rpc, nch, *offs):
    offs = tuple(offs) + (0,) * (5 - len(offs))
    return pack("16I", M, L, Di, K, 2 * Di, has_bias, rpc, nch, *offs, 0, 0, 0)


def conv1d_forward(rec: Recorder, out: Tensor, pre: Tensor, xz: Tensor, weight: Tensor,
                   bias: Tensor | None, *, B: int, L: int, Di: int, K: int) -> None:
    """pre[M, Di] = conv(x) + bias (WRITE); out[M, Di] = silu(pre) (WRITE). bias may be None."""
    M = B * L
    assert 1 <= K <= MAX_K, K
    assert out.numel == M * Di and pre.numel == M * Di and xz.numel >= M * 2 * Di and weight.numel == Di * K
    if M * Di == 0:
        return
    rt = rec.rt
    (bo, oo), (bp, op), (bx, ox), (bw, ow) = (bound(rt, t) for t in (out, pre, xz, weight))
    if bias is not None:
        assert bias.numel == Di
        bb, ob = bound(rt, bias)
    else:
        bb, ob = bw, 0  # bound but never read (has_bias = 0)
    u = rt.uniform(_params(M, L, Di, K, int(bias is not None), 0, 0, oo, op, ox, ow, ob))
    rec.dispatch("conv1d", "conv1d_forward", {0: bo, 1: bp, 2: bx, 3: bw, 4: bb, 5: u}, cdiv(M * Di, 256))


def conv1d_backward(rec: Recorder, dxz: Tensor, dweight: Tensor, dbias: Tensor | None, dout: Tensor,
                    pre: Tensor, xz: Tensor, weight: Tensor, *, B: int, L: int, Di: int, K: int) -> None:
    """dxz[:, 0:Di] = dx (WRITE; columns Di..2Di untouched); dweight[Di, K] += (ACC);
    dbias[Di] += (ACC, or None). dout is the gradient wrt the SiLU output."""
    M = B * L
    assert 1 <= K <= MAX_K, K
    assert dout.numel == M * Di and pre.numel == M * Di and xz.numel >= M * 2 * Di
    if M * Di == 0:
        return
    rt = rec.rt
    (bg, og), (bp, op), (bx, ox), (bw, ow) = (bound(rt, t) for t in (dout, pre, xz, weight))
    rpc, nch = _chunks(M)
    if dxz is not None:
        assert dxz.numel >= M * 2 * Di
        bd, od = bound(rt, dxz)
        u = rt.uniform(_params(M, L, Di, K, 0, rpc, nch, od, og, op, ow))
        rec.dispatch("conv1d", "conv1d_backward", {0: bd, 1: bg, 2: bp, 3: bw, 4: u}, cdiv(M * Di, 256))
    if dweight is not None or dbias is not None:
        part = rt.scratch("conv1d_dweight_partial", (nch, Di, K + 1))
        u = rt.uniform(_params(M, L, Di, K, 0, rpc, nch, 0, og, op, ox))
        rec.dispatch("conv1d", "conv1d_dweight_partial", {0: part, 1: bg, 2: bp, 3: bx, 4: u},
                     nch * cdiv(Di, 64))
        if dweight is not None:
            assert dweight.numel == Di * K
            bdw, odw = bound(rt, dweight)
        else:
            bdw, odw = rt.scratch("conv1d_dweight_sink", (Di * K,)), 0
        if dbias is not None:
            assert dbias.numel == Di
            bdb, odb = bound(rt, dbias)
        else:
            bdb, odb = rt.scratch("conv1d_dbias_sink", (Di,)), 0
        u = rt.uniform(_params(M, L, Di, K, int(dbias is not None), rpc, nch, odw, odb))
        rec.dispatch("conv1d", "conv1d_dweight_reduce", {0: bdw, 1: bdb, 2: part, 3: u},
                     cdiv(Di * (K + 1), 256))
