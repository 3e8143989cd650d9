"""Selective scan (shaders/selective_scan.wgsl): Mamba-1's SSM recurrence, forward and backward.

Semantics (SPEC section 2, transformers' MambaMixer.slow_forward), rows m = b*L + t:

    dt  = softplus(delta + dt_bias)          delta [M, Di] is dt_proj's output WITHOUT bias
    A   = -exp(A_log)                        [Di, N]
    Bm  = xdbl[:, R:R+N],  Cm = xdbl[:, R+N:R+2N]       xdbl [M, R+2N]
    z   = xz[:, Di:2Di]                                  xz [M, 2Di]
    s_t = exp(dt_t*A) * s_{t-1} + dt_t*Bm_t*u_t          (s_{-1} = 0 per batch row)
    y_t = (sum_n s_t*Cm_t + D*u_t) * silu(z_t)

`selective_scan_forward` saves the state at the start of every chunk of `CHUNK` steps into
`states` (shape `scan_state_shape`); the backward recomputes each chunk from it.

Backward outputs: du, ddelta WRITE; ddt_bias, dA_log, dD ACC (+=); dxdbl WRITE on columns
R..R+2N only; dxz WRITE on columns Di..2Di only.  The backward also uses du and ddelta as
its own intermediate storage (dy*silu(z) and dt) before writing their final values.

Tensors may be views at any 4-byte offset (they are bound from an aligned offset and the
kernel adds the element offset).  Scratch comes from `rt.scratch`; nothing is allocated per
call and nothing is read back.
"""

from __future__ import annotations

import os

from ..gpu import Recorder, Tensor, bound, cdiv, pack

SHADER = "selective_scan"
WG = 256
MAX_N = WG   # the largest state_size the kernels run (None: no limit); checked before any upload
CHUNK = 64   # checkpoint interval = the chunked backward's chunk (8 * its SUB; multiple of 8 and 4)
ROWS = 64    # rows per partial sum in the column reductions
# Two complete paths, each checked against the other and against torch:
#   serial  (default) one thread per (b, d, n) walks all chunks: measured fastest on an H200
#           (B=8, L=2048, Di=1536, N=16: forward 2.2 ms, backward 11.2 ms per layer);
#   chunked time-parallel over chunks (local pass, serial carry, per-chunk pass): more
#           parallelism, but 2.9 / 21.8 ms on the same H200 (benchmarks/bench.py --variants).
# MEMENGINE_SCAN=chunked makes the model use the chunked kernels.
_SERIAL = os.environ.get("MEMENGINE_SCAN", "serial") != "chunked"


def scan_state_shape(B, L, Di, N) -> tuple:
    """Saved-for-backward states: the SSM state before each chunk of CHUNK steps."""
    return (int(B), cdiv(int(L), CHUNK), int(Di), int(N))


def _layout(B, L, Di, N, R, reference: bool = True):
    if N < 1 or N > WG:
        raise ValueError(f"selective scan supports 1 <= state_size <= {WG}, got {N}")
    M = B * L
    DB = WG // N
    nblk = cdiv(Di, DB)
    nchk = cdiv(L, CHUNK)
    nRB = cdiv(M, ROWS)
    nwgs = B * nblk
    off_ss = off_pa = off_x = off_sdt = Di * N + 2 * Di
    if reference:   # serial backward: chunk states of every workgroup, dA_log partials per b
        off_pa = off_ss + CHUNK * nwgs * WG
        off_colt = off_pa + B * Di * N
    else:           # chunked backward: carries / dA_log partials per (b, c, d, n), sum dt per (b, c, d)
        off_sdt = off_x + B * nchk * Di * N
        off_colt = off_sdt + B * nchk * Di
    off_cold = off_colt + nRB * Di
    work_size = off_cold + nRB * Di
    return dict(M=M, DB=DB, nblk=nblk, nchk=nchk, nRB=nRB, nwgs=nwgs, off_ss=off_ss,
                off_pa=off_pa, off_colt=off_colt, off_cold=off_cold, work_size=work_size,
                pbc_half=M * nblk * N, off_x=off_x, off_sdt=off_sdt)


def _params(rec: Recorder, work: Tensor, dt_bias: Tensor, A_log: Tensor, D: Tensor, Di: int, N: int):
    assert A_log.numel == Di * N and dt_bias.numel == Di and D.numel == Di
    rec.copy(A_log, work.view((Di * N,), 0))
    rec.copy(dt_bias, work.view((Di,), Di * N))
    rec.copy(D, work.view((Di,), Di * N + Di))


