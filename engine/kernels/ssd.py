"""Mamba-2's SSD layer pieces: the dt transform, the scan (forward and backward, in its chunked
matrix form: shaders/ssd_scan.wgsl), the gated RMS norm per group and the decode step
(shaders/ssd.wgsl).  Letters as in DEVELOPERS.md's glossary: H heads, P head_dim, Di = H*P,
G groups, N state, C = Di + 2GN (xBC: x | B | C), W = in_proj's columns (z | xBC | dt:
2Di + 2GN + H), Q steps per chunk.  Rows m = b*L + t.

    dt = clamp(softplus(zxbcdt[:, W-H:] + dt_bias), lo, hi)                       [M, H]
    per head h (group g = h // (H/G)):  h_t = exp(dt_t*A) h_{t-1} + dt_t x_t (x) B_t
                                        y_t = h_t C_t + D x_t,   A = -exp(A_log)
    out = norm_w * rmsnorm_per_group(y * silu(z))                                 [M, Di]

The scan works a chunk of Q steps at a time: within a chunk as matrix products (C B^T masked
and decay-weighted, times x; the state entering the chunk times C), between chunks the state
passed on (ssd_scan.wgsl's header has the formulas and the products).  The config's
`chunk_size` only changes transformers' rounding, not the result; memengine's Q is fixed.

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

from memengine.engine.kernels.lanes import cpu_lanes, is_cpu, row_workgroup
from memengine.engine.runtime import Recorder, Tensor, bound, cdiv, rows, span, split

Q = 64          # steps per chunk of the SSD (its matrix form within, its state passed between)
T = 64          # ssd_product's output tile side
REDUCE_TERMS = 16384   # the most terms one invocation of ssd_reduce sums (lavapipe stops an
                       # invocation's loops after 65535 iterations in all)
REDUCE_ROWS = 64       # rows one invocation sums in a column sum's first pass
MAX_N = None    # no limit on the state size
WG = 256
# the products of shaders/ssd_scan.wgsl (its MODE pipeline constant)
CHUNK_STATE, CB, OUTPUT, DSTATE, DX, DCB, DC, DB = range(1, 9)


def n_chunks(L: int) -> int:
    return cdiv(L, Q)


def state_shape(B: int, L: int, H: int, P: int, N: int) -> tuple:
    return (B, n_chunks(L) + 1, H, P, N)


def _u(B=0, L=0, H=0, P=0, N=0, G=0, NC=0, C=0, Di=0, W=0, nrows=0, offs=(), lo=0.0, hi=math.inf, eps=0.0,
       acc=0) -> bytes:
    offs = tuple(int(o) for o in offs) + (0,) * (8 - len(offs))
    return struct.pack("20I3fI", B, L, H, P, N, G, Q, NC, C, Di, W, nrows, *offs, lo, hi, eps, acc)


def _small_len(nb: int, NC: int, H: int) -> int:
    """A_log [H] | D [H] | the decay logs [nb, NC, H, Q] | dlast, dA_log and dD terms [nb, NC, H]
    | their exps and exp(last - a) [nb, NC, H, Q] each."""
    return 2 * H + nb * NC * H * (3 * Q + 3)


def sequence_windows(nb: int, L: int, H: int, P: int, N: int, G: int) -> tuple:
    """Bytes of the model tensors one call over nb sequences binds."""
    Di = H * P
    C = Di + 2 * G * N
    return (4 * nb * L * Di, 4 * nb * L * C, 4 * nb * L * H, 4 * math.prod(state_shape(nb, L, H, P, N)))


LANE_MAX_L = 16384   # the longest sequence the 8-lane kernels walk (an invocation's loops run
                     # about 2L iterations, under lavapipe's 65535)


def lane_shape(L: int, P: int, N: int) -> bool:
    """The shapes the 8-lane kernels (shaders/ssd_lanes.wgsl) take: head_dim a multiple of 8
    (a workgroup's 8 channels share a head), N a multiple of 4 and at most 16 or a multiple of
    16 (passes of up to 64 states: `lane_split`)."""
    return P % 8 == 0 and N % 4 == 0 and (N <= 16 or N % 16 == 0) and 0 < L <= LANE_MAX_L


def _lanes_fit(r, L: int, H: int, P: int, N: int, G: int) -> bool:
    """Whether one sequence's 8-lane scratch (its dB/dC partials: L x Di/8 x 2N values) fits
    one binding of the adapter; where not, the chunked kernels run (their scratch is smaller)."""
    return max(sequence_scratch(1, L, H, P, N, G, True, True)) <= r.adapter_max_binding - r.storage_align


def takes_lanes(rt, L: int, H: int, P: int, N: int, G: int) -> bool:
    """Whether the runtime's scans of this shape take the 8-lane kernels (CPU adapters with
    8-lane subgroups, `rt.kernels.ssd_lanes`)."""
    return bool(rt.kernels.ssd_lanes and lane_shape(L, P, N) and cpu_lanes(rt) and _lanes_fit(rt, L, H, P, N, G))


def plan_lanes(lim, L: int, H: int, P: int, N: int, G: int) -> bool:
    """`takes_lanes` for a memory plan's limits (plan.Limits)."""
    return bool(lim.lanes and lim.kernels.ssd_lanes and lane_shape(L, P, N) and _lanes_fit(lim, L, H, P, N, G))


