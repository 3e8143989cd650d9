"""Mamba-2's SSD layer pieces (shaders/ssd.wgsl): the dt transform, the scan (forward and
backward) and the gated RMS norm per group.  Letters as in DEVELOPERS.md's glossary: H heads,
P head_dim, Di = H*P, G groups, N state, C = Di + 2GN (xBC: x | B | C), W = in_proj's
columns (z | xBC | dt: 2Di + 2GN + H), Q steps between saved states.  Rows m = b*L + t.

    dt = clamp(softplus(zxbcdt[:, W-H:] + dt_bias), lo, hi)                       [M, H]
    per head h (group g = h // (H/G)):  h_t = exp(dt_t*A) h_{t-1} + dt_t x_t (x) B_t
                                        y_t = h_t C_t + D x_t,   A = -exp(A_log)
    out = norm_w * rmsnorm_per_group(y * silu(z))                                 [M, Di]

Saved states (the contract the backward relies on, and a decoder may): `states`, shape
`state_shape(B, L, H, P, N)` = [B, NC + 1, H, P, N], NC = ceil(L / Q): entry [b, c] is the
state before step c*Q (zeros for c = 0), entry [b, NC] the state after the last step.

Backward outputs: dxbc [M, C] WRITE (all columns), ddt [M, H] WRITE (the gradient of the raw dt
column of in_proj after `dt_backward`), dA_log, dD, ddt_bias, dnorm_w ACC (None: not wanted).
Batches larger than one binding run in ranges of whole sequences (the scan) or rows.
"""

from __future__ import annotations

import math
import struct

from memengine.engine.runtime import Recorder, Tensor, bound, cdiv, rows, span, split

Q = 16          # steps between saved states (the backward recomputes a chunk from its state)
REDUCE_TERMS = 16384   # the most terms one invocation of ssd_reduce sums (lavapipe stops an
                       # invocation's loops after 65535 iterations in all)
MAX_N = None    # no limit on the state size
WG = 256


def n_chunks(L: int) -> int:
    return cdiv(L, Q)


def state_shape(B: int, L: int, H: int, P: int, N: int) -> tuple:
    return (B, n_chunks(L) + 1, H, P, N)


def _u(B=0, L=0, H=0, P=0, N=0, G=0, NC=0, C=0, Di=0, W=0, nrows=0, offs=(), lo=0.0, hi=math.inf, eps=0.0,
       acc=0) -> bytes:
    offs = tuple(int(o) for o in offs) + (0,) * (8 - len(offs))
    return struct.pack("20I3fI", B, L, H, P, N, G, Q, NC, C, Di, W, nrows, *offs, lo, hi, eps, acc)


def sequence_windows(nb: int, L: int, H: int, P: int, N: int, G: int) -> tuple:
    """Bytes of the model tensors one call over nb sequences binds."""
    Di = H * P
    C = Di + 2 * G * N
    return (4 * nb * L * Di, 4 * nb * L * C, 4 * nb * L * H, 4 * math.prod(state_shape(nb, L, H, P, N)))


def sequence_scratch(nb: int, L: int, H: int, P: int, N: int, G: int, backward: bool = True) -> tuple:
    """Bytes of the backward's scratch for nb sequences: (the two kernels' work, partials,
    per-head dB|dC)."""
    if not backward:
        return (0, 0, 0, 0)
    Di = H * P
    work = 4 * nb * Di * (Q + 1) * N
    return (work, work, 4 * (nb * L * Di + 2 * nb * Di), 4 * nb * L * H * 2 * N)


def _sequences(rt, B, L, H, P, N, G, backward=False) -> list:
    return split(rt, B, lambda nb: sequence_windows(nb, L, H, P, N, G),
                 scratch=(lambda nb: sequence_scratch(nb, L, H, P, N, G)) if backward else None,
                 unit="one sequence of the SSD scan", detail=f"{L} steps of {H} heads x {P} x {N} states",
                 advice="a smaller --seq-len helps")


def _row_ranges(rt, M: int, widths) -> list:
    if rt.unsplit:
        return [(0, M)]
    return split(rt, M, lambda n: tuple(4 * n * w for w in widths), unit="one row of an activation")


