"""Standalone activations (shaders/activation.wgsl): SiLU and the stable softplus.

Forward entry points WRITE their output; backward entry points ACCUMULATE (dx += ...).
Views at any offset are bound with `gpu.bound` (aligned-down binding + element offset).
"""

from __future__ import annotations

from memengine.engine.runtime import Recorder, Tensor, bound, cdiv, pack, span, split

WG = 256


def _unary(rec: Recorder, entry: str, out: Tensor, x: Tensor) -> None:
    n = x.numel
    assert out.numel == n, (out.shape, x.shape)
    if n == 0:
        return
    parts = split(rec.rt, n, lambda k: (4 * k,), step=WG)
    if len(parts) > 1:  # larger than one binding: element ranges
        for s, k in parts:
            _unary(rec, entry, span(out, s, k), span(x, s, k))
        return
    bo, oo = bound(rec.rt, out)
    bx, ox = bound(rec.rt, x)
    u = rec.rt.uniform(pack("4I", n, oo, ox, 0))
    rec.dispatch("activation", entry, {0: bo, 1: bx, 2: u}, cdiv(n, WG))


def _unary_backward(rec: Recorder, entry: str, dx: Tensor, dout: Tensor, x: Tensor) -> None:
    n = x.numel
    assert dx.numel == n and dout.numel == n, (dx.shape, dout.shape, x.shape)
    if n == 0:
        return
    parts = split(rec.rt, n, lambda k: (4 * k,), step=WG)
    if len(parts) > 1:
        for s, k in parts:
            _unary_backward(rec, entry, span(dx, s, k), span(dout, s, k), span(x, s, k))
        return
    bd, od = bound(rec.rt, dx)
    bg, og = bound(rec.rt, dout)
    bx, ox = bound(rec.rt, x)
    u = rec.rt.uniform(pack("4I", n, od, og, ox))
    rec.dispatch("activation", entry, {0: bd, 1: bg, 2: bx, 3: u}, cdiv(n, WG))


def silu_forward(rec: Recorder, out: Tensor, x: Tensor) -> None:
    """out = x * sigmoid(x) (WRITE)."""
    _unary(rec, "silu_forward", out, x)


def silu_backward(rec: Recorder, dx: Tensor, dout: Tensor, x: Tensor) -> None:
    """dx += dout * sigmoid(x) * (1 + x * (1 - sigmoid(x))) (ACC)."""
    _unary_backward(rec, "silu_backward", dx, dout, x)


def softplus_forward(rec: Recorder, out: Tensor, x: Tensor) -> None:
    """out = x if x > 20 else log1p(exp(x)) (WRITE; torch's threshold=20)."""
    _unary(rec, "softplus_forward", out, x)


def softplus_backward(rec: Recorder, dx: Tensor, dout: Tensor, x: Tensor) -> None:
    """dx += dout * (1 if x > 20 else sigmoid(x)) (ACC)."""
    _unary_backward(rec, "softplus_backward", dx, dout, x)