def lane_split(N: int) -> tuple:
    """(NQ, KG, passes) of the 8-lane kernels: a lane keeps a pass's states in KG quads of NQ
    vec4s, one dispatch a pass; N <= 16 one quad of N/4, else passes of the most quads (up to
    4, 64 states) that divide N: one pass of 64 states ran the forward 1.8-2.1x faster than
    four of 16 at mamba2-small (dt, x and dy are loaded again every pass)."""
    if N <= 16:
        return N // 4, 1, 1
    per = max(s for s in (64, 48, 32, 16) if N % s == 0)
    return 4, per // 16, N // per


def lane_passes(N: int) -> int:
    return lane_split(N)[2]


def sequence_scratch(nb: int, L: int, H: int, P: int, N: int, G: int, backward: bool = True,
                     lanes: bool = False) -> tuple:
    """Bytes of the scratch for nb sequences: (small, CB, and for the backward the state
    gradients, the dx terms, the group's dCB); the 8-lane kernels' (`lanes`): none forward, the backward's
    dB/dC partials and its ddt, dA_log and dD terms."""
    NC = n_chunks(L)
    if lanes:
        Di = H * P
        return () if not backward else (4 * nb * L * (Di // 8) * 2 * N, 4 * _part_len(nb, L, Di, N))
    fwd = (4 * _small_len(nb, NC, H), 4 * nb * NC * G * Q * Q)
    if not backward:
        return fwd
    return fwd + (4 * math.prod(state_shape(nb, L, H, P, N)), 4 * nb * L * H * P, 4 * nb * NC * G * Q * Q)


def _part_len(nb: int, L: int, Di: int, N: int) -> int:
    """The 8-lane backward's `part`: ddt terms [passes, nb*L, Di] | dA_log terms [passes, nb, Di] | dD [nb, Di]."""
    return lane_passes(N) * nb * (L + 1) * Di + nb * Di


def _sequences(rt, B, L, H, P, N, G, backward=False, lanes=False) -> list:
    return split(rt, B, lambda nb: sequence_windows(nb, L, H, P, N, G),
                 scratch=lambda nb: sequence_scratch(nb, L, H, P, N, G, backward, lanes),
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
    """out[j] (+)= sum_{r<R, q<P} x[offset + r*stride + j*P + q] for j < J: blocks of rows summed
    side by side, then the blocks' sums (no invocation loops more than REDUCE_TERMS times)."""
    rt = rec.rt
    rows_per = max(1, min(REDUCE_ROWS, REDUCE_TERMS // max(P, 1)))
    nblk = cdiv(max(R, 1), rows_per)
    if nblk == 1 or J * nblk * 4 > rt.max_binding:
        step = max(1, REDUCE_TERMS // max(P, 1))
        for r0 in range(0, max(R, 1), step):
            _reduce_pass(rec, out, x, J=J, R=min(step, R - r0), rows_per=step, nblk=1, stride=stride, P=P,
                         acc=acc or r0 > 0, offset=offset + r0 * stride)
        return
    part = rt.scratch("ssd_reduce_blocks", (J * nblk,))
    _reduce_pass(rec, part, x, J=J, R=R, rows_per=rows_per, nblk=nblk, stride=stride, P=P, acc=False,
                 offset=offset)
    reduce(rec, out, part, J=J, R=nblk, stride=J, P=1, acc=acc)


def reduce_scratch(J: int, R: int, P: int, max_binding: int) -> set:
    """The element counts of the block-sum scratch `reduce` takes for one call."""
    out = set()
    while True:
        rows_per = max(1, min(REDUCE_ROWS, REDUCE_TERMS // max(P, 1)))
        nblk = cdiv(max(R, 1), rows_per)
        if nblk == 1 or J * nblk * 4 > max_binding:
            return out
        out.add(J * nblk)
        R, P = nblk, 1


def _reduce_pass(rec, out, x, *, J, R, rows_per, nblk, stride, P, acc, offset) -> None:
    rt = rec.rt
    (bo, oo), (bi, oi) = bound(rt, out), bound(rt, x)
    u = rt.uniform(_u(C=J, N=nblk, G=rows_per, W=stride, P=P, nrows=R, offs=(oo, oi + offset), acc=int(acc)))
    rec.dispatch("ssd", "ssd_reduce", {0: bo, 1: bi, 2: u}, cdiv(J * nblk, WG))


def _seq(t: Tensor, b0: int, nb: int, per: int) -> Tensor:
    return span(t, b0 * per, nb * per)


class _Scan:
    """One call of the chunked scan over nb sequences: the bound views, the uniform's offsets
    and the dispatches of shaders/ssd_scan.wgsl."""

    def __init__(self, rec, nb, L, H, P, N, G, views: dict):
        self.rec, self.rt = rec, rec.rt
        self.nb, self.L, self.H, self.P, self.N, self.G = nb, L, H, P, N, G
        self.NC = n_chunks(L)
        self.Di = H * P
        self.C = self.Di + 2 * G * N
        self.b = {k: bound(self.rt, t) for k, t in views.items()}
        self.shape = {"H": H, "P": P, "N": N, "G": G, "Q": Q}   # the shader's pipeline constants
        self.small = self.rt.scratch("ssd_small", (_small_len(nb, self.NC, H),))
        self.dummy = self.rt.scratch("ssd_dummy", (4,))
        z = nb * self.NC * H
        self.o_acs = 2 * H
        self.o_dl = self.o_acs + z * Q
        self.o_pa, self.o_pd = self.o_dl + z, self.o_dl + 2 * z
        self.o_ei = self.o_pd + z
        self.o_eo = self.o_ei + z * Q

    def constants(self, A_log, D) -> None:
        self.rec.copy(A_log, self.small.view((self.H,)))
        self.rec.copy(D, self.small.view((self.H,), self.H))

    def _uniform(self, Z, ntile, out=None, a1=None, a2=None, a3=None, out2=None) -> bytes:
        off = lambda k: self.b[k][1] if k is not None else 0
        return struct.pack("20I", self.nb, self.L, self.NC, Z, ntile, off(out), off("xbc"), off("dt"), off(a1),
                           off(a2), off(a3), off(out2), self.o_acs, self.o_dl, self.o_pa, self.o_pd, self.o_ei,
                           self.o_eo, 0, 0)

    def _bind(self, out, a1, a2, a3, out2) -> dict:
        t = lambda k, alt: self.b[k][0] if k is not None else alt
        x = self.b["xbc"][0]
        return {0: t(out, self.dummy), 1: x, 2: self.b["dt"][0], 3: self.small, 4: t(a1, x), 5: t(a2, x),
                6: t(a3, x), 7: t(out2, self.rt.scratch("ssd_dummy2", (4,)))}

    def product(self, mode: int, out, a1=None, a2=None, a3=None, out2=None) -> None:
        H, P, N, G = self.H, self.P, self.N, self.G
        Z = self.nb * self.NC * (G if mode in (CB, DCB, DC, DB) else H)
        R, S = {CHUNK_STATE: (P, N), CB: (Q, Q), OUTPUT: (Q, P), DSTATE: (P, N), DX: (Q, P), DCB: (Q, Q),
                DC: (Q, N), DB: (Q, N)}[mode]
        ntile = cdiv(R, T) * cdiv(S, T)
        u = self.rt.uniform(self._uniform(Z, ntile, out, a1, a2, a3, out2))
        self.rec.dispatch("ssd_scan", "ssd_product", {**self._bind(out, a1, a2, a3, out2), 8: u}, ntile * Z,
                          {**self.shape, "MODE": mode, "STAGED": int(not is_cpu(self.rt))})

    def small_kernel(self, entry: str, Z: int, groups: int, out=None, a1=None, a2=None, a3=None,
                     slots=()) -> None:
        u = self.rt.uniform(self._uniform(Z, 1, out, a1, a2, a3))
        b = {**self._bind(out, a1, a2, a3, None), 8: u}
        self.rec.dispatch("ssd_scan", entry, {k: b[k] for k in slots + (3, 8)}, groups, self.shape)

    def cumsum(self) -> None:
        Z = self.nb * self.NC * self.H
        self.small_kernel("ssd_cumsum", Z, cdiv(Z, WG // Q), slots=(2,))   # 256 / Q chunk-heads a workgroup

    def state_pass(self, entry: str, out) -> None:
        Z = self.nb * self.H * self.P * self.N
        self.small_kernel(entry, Z, cdiv(Z, WG), out=out, slots=(0,))


class _Lanes:
    """One call of the 8-lane scan (shaders/ssd_lanes.wgsl) over nb sequences: a workgroup of
    8 lanes per (sequence, 8 channels), one dispatch per pass (`lane_split`)."""

    KEYS = ("y", "states", "xbc", "dt", "A", "D", "dy", "dxbc", "ddt")

    def __init__(self, rec, nb, L, H, P, N, G, views: dict):
        self.rec, self.rt = rec, rec.rt
        self.nb, self.L, self.H, self.P, self.N, self.G = nb, L, H, P, N, G
        self.NC, self.Di = n_chunks(L), H * P
        self.nblk = self.Di // 8
        self.b = {k: bound(self.rt, t) for k, t in views.items()}
        for k in ("xbc", "states", "dxbc"):   # read or written as vec4s
            assert k not in self.b or self.b[k][1] % 4 == 0, (k, self.b[k][1])
        NQ, KG, _ = lane_split(N)
        self.shape = {"H": H, "P": P, "N": N, "G": G, "Q": Q, "NQ": NQ, "KG": KG}
        self.npass = lane_passes(N)

    def _uniform(self, total=0, o_pa=0, o_pd=0) -> object:
        off = [self.b[k][1] if k in self.b else 0 for k in self.KEYS]
        y, st, x, dt, A, D, dy, dx, ddt = off
        return self.rt.uniform(struct.pack("16I", self.nb, self.L, self.NC, self.nblk, y, st, x, dt, A, D, dy, dx,
                                           ddt, o_pa, o_pd, total))

    def forward(self) -> None:
        b = self.b
        u = self._uniform()
        for p in range(self.npass):
            self.rec.dispatch("ssd_lanes", "ssd_lanes_forward",
                              {0: b["y"][0], 1: b["states"][0], 2: b["xbc"][0], 3: b["dt"][0], 4: b["A"][0],
                               5: b["D"][0], 6: u}, self.nb * self.nblk, {**self.shape, "PASS": p})

    def backward(self, dA_log, dD) -> None:
        rt, b, nb, L, Di, N = self.rt, self.b, self.nb, self.L, self.Di, self.N
        pbc = rt.scratch("ssd_lanes_pbc", (nb * L * self.nblk * 2 * N,))
        part = rt.scratch("ssd_lanes_part", (_part_len(nb, L, Di, N),))
        o_pa = self.npass * nb * L * Di
        o_pd = o_pa + self.npass * nb * Di
        u = self._uniform(o_pa=o_pa, o_pd=o_pd)
        for p in range(self.npass):
            self.rec.dispatch("ssd_lanes", "ssd_lanes_backward",
                              {1: b["states"][0], 2: b["xbc"][0], 3: b["dt"][0], 4: b["A"][0], 5: b["D"][0],
                               6: u, 7: b["dy"][0], 8: b["dxbc"][0], 9: pbc, 10: part},
                              self.nb * self.nblk, {**self.shape, "PASS": p})
        self.rec.dispatch("ssd_lanes", "ssd_lanes_finish",
                          {6: self._uniform(total=nb * L), 8: b["dxbc"][0], 9: pbc, 10: part, 11: b["ddt"][0]},
                          nb * L, self.shape)
        if dA_log is not None:
            reduce(self.rec, dA_log, part, J=self.H, R=self.npass * nb, stride=Di, P=self.P, acc=True, offset=o_pa)
        if dD is not None:
            reduce(self.rec, dD, part, J=self.H, R=nb, stride=Di, P=self.P, acc=True, offset=o_pd)


def _views(parts, b0, nb, L, per: dict) -> dict:
    """The tensors of sequences b0 .. b0+nb (whole when there is one part)."""
    if len(parts) == 1:
        return {k: t for k, (t, _) in per.items()}
    return {k: _seq(t, b0, nb, n) for k, (t, n) in per.items()}


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
    lanes = takes_lanes(rt, L, H, P, N, G)
    parts = _sequences(rt, B, L, H, P, N, G, lanes=lanes)
    for b0, nb in parts:
        v = _views(parts, b0, nb, L, {"y": (y, L * Di), "states": (states, S), "xbc": (xbc, L * C),
                                      "dt": (dt, L * H)})
        if lanes:
            _Lanes(rec, nb, L, H, P, N, G, {**v, "A": A_log, "D": D}).forward()
            continue
        v["cb"] = rt.scratch("ssd_cb", (nb * NC * G * Q * Q,))
        s = _Scan(rec, nb, L, H, P, N, G, v)
        s.constants(A_log, D)
        s.cumsum()
        s.product(CHUNK_STATE, "states")
        s.state_pass("ssd_state_pass", "states")
        s.product(CB, "cb")
        s.product(OUTPUT, "y", a1="cb", a3="states")


def ssd_backward(rec: Recorder, dxbc: Tensor, ddt: Tensor, dA_log: Tensor | None, dD: Tensor | None, dy: Tensor,
                 y: Tensor, states: Tensor, xbc: Tensor, dt: Tensor, A_log: Tensor, D: Tensor,
                 *, B: int, L: int, H: int, P: int, N: int, G: int) -> None:
    """dxbc [M, C] WRITE; ddt [M, H] WRITE (the gradient of dt after the clamp); dA_log, dD
    ACC (None: not computed).  y and states: the forward's."""
    rt = rec.rt
    Di, NC = H * P, n_chunks(L)
    C = Di + 2 * G * N
    S = (NC + 1) * Di * N
    if B * L == 0:
        return
    lanes = takes_lanes(rt, L, H, P, N, G)
    parts = _sequences(rt, B, L, H, P, N, G, backward=True, lanes=lanes)
    for b0, nb in parts:
        v = _views(parts, b0, nb, L, {"dy": (dy, L * Di), "y": (y, L * Di), "states": (states, S),
                                      "xbc": (xbc, L * C), "dt": (dt, L * H), "dxbc": (dxbc, L * C),
                                      "ddt": (ddt, L * H)})
        if lanes:
            _Lanes(rec, nb, L, H, P, N, G, {**v, "A": A_log, "D": D}).backward(dA_log, dD)
            continue
        v["cb"] = rt.scratch("ssd_cb", (nb * NC * G * Q * Q,))
        v["dstates"] = rt.scratch("ssd_dstates", (nb * S,))
        v["part"] = rt.scratch("ssd_part", (nb * L * Di,))
        v["dcb"] = rt.scratch("ssd_dcb", (nb * NC * G * Q * Q,))
        s = _Scan(rec, nb, L, H, P, N, G, v)
        s.constants(A_log, D)
        s.cumsum()
        s.product(CB, "cb")
        s.product(DSTATE, "dstates", a2="dy")
        s.state_pass("ssd_dstate_pass", "dstates")
        z = nb * NC * H
        s.small_kernel("ssd_dlast", z, z, a1="states", a3="dstates", slots=(4, 6))
        s.product(DX, "dxbc", a1="cb", a2="dy", a3="dstates", out2="part")
        s.product(DCB, "dcb", a2="dy")
        s.product(DC, "dxbc", a1="dcb", a2="dy", a3="states")
        s.product(DB, "dxbc", a1="dcb", a3="dstates")
        s.small_kernel("ssd_dt_chunk", z, z, out="ddt", a1="part", a2="dy", a3="y", slots=(0, 1, 2, 4, 5, 6))
        if dA_log is not None:
            reduce(rec, dA_log, s.small, J=H, R=nb * NC, stride=H, P=1, acc=True, offset=s.o_pa)
        if dD is not None:
            reduce(rec, dD, s.small, J=H, R=nb * NC, stride=H, P=1, acc=True, offset=s.o_pd)


def _gnorm_lanes(rt, Di: int, G: int, W: int, bs, skip=()) -> bool:
    """Whether the gated norm takes its 8-lane kernels (shaders/ssd_lanes.wgsl): CPU adapters
    with 8-lane subgroups, rows and groups of whole vec4s (`bs`: the bound tensors; those in
    `skip` are read as scalars)."""
    return (Di % 4 == 0 and W % 4 == 0 and (Di // G) % 4 == 0 and rt.kernels.ssd_lanes and cpu_lanes(rt)
            and all(o % 4 == 0 for k, (_, o) in enumerate(bs) if k not in skip))


def gnorm_forward(rec: Recorder, out: Tensor, rstd: Tensor, y: Tensor, zxbcdt: Tensor, weight: Tensor,
                  eps: float, *, M: int, Di: int, G: int, W: int) -> None:
    """out[M, Di] = weight * rmsnorm_per_group(y * silu(zxbcdt[:, :Di])) (WRITE); rstd [M, G] WRITE."""
    rt = rec.rt
    for r0, n in _row_ranges(rt, M, (Di, Di, W)):
        bs = [bound(rt, t) for t in (rows(out, r0, n, Di), rows(rstd, r0, n, G), rows(y, r0, n, Di),
                                     rows(zxbcdt, r0, n, W), weight)]
        u = rt.uniform(_u(G=G, Di=Di, W=W, nrows=n, offs=[o for _, o in bs], eps=eps))
        b = {**{k: t for k, (t, _) in enumerate(bs)}, 5: u}
        if _gnorm_lanes(rt, Di, G, W, bs, skip=(1,)):
            rec.dispatch("ssd_lanes", "gnorm_lanes_forward", b, n * G)
        else:
            rec.dispatch("ssd", "gnorm_forward", b, n * G, row_workgroup(rt, Di // G, WG))


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
        b = {**{k: t for k, (t, _) in enumerate(bs)}, 8: u}
        if _gnorm_lanes(rt, Di, G, W, bs, skip=(4,)):
            rec.dispatch("ssd_lanes", "gnorm_lanes_backward", b, n * G)
        else:
            rec.dispatch("ssd", "gnorm_backward", b, n * G, row_workgroup(rt, Di // G, WG))
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
