"""RMSNorm (shaders/rmsnorm.wgsl), exactly as transformers' MambaRMSNorm in f32:
out = weight * (x * rsqrt(mean(x^2) + eps)).  `rstd` [M] is saved for the backward.

With `ld` the norm runs over columns col .. col+E of whole [M, ld] matrices (x, out, dout,
dx share col and ld): falcon_mamba normalises the dt_low, B and C slices of x_proj's output
that way, with a ones weight.
"""

from __future__ import annotations

from ..gpu import Recorder, Tensor, bound, cdiv, pack


def _chunks(M: int) -> tuple[int, int]:
    """(rows per chunk, number of chunks) of the two-stage dweight reduction."""
    rpc = max(16, cdiv(M, 256))
    return rpc, cdiv(M, rpc)


def _rows(x: Tensor, E: int, col: int, ld: int | None) -> tuple[int, int]:
    ld = E if ld is None else int(ld)
    assert 0 <= col and col + E <= ld, (col, E, ld)
    M = x.numel // ld if ld else 0
    assert x.numel == M * ld, (x.shape, ld)
    return M, ld


def rmsnorm_forward(rec: Recorder, out: Tensor, rstd: Tensor, x: Tensor, weight: Tensor, eps: float,
                    *, col: int = 0, ld: int | None = None) -> None:
    """out[M, E] = weight * x * rstd (WRITE); rstd[M] = 1/sqrt(mean(x^2) + eps) (WRITE)."""
    E = int(weight.numel)
    M, ld = _rows(x, E, col, ld)
    assert out.numel == M * ld and rstd.numel == M, (out.shape, rstd.shape, x.shape, weight.shape)
    if M == 0:
        return
    rt = rec.rt
    (bo, oo), (br, orr), (bx, ox), (bw, ow) = (bound(rt, t) for t in (out, rstd, x, weight))
    u = rt.uniform(pack("IIfI8I", M, E, float(eps), 0, oo + col, orr, ox + col, ow, 0, 0, ld, 0))
    rec.dispatch("rmsnorm", "rmsnorm_forward", {0: bo, 1: br, 2: bx, 3: bw, 4: u}, M)


def rmsnorm_backward(rec: Recorder, dx: Tensor, dweight: Tensor, dout: Tensor, x: Tensor,
                     weight: Tensor, rstd: Tensor, *, col: int = 0, ld: int | None = None) -> None:
    """dx[M, E] += d/dx (ACC; the residual gradient already in dx is kept);
    dweight[E] += sum_m dout * x * rstd (ACC, two-stage reduction through rt.scratch).
    Either dx or dweight may be None to skip it."""
    E = int(weight.numel)
    M, ld = _rows(x, E, col, ld)
    assert dout.numel == M * ld and rstd.numel == M
    if M == 0:
        return
    rt = rec.rt
    (bg, og), (bx, ox), (bw, ow), (br, orr) = (bound(rt, t) for t in (dout, x, weight, rstd))
    og, ox = og + col, ox + col
    rpc, nch = _chunks(M)
    if dx is not None:
        assert dx.numel == M * ld
        bd, od = bound(rt, dx)
        u = rt.uniform(pack("IIfI8I", M, E, 0.0, rpc, od + col, og, ox, ow, orr, nch, ld, 0))
        rec.dispatch("rmsnorm", "rmsnorm_backward", {0: bd, 1: bg, 2: bx, 3: bw, 4: br, 5: u}, M)
    if dweight is not None:
        assert dweight.numel == E
        part = rt.scratch("rmsnorm_dweight_partial", (nch, E))
        bdw, odw = bound(rt, dweight)
        u = rt.uniform(pack("IIfI8I", M, E, 0.0, rpc, odw, og, ox, ow, orr, nch, ld, 0))
        rec.dispatch("rmsnorm", "rmsnorm_dweight_partial", {0: part, 1: bg, 2: bx, 3: br, 4: u},
                     nch * cdiv(E, 64))
        rec.dispatch("rmsnorm", "rmsnorm_dweight_reduce", {0: bdw, 1: part, 2: u}, cdiv(E, 64))