def dt_forward(rec: Recorder, dt: Tensor, zxbcdt: Tensor, dt_bias: Tensor, *, M: int, H: int, W: int,
               lo: float, hi: float) -> None:
    """dt[M, H] = clamp(softplus(zxbcdt[:, W-H:] + dt_bias), lo, hi) (WRITE)."""
    rt = rec.rt
    for r0, n in _row_ranges(rt, M, (H, W)):
        (bo, oo), (bi, oi), (bb, ob) = (bound(rt, t) for t in (rows(dt, r0, n, H), rows(zxbcdt, r0, n, W), dt_bias))
        u = rt.uniform(_u(H=H, W=W, nrows=n, offs=(oo, oi, ob), lo=lo, hi=hi))
        rec.dispatch("ssd", "ssd_dt_forward", {0: bo, 1: bi, 2: bb, 3: u}, cdiv(n * H, WG))


def dt_backward(rec: Recorder, dzxbcdt: Tensor, ddt_bias: Tensor | None, ddt: Tensor, zxbcdt: Tensor,
                dt_bias: Tensor, *, M: int, H: int, W: int, lo: float, hi: float) -> None:
    """ddt [M, H] (in place) becomes the raw dt's gradient, written to dzxbcdt[:, W-H:] too;
    ddt_bias += its column sums (ACC)."""
    rt = rec.rt
    for r0, n in _row_ranges(rt, M, (H, W, W)):
        (bg, og), (bi, oi), (bb, ob), (bd, od) = (
            bound(rt, t) for t in (rows(ddt, r0, n, H), rows(zxbcdt, r0, n, W), dt_bias, rows(dzxbcdt, r0, n, W)))
        u = rt.uniform(_u(H=H, W=W, nrows=n, offs=(og, oi, ob, od), lo=lo, hi=hi))
        rec.dispatch("ssd", "ssd_dt_backward", {0: bg, 1: bi, 2: bb, 3: u, 4: bd}, cdiv(n * H, WG))
        if ddt_bias is not None:
            reduce(rec, ddt_bias, rows(ddt, r0, n, H), J=H, R=n, stride=H, P=1, acc=True)


