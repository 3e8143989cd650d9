"""RMSNorm (shaders/rmsnorm.wgsl), exactly as transformers' MambaRMSNorm in f32:
out = weight * (x * rsqrt(mean(x^2) + eps)).  `rstd` [M] is saved for the backward.
"""

from __future__ import annotations

from ..gpu import Recorder, Tensor, bound, cdiv, pack


def _chunks(M: int) -> tuple[int, int]:
    """(rows per chunk, number of chunks) of the two-stage dweight reduction."""
    rpc = max(16, cdiv(M, 256))
    return rpc, cdiv(M, rpc)


def rmsnorm_forward(rec: Recorder, out: Tensor, rstd: Tensor, x: Tensor, weight: Tensor, eps: float) -> None:
    """out[M, E] = weight * x * rstd (WRITE); rstd[M] = 1/sqrt(mean(x^2) + eps) (WRITE)."""
    E = int(weight.numel)
    M = x.numel // E if E else 0
    assert x.numel == M * E and out.numel == M * E and rstd.numel == M, (out.shape, rstd.shape, x.shape, weight.shape)
    if M == 0:
        return
    rt = rec.rt
    (bo, oo), (br, orr), (bx, ox), (bw, ow) = (bound(rt, t) for t in (out, rstd, x, weight))
    u = rt.uniform(pack("IIfI8I", M, E, float(eps), 0, oo, orr, ox, ow, 0, 0, 0, 0))
    rec.dispatch("rmsnorm", "rmsnorm_forward", {0: bo, 1: br, 2: bx, 3: bw, 4: u}, M)


def rmsnorm_backward(rec: Recorder, dx: Tensor, dweight: Tensor, dout: Tensor, x: Tensor,
                     weight: Tensor, rstd: Tensor) -> None:
    """dx[M, E] += d/dx (ACC; the residual gradient already in dx is kept);
    dweight[E] += sum_m dout * x * rstd (ACC, two-stage reduction through rt.scratch).
    Either dx or dweight may be None to skip it."""
    E = int(weight.numel)
    M = x.numel // E if E else 0
    assert x.numel == M * E and dout.numel == M * E and rstd.numel == M
    if M == 0:
        return
    rt = rec.rt
    (bg, og), (bx, ox), (bw, ow), (br, orr) = (bound(rt, t) for t in (dout, x, weight, rstd))
    rpc, nch = _chunks(M)
    if dx is not None:
        assert dx.numel == M * E
        bd, od = bound(rt, dx)
        u = rt.uniform(pack("IIfI8I", M, E, 0.0, rpc, od, og, ox, ow, orr, nch, 0, 0))
        rec.dispatch("rmsnorm", "rmsnorm_backward", {0: bd, 1: bg, 2: bx, 3: bw, 4: br, 5: u}, M)
    if dweight is not None:
        assert dweight.numel == E
        part = rt.scratch("rmsnorm_dweight_partial", (nch, E))
        bdw, odw = bound(rt, dweight)
        u = rt.uniform(pack("IIfI8I", M, E, 0.0, rpc, odw, og, ox, ow, orr, nch, 0, 0))
        rec.dispatch("rmsnorm", "rmsnorm_dweight_partial", {0: part, 1: bg, 2: bx, 3: br, 4: u},
                     nch * cdiv(E, 64))
        rec.dispatch("rmsnorm", "rmsnorm_dweight_reduce", {0: bdw, 1: part, 2: u}, cdiv(E, 64))