def _uniform(rt, B, L, Di, N, R, lay, offs):
    o = dict(y=0, u=0, delta=0, xdbl=0, xz=0, states=0, dy=0, du=0, ddelta=0, dxdbl=0, dxz=0)
    o.update(offs)
    vals = [B, L, Di, N, R, R + 2 * N, CHUNK, lay["nchk"],
            lay["nblk"], lay["DB"], lay["nRB"], ROWS,
            lay["off_ss"], lay["off_pa"], lay["off_colt"], lay["off_cold"],
            o["y"], o["u"], o["delta"], o["xdbl"], o["xz"], o["states"], o["dy"], o["du"],
            o["ddelta"], o["dxdbl"], o["dxz"], lay["pbc_half"], lay["off_x"], lay["off_sdt"], 0, 0]
    return rt.uniform(pack("32I", *vals))


def _check(B, L, Di, N, R, **shapes):
    M = B * L
    want = dict(u=M * Di, delta=M * Di, xdbl=M * (R + 2 * N), xz=M * 2 * Di, y=M * Di, dy=M * Di,
                du=M * Di, ddelta=M * Di, dxdbl=M * (R + 2 * N), dxz=M * 2 * Di)
    for k, t in shapes.items():
        if k in want:
            assert t.numel == want[k], (k, t.shape, want[k])


def selective_scan_forward(rec: Recorder, y, states, u, delta, dt_bias, A_log, D, xdbl, xz,
                           *, B, L, Di, N, R, reference: bool = False, chunked: bool | None = None):
    """y [M, Di] WRITE; states [scan_state_shape] WRITE (unused when reference=True).

    Default: the serial kernel (one thread per (b, d, n) walks all chunks, writes states).
    chunked=True: time-parallel (each chunk's end state from a zero start, a serial carry over
    the chunks that writes `states`, then every chunk's outputs in parallel).  reference=True
    runs the plain sequential kernel (one thread per (b, d)), kept as the check for both (it
    writes no states: not for the backward)."""
    B, L, Di, N, R = int(B), int(L), int(Di), int(N), int(R)
    rt = rec.rt
    if B * L * Di == 0:
        return
    _check(B, L, Di, N, R, y=y, u=u, delta=delta, xdbl=xdbl, xz=xz)
    lay = dict(_layout(B, L, Di, N, R))
    nchk = lay["nchk"]
    lay["off_sdt"] = Di * N + 2 * Di
    work = rt.scratch("selective_scan.fwd_params", (Di * N + 2 * Di + B * nchk * Di,))
    _params(rec, work, dt_bias, A_log, D, Di, N)
    bt = {}
    offs = {}
    for name, t in (("y", y), ("u", u), ("delta", delta), ("xdbl", xdbl), ("xz", xz)):
        bt[name], offs[name] = bound(rt, t)
    if not reference:
        assert states.numel == nchk * B * Di * N, (states.shape, scan_state_shape(B, L, Di, N))
        bt["states"], offs["states"] = bound(rt, states)
    uni = _uniform(rt, B, L, Di, N, R, lay, offs)
    binds = {0: bt["y"], 2: bt["u"], 3: bt["delta"], 4: bt["xdbl"], 5: bt["xz"], 6: work, 14: uni}
    if reference:
        rec.dispatch(SHADER, "selective_scan_forward_ref", binds, cdiv(B * Di, WG))
        return
    rec.dispatch(SHADER, "selective_scan_forward_prep", {0: bt["y"], 3: bt["delta"], 6: work, 14: uni},
                 cdiv(B * L * Di, WG))
    del binds[3]
    binds[1] = bt["states"]
    if chunked is None:
        chunked = not _SERIAL
    if not chunked:
        rec.dispatch(SHADER, "selective_scan_forward", binds, lay["nwgs"])
        return
    if nchk > 1:
        rec.dispatch(SHADER, "selective_scan_forward_local",
                     {0: bt["y"], 1: bt["states"], 2: bt["u"], 4: bt["xdbl"], 6: work, 14: uni},
                     cdiv(B * nchk * Di * N, WG))
    rec.dispatch(SHADER, "selective_scan_forward_carry", {1: bt["states"], 6: work, 14: uni},
                 cdiv(B * Di * N, WG))
    rec.dispatch(SHADER, "selective_scan_forward_chunk", binds, B * nchk * lay["nblk"])