def reduce(rec: Recorder, out: Tensor, x: Tensor, *, J: int, R: int, stride: int, P: int, acc: bool,
           offset: int = 0) -> None:
    """out[j] (+)= sum_{r<R, q<P} x[offset + r*stride + j*P + q] for j < J (in blocks of rows,
    so that no invocation loops more than REDUCE_TERMS times)."""
    rt = rec.rt
    (bo, oo), (bi, oi) = bound(rt, out), bound(rt, x)
    step = max(1, REDUCE_TERMS // max(P, 1))
    for r0 in range(0, max(R, 1), step):
        u = rt.uniform(_u(C=J, W=stride, P=P, nrows=min(step, R - r0), offs=(oo, oi + offset + r0 * stride),
                          acc=int(acc or r0 > 0)))
        rec.dispatch("ssd", "ssd_reduce", {0: bo, 1: bi, 2: u}, cdiv(J, WG))


def _seq(t: Tensor, b0: int, nb: int, per: int) -> Tensor:
    return span(t, b0 * per, nb * per)


def ssd_forward(rec: Recorder, y: Tensor, states: Tensor, xbc: Tensor, dt: Tensor, A_log: Tensor, D: Tensor,
                *, B: int, L: int, H: int, P: int, N: int, G: int) -> None:
    """y[M, Di] (WRITE), states (WRITE, `state_shape`) from xbc [M, C] and dt [M, H]."""
    rt = rec.rt
    Di, NC = H * P, n_chunks(L)
    C = Di + 2 * G * N
    S = (NC + 1) * Di * N
    assert y.numel == B * L * Di and xbc.numel == B * L * C and dt.numel == B * L * H and states.numel == B * S
    if B * L == 0:
        return
    parts = _sequences(rt, B, L, H, P, N, G)
    for b0, nb in parts:
        v = (y, states, xbc, dt) if len(parts) == 1 else (
            _seq(y, b0, nb, L * Di), _seq(states, b0, nb, S), _seq(xbc, b0, nb, L * C), _seq(dt, b0, nb, L * H))
        bs = [bound(rt, t) for t in v + (A_log, D)]
        for c in range(NC):   # a chunk per dispatch (lavapipe caps an invocation's loop iterations)
            u = rt.uniform(_u(B=nb, L=L, H=H, P=P, N=N, G=G, NC=NC, C=C, Di=Di, nrows=c, offs=[o for _, o in bs]))
            rec.dispatch("ssd", "ssd_forward", {**{k: t for k, (t, _) in enumerate(bs)}, 6: u}, cdiv(nb * Di, WG))


def ssd_backward(rec: Recorder, dxbc: Tensor, ddt: Tensor, dA_log: Tensor | None, dD: Tensor | None, dy: Tensor,
                 states: Tensor, xbc: Tensor, dt: Tensor, A_log: Tensor, D: Tensor,
                 *, B: int, L: int, H: int, P: int, N: int, G: int) -> None:
    """dxbc [M, C] WRITE; ddt [M, H] WRITE (the gradient of dt after the clamp); dA_log, dD
    ACC (None: not computed)."""
    rt = rec.rt
    Di, NC = H * P, n_chunks(L)
    C = Di + 2 * G * N
    S = (NC + 1) * Di * N
    if B * L == 0:
        return
    consts = rt.scratch("ssd_consts", (2 * H,))
    rec.copy(A_log, consts.view((H,)))
    rec.copy(D, consts.view((H,), H))
    parts = _sequences(rt, B, L, H, P, N, G, backward=True)
    for b0, nb in parts:
        v = (dy, states, xbc, dt, dxbc, ddt) if len(parts) == 1 else (
            _seq(dy, b0, nb, L * Di), _seq(states, b0, nb, S), _seq(xbc, b0, nb, L * C), _seq(dt, b0, nb, L * H),
            _seq(dxbc, b0, nb, L * C), _seq(ddt, b0, nb, L * H))
        gdy, gst, gx, gdt, gdx, gddt = v
        work_b, _, part_b, bc_b = sequence_scratch(nb, L, H, P, N, G)
        work = rt.scratch("ssd_work", (work_b // 4,))
        work_bc = rt.scratch("ssd_work_bc", (work_b // 4,))
        part = rt.scratch("ssd_part", (part_b // 4,))
        bcpart = rt.scratch("ssd_bc_part", (bc_b // 4,))
        (b0_, o0), (b1, o1), (b2, o2), (b3, o3), (b5, o5) = (bound(rt, t) for t in (gdy, gst, gx, gdt, gdx))
        for c in reversed(range(NC)):   # a chunk per dispatch, the last first
            u = rt.uniform(_u(B=nb, L=L, H=H, P=P, N=N, G=G, NC=NC, C=C, Di=Di, nrows=c,
                              offs=(o0, o1, o2, o3, 0, o5, 0)))
            common = {0: b0_, 1: b2, 2: b3, 3: consts, 4: b1, 6: work, 7: u}
            rec.dispatch("ssd", "ssd_backward_x", {**common, 5: b5, 8: part}, cdiv(nb * Di, WG))
            rec.dispatch("ssd", "ssd_backward_bc", {**common, 6: work_bc, 8: bcpart}, cdiv(nb * H * N, WG))
        M = nb * L
        u = rt.uniform(_u(H=H, N=N, G=G, C=C, Di=Di, nrows=M, offs=(o5, 0)))
        rec.dispatch("ssd", "ssd_bc_sum", {0: b5, 1: bcpart, 2: u}, cdiv(M * G * 2 * N, WG))
        reduce(rec, gddt, part, J=M * H, R=1, stride=0, P=P, acc=False)
        if dA_log is not None:
            reduce(rec, dA_log, part, J=H, R=nb, stride=Di, P=P, acc=True, offset=M * Di)
        if dD is not None:
            reduce(rec, dD, part, J=H, R=nb, stride=Di, P=P, acc=True, offset=M * Di + nb * Di)


def gnorm_forward(rec: Recorder, out: Tensor, rstd: Tensor, y: Tensor, zxbcdt: Tensor, weight: Tensor,
                  eps: float, *, M: int, Di: int, G: int, W: int) -> None:
    """out[M, Di] = weight * rmsnorm_per_group(y * silu(zxbcdt[:, :Di])) (WRITE); rstd [M, G] WRITE."""
    rt = rec.rt
    for r0, n in _row_ranges(rt, M, (Di, Di, W)):
        bs = [bound(rt, t) for t in (rows(out, r0, n, Di), rows(rstd, r0, n, G), rows(y, r0, n, Di),
                                     rows(zxbcdt, r0, n, W), weight)]
        u = rt.uniform(_u(G=G, Di=Di, W=W, nrows=n, offs=[o for _, o in bs], eps=eps))
        rec.dispatch("ssd", "gnorm_forward", {**{k: t for k, (t, _) in enumerate(bs)}, 5: u}, cdiv(n * G, WG))


def gnorm_backward(rec: Recorder, dy: Tensor, dzxbcdt: Tensor, dweight: Tensor | None, dout: Tensor, y: Tensor,
                   zxbcdt: Tensor, weight: Tensor, rstd: Tensor, *, M: int, Di: int, G: int, W: int) -> None:
    """dy [M, Di] WRITE; dzxbcdt[:, :Di] WRITE (the gate's gradient); dweight [Di] ACC."""
    rt = rec.rt
    ranges = _row_ranges(rt, M, (Di, Di, W, Di, W))
    for r0, n in ranges:
        part = rt.scratch("gnorm_part", (n * Di,))
        bs = [bound(rt, t) for t in (rows(dout, r0, n, Di), rows(y, r0, n, Di), rows(zxbcdt, r0, n, W), weight,
                                     rows(rstd, r0, n, G), rows(dy, r0, n, Di), rows(dzxbcdt, r0, n, W), part)]
        u = rt.uniform(_u(G=G, Di=Di, W=W, nrows=n, offs=[o for _, o in bs]))
        rec.dispatch("ssd", "gnorm_backward", {**{k: t for k, (t, _) in enumerate(bs)}, 8: u}, cdiv(n * G, WG))
        if dweight is not None:
            reduce(rec, dweight, part, J=Di, R=n, stride=Di, P=1, acc=True)


# ------------------------------------------------------------------ recurrent decoding (batch 1)
def conv_prefill(rec: Recorder, cstate: Tensor, zxbcdt: Tensor, *, L: int, Di: int, C: int, W: int, K: int) -> None:
    """cstate [K-1, C] = the xBC columns of the prompt's last K-1 rows of zxbcdt [L, W]
    (zeros before row 0)."""
    if K <= 1:
        return
    rt = rec.rt
    r0 = max(0, L - (K - 1))
    (bs, os_), (bx, ox) = bound(rt, cstate), bound(rt, zxbcdt.view(((L - r0) * W,), r0 * W))
    u = rt.uniform(_uk(K, L=L - r0, C=C, Di=Di, W=W, offs=(0, os_, ox)))
    rec.dispatch("ssd", "ssd_conv_prefill", {1: bs, 2: bx, 5: u}, cdiv((K - 1) * C, WG))


def _uk(K, **kw) -> bytes:
    """The uniform block with Q holding the conv width K (the decode kernels' use of it)."""
    b = bytearray(_u(**kw))
    struct.pack_into("I", b, 6 * 4, K)
    return bytes(b)


def conv_step(rec: Recorder, xbc: Tensor, cstate: Tensor, zx: Tensor, weight: Tensor, bias: Tensor | None, *,
              Di: int, C: int, K: int) -> None:
    """xbc [C] = silu(conv) of the state and zx[Di:Di+C] (WRITE); the state shifted by one."""
    rt = rec.rt
    (bo, oo), (bs, os_), (bx, ox), (bw, ow) = (bound(rt, t) for t in (xbc, cstate, zx, weight))
    bb, ob = bound(rt, bias) if bias is not None else (bw, 0)
    u = rt.uniform(_uk(K, C=C, Di=Di, offs=(oo, os_, ox, ow, ob), acc=int(bias is not None)))
    rec.dispatch("ssd", "ssd_conv_step", {0: bo, 1: bs, 2: bx, 3: bw, 4: bb, 5: u}, cdiv(C, WG))


def ssd_step(rec: Recorder, y: Tensor, state: Tensor, xbc: Tensor, dt: Tensor, A_log: Tensor, D: Tensor, *,
             H: int, P: int, N: int, G: int) -> None:
    """state [H, P, N] one step on (xbc [C], dt [H]); y [Di] = state . C + D x (WRITE)."""
    rt = rec.rt
    Di = H * P
    bs = [bound(rt, t) for t in (y, state, xbc, A_log, D, dt)]
    u = rt.uniform(_u(H=H, P=P, N=N, G=G, Di=Di, offs=[o for _, o in bs]))
    rec.dispatch("ssd", "ssd_step", {0: bs[0][0], 1: bs[1][0], 2: bs[2][0], 3: bs[3][0], 4: bs[4][0], 5: u,
                                     6: bs[5][0]}, cdiv(Di, WG))
