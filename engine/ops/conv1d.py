"""Causal depthwise conv1d + SiLU (shaders/conv1d.wgsl), the Mamba mixer's conv.

Left zero padding of K-1 per sequence: output t of batch row b sees inputs t-K+1 .. t of
the same row.  x is read from columns 0..Di of xz ([M, 2*Di], row stride 2*Di).
HF stores conv1d.weight as [Di, 1, K]; the same memory is our [Di, K].
Activations larger than one storage binding are processed in ranges of whole sequences.
"""

from __future__ import annotations

from ..gpu import Recorder, Tensor, bound, cdiv, pack, span, split
from .lanes import seq_conv

MAX_K = 7
SEQ_T = 64   # steps per lane of the seq kernels (shaders/conv1d.wgsl)


def _chunks(rt, M: int, Di: int, K: int) -> tuple[int, int]:
    """(rows per chunk, chunks) of the dweight reduction; the partials [chunks, Di, K+1] are
    bound whole, so there are no more chunks than fit one binding."""
    cap = max(1, (rt.max_binding - rt.storage_align) // (4 * Di * (K + 1)))
    rpc = max(16, cdiv(M, 256), cdiv(M, cap))
    return rpc, cdiv(M, rpc)


def _params(M, L, Di, K, has_bias, rpc, nch, *offs, pbase=0):
    offs = tuple(offs) + (0,) * (5 - len(offs))
    return pack("16I", M, L, Di, K, 2 * Di, has_bias, rpc, nch, *offs, pbase, 0, 0)


def partial_rows(B: int, L: int, fused: bool, part_rows: list, rpc: int) -> int:
    """Rows of the weight-gradient partials: one per (sequence, SEQ_T steps) when the seq
    kernel sums them (`fused`), else one per chunk of rpc rows of each call's range
    (`part_rows`: the batch rows of each range)."""
    if fused:
        return B * cdiv(L, SEQ_T)
    return sum(cdiv(nb * L, rpc) for nb in part_rows)


def _sequences(rt, B: int, L: int, Di: int, K: int) -> list:
    """Ranges of whole sequences (batch rows) whose [rows, Di] and xz [rows, 2Di] windows fit."""
    return split(rt, B, lambda nb: (8 * nb * L * Di, 4 * Di * (K + 1)),
                 unit=f"one sequence of the conv1d input ({L} x {2 * Di} values; a smaller --seq-len helps)")


def _seq_groups(B: int, L: int, Di: int) -> int:
    """Workgroups of conv1d_forward_seq / conv1d_backward_seq: (sequence, 64 steps, 8 channels)."""
    return B * cdiv(L, 64) * cdiv(Di, 8)


def _seq_view(t: Tensor, b0: int, nb: int, per_seq: int) -> Tensor:
    return span(t, b0 * per_seq, nb * per_seq)


def conv1d_forward(rec: Recorder, out: Tensor, pre: Tensor, xz: Tensor, weight: Tensor,
                   bias: Tensor | None, *, B: int, L: int, Di: int, K: int) -> None:
    """pre[M, Di] = conv(x) + bias (WRITE); out[M, Di] = silu(pre) (WRITE). bias may be None."""
    M = B * L
    assert 1 <= K <= MAX_K, K
    assert out.numel == M * Di and pre.numel == M * Di and xz.numel >= M * 2 * Di and weight.numel == Di * K
    if M * Di == 0:
        return
    rt = rec.rt
    parts = _sequences(rt, B, L, Di, K)
    if len(parts) > 1:
        for b0, nb in parts:
            conv1d_forward(rec, _seq_view(out, b0, nb, L * Di), _seq_view(pre, b0, nb, L * Di),
                           _seq_view(xz, b0, nb, 2 * L * Di), weight, bias, B=nb, L=L, Di=Di, K=K)
        return
    (bo, oo), (bp, op), (bx, ox), (bw, ow) = (bound(rt, t) for t in (out, pre, xz, weight))
    if bias is not None:
        assert bias.numel == Di
        bb, ob = bound(rt, bias)
    else:
        bb, ob = bw, 0  # bound but never read (has_bias = 0)
    u = rt.uniform(_params(M, L, Di, K, int(bias is not None), 0, 0, oo, op, ox, ow, ob))
    bindings = {0: bo, 1: bp, 2: bx, 3: bw, 4: bb, 5: u}
    if seq_conv(rt):
        rec.dispatch("conv1d", "conv1d_forward_seq", bindings, _seq_groups(B, L, Di))
    else:
        rec.dispatch("conv1d", "conv1d_forward", bindings, cdiv(M * Di, 256))


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
    parts = _sequences(rt, B, L, Di, K)
    bw, ow = bound(rt, weight)
    rpc, nch = _chunks(rt, M, Di, K)

    def views(b0, nb):
        if len(parts) == 1:
            return dout, pre, xz, dxz
        return (_seq_view(dout, b0, nb, L * Di), _seq_view(pre, b0, nb, L * Di),
                _seq_view(xz, b0, nb, 2 * L * Di), None if dxz is None else _seq_view(dxz, b0, nb, 2 * L * Di))

    want_dw = dweight is not None or dbias is not None
    fused = want_dw and dxz is not None and seq_conv(rt)   # the seq kernel sums the partials too
    if want_dw:
        nch = partial_rows(B, L, fused, [nb for _, nb in parts], rpc)
        split(rt, 1, lambda _: (4 * nch * Di * (K + 1),), unit=f"the conv1d weight-gradient partials ({nch} x {Di})")
        part = rt.scratch("conv1d_dweight_partial", (nch, Di, K + 1))
    if dxz is not None:
        assert dxz.numel >= M * 2 * Di
        pbase = 0
        for b0, nb in parts:
            g, p, x, d = views(b0, nb)
            (bg, og), (bp, op), (bd, od), (bx, ox) = (bound(rt, t) for t in (g, p, d, x))
            u = rt.uniform(_params(nb * L, L, Di, K, 0, rpc, cdiv(nb * L, rpc), od, og, op, ow, ox, pbase=pbase))
            bindings = {0: bd, 1: bg, 2: bp, 3: bw, 4: u}
            if seq_conv(rt):
                sink = part if want_dw else rt.scratch("conv1d_dbias_sink", (Di,))
                rec.dispatch("conv1d", "conv1d_backward_seq", {**bindings, 5: bx, 6: sink},
                             _seq_groups(nb, L, Di), {"SEQ_DW": int(fused)})
            else:
                rec.dispatch("conv1d", "conv1d_backward", bindings, cdiv(nb * L * Di, 256))
            pbase += nb * cdiv(L, SEQ_T)   # (used by the seq kernel's partials only)
    if want_dw:
        pbase = 0
        for b0, nb in ([] if fused else parts):
            g, p, x, _ = views(b0, nb)
            (bg, og), (bp, op), (bx, ox) = (bound(rt, t) for t in (g, p, x))
            n = cdiv(nb * L, rpc)
            u = rt.uniform(_params(nb * L, L, Di, K, 0, rpc, n, 0, og, op, ox, pbase=pbase))
            rec.dispatch("conv1d", "conv1d_dweight_partial", {0: part, 1: bg, 2: bp, 3: bx, 4: u},
                         n * cdiv(Di, 64))
            pbase += n
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
