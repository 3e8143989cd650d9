"""RMSNorm (shaders/rmsnorm.wgsl), exactly as transformers' MambaRMSNorm in f32:
out = weight * (x * rsqrt(mean(x^2) + eps)).  `rstd` [M] is saved for the backward.

With `ld` the norm runs over columns col .. col+E of whole [M, ld] matrices (x, out, dout,
dx share col and ld): falcon_mamba normalises the dt_low, B and C slices of x_proj's output
that way, with a ones weight.

Matrices larger than one storage binding are processed in row ranges (`gpu.split`).
"""

from __future__ import annotations

from memengine.engine.kernels.lanes import row_workgroup
from memengine.engine.runtime import Recorder, Tensor, bound, cdiv, pack, rows, split


def chunks(rt, M: int, E: int) -> tuple[int, int]:
    """(rows per chunk, number of chunks) of the two-stage dweight reduction; the partial
    sums ([chunks, E]) are bound whole, so there are no more chunks than fit one binding."""
    rpc = max(16, cdiv(M, 256), cdiv(M, max(1, (rt.max_binding - rt.storage_align) // (4 * E))))
    return rpc, cdiv(M, rpc)


def _rows(x: Tensor, E: int, col: int, ld: int | None) -> tuple[int, int]:
    ld = E if ld is None else int(ld)
    assert 0 <= col and col + E <= ld, (col, E, ld)
    M = x.numel // ld if ld else 0
    assert x.numel == M * ld, (x.shape, ld)
    return M, ld


def _ranges(rt, M: int, E: int, ld: int, n_mats: int, step: int = 1) -> list:
    if rt.unsplit:
        return [(0, M)]
    return split(rt, M, lambda n: (4 * n * ld,) * n_mats + (4 * n, 4 * E), step=step,
                 unit=f"one row of an activation ({ld} values)")


def rmsnorm_forward(rec: Recorder, out: Tensor, rstd: Tensor, x: Tensor, weight: Tensor, eps: float,
                    *, col: int = 0, ld: int | None = None, copy: Tensor | None = None) -> None:
    """out[M, E] = weight * x * rstd (WRITE); rstd[M] = 1/sqrt(mean(x^2) + eps) (WRITE);
    `copy` (the layout of x): x's columns col..col+E written there too (WRITE)."""
    E = int(weight.numel)
    M, ld = _rows(x, E, col, ld)
    assert out.numel == M * ld and rstd.numel == M, (out.shape, rstd.shape, x.shape, weight.shape)
    assert copy is None or copy.numel == M * ld, (copy.shape, x.shape)
    if M == 0:
        return
    rt = rec.rt
    for r0, n in _ranges(rt, M, E, ld, 2 if copy is None else 3):
        (bo, oo), (br, orr), (bx, ox), (bw, ow) = (
            bound(rt, t) for t in (rows(out, r0, n, ld), rows(rstd, r0, n, 1), rows(x, r0, n, ld), weight))
        bindings = {0: bo, 1: br, 2: bx, 3: bw}
        if copy is not None:
            bindings[5], oc = bound(rt, rows(copy, r0, n, ld))
            oc += col
        else:   # bound, never written
            bindings[5], oc = rt.scratch("rmsnorm_copy_sink", (1,)), 0
        bindings[4] = rt.uniform(pack("IIfI8I", n, E, float(eps), 0, oo + col, orr, ox + col, ow, oc, 0, ld, 0))
        rec.dispatch("rmsnorm", "rmsnorm_forward", bindings, n,
                     {**(row_workgroup(rt, E, 128) or {}), "COPY": int(copy is not None)})


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
    rpc, nch = chunks(rt, M, E)
    bw, ow = bound(rt, weight)

    def bind_rows(r0, n):
        (bg, og), (bx, ox), (br, orr) = (
            bound(rt, t) for t in (rows(dout, r0, n, ld), rows(x, r0, n, ld), rows(rstd, r0, n, 1)))
        return (bg, og + col), (bx, ox + col), (br, orr)

    if dx is not None:
        assert dx.numel == M * ld
        for r0, n in _ranges(rt, M, E, ld, 3):
            (bg, og), (bx, ox), (br, orr) = bind_rows(r0, n)
            bd, od = bound(rt, rows(dx, r0, n, ld))
            u = rt.uniform(pack("IIfI8I", n, E, 0.0, rpc, od + col, og, ox, ow, orr, cdiv(n, rpc), ld, 0))
            rec.dispatch("rmsnorm", "rmsnorm_backward", {0: bd, 1: bg, 2: bx, 3: bw, 4: br, 5: u}, n,
                         row_workgroup(rt, E, 128))
    if dweight is not None:
        assert dweight.numel == E
        bdw, odw = bound(rt, dweight)
        # row ranges of whole chunks where they fit (then the partial sums are those of one call)
        parts = _ranges(rt, M, E, ld, 2, step=rpc)
        nch = sum(cdiv(n, rpc) for _, n in parts)
        split(rt, 1, lambda _: (4 * nch * E,), unit=f"the rmsnorm weight-gradient partials ({nch} x {E})")
        part = rt.scratch("rmsnorm_dweight_partial", (nch, E))
        pbase = 0
        for r0, n in parts:
            (bg, og), (bx, ox), (br, orr) = bind_rows(r0, n)
            u = rt.uniform(pack("IIfI8I", n, E, 0.0, rpc, odw, og, ox, ow, orr, cdiv(n, rpc), ld, pbase))
            rec.dispatch("rmsnorm", "rmsnorm_dweight_partial", {0: part, 1: bg, 2: bx, 3: br, 4: u},
                         cdiv(n, rpc) * cdiv(E, 64))
            pbase += cdiv(n, rpc)
        if len(parts) > 1:
            u = rt.uniform(pack("IIfI8I", M, E, 0.0, rpc, odw, 0, 0, 0, 0, nch, ld, 0))
        rec.dispatch("rmsnorm", "rmsnorm_dweight_reduce", {0: bdw, 1: part, 2: u}, cdiv(E, 64))
