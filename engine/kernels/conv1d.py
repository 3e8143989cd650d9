"""Causal depthwise conv1d + SiLU (shaders/conv1d.wgsl), the Mamba mixer's conv.

Left zero padding of K-1 per sequence: output t of batch row b sees inputs t-K+1 .. t of
the same row.  x is read from columns col..col+Di of xz ([M, ld], row stride ld; Mamba-1's
[x ; z]: col 0, ld 2*Di, the defaults; Mamba-2 convolves the Di + 2GN columns of xBC).
HF stores conv1d.weight as [Di, 1, K]; the same memory is our [Di, K].
Activations larger than one storage binding are processed in ranges of whole sequences.
"""

from __future__ import annotations

from memengine.engine.kernels.lanes import is_cpu
from memengine.engine.runtime import Recorder, Tensor, bound, cdiv, pack, span, split

MAX_K = 7
SEQ_T = 64   # steps per lane (shaders/conv1d.wgsl)
# lanes (consecutive channels) per workgroup: None = one SIMD vector of 8 on a CPU adapter,
# 128 on a GPU (64 timed the same on the H200); tests force the other
SEQ_WG = None


def _seq_wg(rt) -> int:
    if SEQ_WG is not None:
        return int(SEQ_WG)
    return 8 if is_cpu(rt) else 128


def _params(M, L, Di, K, has_bias, nch, *offs, pbase=0, ld=None):
    offs = tuple(offs) + (0,) * (5 - len(offs))
    return pack("16I", M, L, Di, K, 2 * Di if ld is None else ld, has_bias, 0, nch, *offs, pbase, 0, 0)


def partial_rows(B: int, L: int) -> int:
    """Rows of the weight-gradient partials: one per (sequence, SEQ_T steps)."""
    return B * cdiv(L, SEQ_T)


def _sequences(rt, B: int, L: int, Di: int, K: int, ld: int | None = None) -> list:
    """Ranges of whole sequences (batch rows) whose [rows, Di] and xz [rows, ld] windows fit."""
    ld = 2 * Di if ld is None else ld
    return split(rt, B, lambda nb: (4 * nb * L * ld, 4 * Di * (K + 1)),
                 unit="one sequence of the conv1d input", detail=f"{L} x {ld} values",
                 advice="a smaller --seq-len helps")


def _groups(B: int, L: int, Di: int, wg: int) -> int:
    """Workgroups of conv1d_forward / conv1d_backward: (sequence, SEQ_T steps, wg channels)."""
    return B * cdiv(L, SEQ_T) * cdiv(Di, wg)


def _seq_view(t: Tensor, b0: int, nb: int, per_seq: int) -> Tensor:
    return span(t, b0 * per_seq, nb * per_seq)


def conv1d_forward(rec: Recorder, out: Tensor, pre: Tensor, xz: Tensor, weight: Tensor,
                   bias: Tensor | None, *, B: int, L: int, Di: int, K: int, col: int = 0,
                   ld: int | None = None) -> None:
    """pre[M, Di] = conv(x) + bias (WRITE); out[M, Di] = silu(pre) (WRITE). bias may be None.
    x = xz[:, col:col+Di] of xz [M, ld] (default ld 2*Di)."""
    M = B * L
    W = 2 * Di if ld is None else ld
    assert 1 <= K <= MAX_K, K
    assert 0 <= col and col + Di <= W, (col, Di, W)
    assert out.numel == M * Di and pre.numel == M * Di and xz.numel >= M * W and weight.numel == Di * K
    if M * Di == 0:
        return
    rt = rec.rt
    parts = _sequences(rt, B, L, Di, K, ld)
    if len(parts) > 1:
        for b0, nb in parts:
            conv1d_forward(rec, _seq_view(out, b0, nb, L * Di), _seq_view(pre, b0, nb, L * Di),
                           _seq_view(xz, b0, nb, L * W), weight, bias, B=nb, L=L, Di=Di, K=K, col=col, ld=ld)
        return
    (bo, oo), (bp, op), (bx, ox), (bw, ow) = (bound(rt, t) for t in (out, pre, xz, weight))
    if bias is not None:
        assert bias.numel == Di
        bb, ob = bound(rt, bias)
    else:
        bb, ob = bw, 0  # bound but never read (has_bias = 0)
    u = rt.uniform(_params(M, L, Di, K, int(bias is not None), 0, oo, op, ox + col, ow, ob, ld=ld))
    wg = _seq_wg(rt)
    rec.dispatch("conv1d", "conv1d_forward", {0: bo, 1: bp, 2: bx, 3: bw, 4: bb, 5: u},
                 _groups(B, L, Di, wg), {"WG": wg})


def conv1d_backward(rec: Recorder, dxz: Tensor, dweight: Tensor | None, dbias: Tensor | None, dout: Tensor,
                    pre: Tensor, xz: Tensor, weight: Tensor, *, B: int, L: int, Di: int, K: int, col: int = 0,
                    ld: int | None = None) -> None:
    """dxz[:, col:col+Di] = dx (WRITE; the other columns untouched); dweight[Di, K] += (ACC, or
    None: not wanted); dbias[Di] += (ACC, or None). dout is the gradient wrt the SiLU output."""
    M = B * L
    W = 2 * Di if ld is None else ld
    assert 1 <= K <= MAX_K, K
    assert 0 <= col and col + Di <= W, (col, Di, W)
    assert dout.numel == M * Di and pre.numel == M * Di and xz.numel >= M * W and dxz.numel >= M * W
    if M * Di == 0:
        return
    rt = rec.rt
    parts = _sequences(rt, B, L, Di, K, ld)
    bw, ow = bound(rt, weight)
    want_dw = dweight is not None or dbias is not None
    nch = partial_rows(B, L)
    if want_dw:   # a partial row per (sequence, SEQ_T steps), summed by conv1d_dweight_reduce
        split(rt, 1, lambda _: (4 * nch * Di * (K + 1),), unit=f"the conv1d weight-gradient partials ({nch} x {Di})")
        partials = rt.scratch("conv1d_dweight_partial", (nch, Di, K + 1))
    else:         # bound, never written
        partials = rt.scratch("conv1d_dbias_sink", (Di,))
    wg = _seq_wg(rt)
    for b0, nb in parts:
        g, p, x, d = ((dout, pre, xz, dxz) if len(parts) == 1 else
                      (_seq_view(dout, b0, nb, L * Di), _seq_view(pre, b0, nb, L * Di),
                       _seq_view(xz, b0, nb, L * W), _seq_view(dxz, b0, nb, L * W)))
        (bg, og), (bp, op), (bd, od), (bx, ox) = (bound(rt, t) for t in (g, p, d, x))
        u = rt.uniform(_params(nb * L, L, Di, K, 0, 0, od + col, og, op, ow, ox + col, pbase=partial_rows(b0, L),
                               ld=ld))
        rec.dispatch("conv1d", "conv1d_backward", {0: bd, 1: bg, 2: bp, 3: bw, 4: u, 5: bx, 6: partials},
                     _groups(nb, L, Di, wg), {"SEQ_DW": int(want_dw), "WG": wg})
    if not want_dw:
        return
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
    u = rt.uniform(_params(M, L, Di, K, int(dbias is not None), nch, odw, odb))
    rec.dispatch("conv1d", "conv1d_dweight_reduce", {0: bdw, 1: bdb, 2: partials, 3: u},
                 cdiv(Di * (K + 1), 256))