def selective_scan_backward(rec: Recorder, du, ddelta, ddt_bias, dA_log, dD, dxdbl, dxz, dy, states,
                            u, delta, dt_bias, A_log, D, xdbl, xz, *, B, L, Di, N, R, reference: bool | None = None):
    """Gradients of selective_scan_forward; see the module docstring for WRITE/ACC rules.

    reference=True (the default unless MEMENGINE_SCAN=chunked): the serial kernel (one thread
    per (b, d, n) walks all chunks).  reference=False: the chunked, time-parallel backward
    (local adjoint per chunk, serial carry over the chunks, then every chunk's gradients in
    parallel).  Each is tested against the other and against torch autograd."""
    B, L, Di, N, R = int(B), int(L), int(Di), int(N), int(R)
    rt = rec.rt
    if B * L * Di == 0:
        return
    if reference is None:
        reference = _SERIAL
    _check(B, L, Di, N, R, du=du, ddelta=ddelta, dxdbl=dxdbl, dxz=dxz, dy=dy, u=u, delta=delta,
           xdbl=xdbl, xz=xz)
    assert states.numel == cdiv(L, CHUNK) * B * Di * N, (states.shape, scan_state_shape(B, L, Di, N))
    lay = _layout(B, L, Di, N, R, reference)
    M = lay["M"]
    work = rt.scratch("selective_scan.bwd_work" + ("_ref" if reference else ""), (lay["work_size"],))
    pbc = rt.scratch("selective_scan.bwd_pbc", (2 * lay["pbc_half"],))
    _params(rec, work, dt_bias, A_log, D, Di, N)
    bt = {}
    offs = {}
    for name, t in (("u", u), ("delta", delta), ("xdbl", xdbl), ("xz", xz), ("states", states),
                    ("dy", dy), ("du", du), ("ddelta", ddelta), ("dxdbl", dxdbl), ("dxz", dxz)):
        bt[name], offs[name] = bound(rt, t)
    uni = _uniform(rt, B, L, Di, N, R, lay, offs)
    rec.dispatch(SHADER, "selective_scan_backward_prep",
                 {3: bt["delta"], 5: bt["xz"], 6: work, 7: bt["dy"], 8: bt["du"], 9: bt["ddelta"], 14: uni},
                 cdiv(M * Di, WG))
    scan_binds = {1: bt["states"], 2: bt["u"], 4: bt["xdbl"], 6: work, 8: bt["du"], 9: bt["ddelta"],
                  10: bt["dxz"], 11: pbc, 14: uni}
    if reference:
        rec.dispatch(SHADER, "selective_scan_backward", scan_binds, lay["nwgs"])
        dA_parts = (B, lay["off_pa"])
    else:
        nchk = lay["nchk"]
        if nchk > 1:
            rec.dispatch(SHADER, "selective_scan_backward_local",
                         {4: bt["xdbl"], 6: work, 8: bt["du"], 9: bt["ddelta"], 14: uni},
                         cdiv(B * nchk * Di * N, WG))
        rec.dispatch(SHADER, "selective_scan_backward_carry", {6: work, 14: uni}, cdiv(B * Di * N, WG))
        rec.dispatch(SHADER, "selective_scan_backward_chunk", scan_binds, B * nchk * lay["nblk"])
        dA_parts = (B * nchk, lay["off_x"])
    rec.dispatch(SHADER, "selective_scan_backward_finish",
                 {3: bt["delta"], 5: bt["xz"], 6: work, 7: bt["dy"], 9: bt["ddelta"], 10: bt["dxz"], 14: uni},
                 cdiv(M * Di, WG))
    rec.dispatch(SHADER, "selective_scan_backward_colsum",
                 {2: bt["u"], 5: bt["xz"], 6: work, 7: bt["dy"], 9: bt["ddelta"], 14: uni},
                 cdiv(lay["nRB"] * Di, WG))
    rec.dispatch(SHADER, "selective_scan_backward_dbc", {11: pbc, 12: bt["dxdbl"], 14: uni},
                 cdiv(M * N, WG))
    for out, n, K, base, stride in ((ddt_bias, Di, lay["nRB"], lay["off_colt"], Di),
                                    (dD, Di, lay["nRB"], lay["off_cold"], Di),
                                    (dA_log, Di * N, dA_parts[0], dA_parts[1], Di * N)):
        assert out.numel == n, (out.shape, n)
        bo, oo = bound(rt, out)
        q = rt.uniform(pack("8I", n, K, base, stride, oo, 0, 0, 0))
        rec.dispatch(SHADER, "selective_scan_accumulate", {6: work, 13: bo, 15: q}, cdiv(n, WG))
