"""Selective scan (shaders/selective_scan.wgsl): Mamba-1's SSM recurrence, forward and backward.

Semantics (SPEC section 2, transformers' MambaMixer.slow_forward), rows m = b*L + t:

    dt  = softplus(delta + dt_bias)          delta [M, Di] is dt_proj's output WITHOUT bias
    A   = -exp(A_log)                        [Di, N]
    Bm  = xdbl[:, R:R+N],  Cm = xdbl[:, R+N:R+2N]       xdbl [M, R+2N]
    z   = xz[:, Di:2Di]                                  xz [M, 2Di]
    s_t = exp(dt_t*A) * s_{t-1} + dt_t*Bm_t*u_t          (s_{-1} = 0 per batch row)
    y_t = (sum_n s_t*Cm_t + D*u_t) * silu(z_t)

Saved state (the contract the backward and the decoder rely on): `selective_scan_forward`
writes into `states`, shape `scan_state_shape(B, L, Di, N)` = [B, ceil(L / CHUNK), Di, N],
entry [b, c, d, n] = s_{c*CHUNK - 1}[d, n] of batch row b, the state *before* step c*CHUNK
(zeros for c = 0).  The backward recomputes every chunk from it.

Kernels: a workgroup per (batch row, block of 16 channels); each chunk of CHUNK steps is
split into 8 segments of 8 steps, one thread per (segment, channel), and the segments are
joined by a parallel scan of (decay, state) pairs; the state dimension is in registers.
The shader's header comment has the details.  On CPU adapters with 8-lane subgroups
(lavapipe) the shader's scan_lanes_forward / scan_lanes_backward run instead: a workgroup
of one 8-lane subgroup per (batch row, 8 channels), each lane walking the sequence step by
step (the same saved states and partial sums; `rt.kernels.scan_lanes = False` keeps the
kernels above).
They read Bm|Cm as one vec4 a lane where time_step_rank and xdbl's offset are multiples of 4,
else as four scalars (the pipeline constant BC4).

Backward: dy may be du itself (the kernels read each step's dy from du before they write
its du; a dy elsewhere is first copied into du).  Outputs: du, ddelta WRITE; ddt_bias, dA_log, dD ACC (+=; None: not computed); dxdbl
WRITE on columns R..R+2N only; dxz WRITE on columns Di..2Di only.

Tensors may be views at any 4-byte offset (they are bound from an aligned offset and the
kernel adds the element offset).  Scratch comes from `rt.scratch`; nothing is allocated per
call and nothing is read back.  Batches whose tensors or scratch would not fit one storage
binding are scanned in ranges of whole sequences (batch rows), one call each (the ACC
outputs add up over the ranges).
"""

from __future__ import annotations

import functools

from memengine.engine.kernels.lanes import cpu_lanes
from memengine.engine.runtime import Recorder, Tensor, bound, cdiv, pack, span, split

SHADER = "selective_scan"
CHUNK = 64   # steps per chunk: the saving interval of `states` (the shader's T = SEG * K)
DB = 16      # channels per workgroup (the shader's DB)
# the largest state_size the kernels run (None: no limit; checked before any upload): the
# state dimension is walked in passes of 16 states over workgroup memory, any N fits
MAX_N = None
# rt.kernels.scan_subgroups = False: the backward's channel sums go through workgroup memory
# even where the adapter has subgroups; rt.kernels.scan_lanes = False: the kernels above even
# where the 8-lane scan runs (the tests run every way; runtime/settings.py)
LANE_DB = 8      # channels per workgroup of the 8-lane scan
LANE_MAX_N = 16  # the state sizes it takes: N <= 16, N % 4 == 0


def scan_lanes(rt) -> bool:
    """Whether the runtime's scans may take the 8-lane kernels: it takes the 8-lane kernels
    (kernels/lanes.py) and `rt.kernels.scan_lanes` lets the scan use them."""
    return cpu_lanes(rt) and rt.kernels.scan_lanes


def channels_per_workgroup(lanes: bool, N: int) -> int:
    """LANE_DB where the 8-lane scan may run (`lanes`: `scan_lanes(rt)`), else DB: it sizes
    the backward's dB/dC partials (the larger size where a call may still take the other
    kernels, see `_lanes`)."""
    return LANE_DB if lanes and N <= LANE_MAX_N and N % 4 == 0 else DB


def _lanes(rt, N: int, R: int, xdbl_off: int) -> bool:
    """Whether this call runs the 8-lane scan (any time_step_rank: `_lane_constants`)."""
    return channels_per_workgroup(scan_lanes(rt), N) == LANE_DB


def _lane_constants(N: int, R: int, xdbl_off: int) -> dict:
    """The 8-lane scan reads Bm|Cm as one vec4 a lane where their columns start at multiples
    of 4 (time_step_rank R, and xdbl's element offset), else as four scalars (BC4 0)."""
    return {"NS": N, "BC4": int(R % 4 == 0 and (xdbl_off + R) % 4 == 0)}


def scan_state_shape(B, L, Di, N) -> tuple:
    """Saved-for-backward states: the SSM state before each chunk of CHUNK steps."""
    return (int(B), cdiv(int(L), CHUNK), int(Di), int(N))


@functools.lru_cache(maxsize=256)
def _layout(B, L, Di, N, db=DB):
    M = B * L
    nblk = cdiv(Di, db)
    nchk = cdiv(L, CHUNK)
    off_st = Di * N + 2 * Di              # after the parameters: a copy of `states`
    off_hc = off_st + B * nchk * Di * N   # adjoint carried between chunks, per (b, d, n)
    off_pa = off_hc + B * Di * N          # dA_log partials per (b, d, n)
    off_pb = off_pa + B * Di * N          # dt_bias partials per (b, d)
    off_pd = off_pb + B * Di              # D partials per (b, d)
    off_q = off_pd + B * Di               # the butterfly's lane count (butterfly_lanes)
    off_pbc = cdiv(off_q + 1, 64) * 64    # dBm, then dCm partials per (m, block, n), 256-byte aligned
    pbc_half = M * nblk * N
    return dict(M=M, nblk=nblk, nchk=nchk, off_st=off_st, off_hc=off_hc, off_pa=off_pa,
                off_pb=off_pb, off_pd=off_pd, off_q=off_q, off_pbc=off_pbc,
                work_size=off_pbc + 2 * pbc_half, pbc_half=pbc_half)


def sequence_windows(B, L, Di, N, R) -> list:
    """Bytes of the largest tensor windows a scan over B sequences binds (xz, xdbl, states;
    y, u, delta and their gradients are smaller than xz)."""
    return [4 * B * L * 2 * Di, 4 * B * L * (R + 2 * N), 4 * B * cdiv(L, CHUNK) * Di * N]


@functools.lru_cache(maxsize=256)
def sequence_scratch(B, L, Di, N, R, db=DB, backward=True) -> list:
    """Bytes of the scan's own scratch for B sequences: the forward's parameter copy (the
    same for any B) and, with `backward`, the backward's work buffer, which holds its dB/dC
    partials (`db` channels per workgroup: LANE_DB where the 8-lane scan runs)."""
    params = 4 * (Di * N + 2 * Di)
    return [params, 4 * _layout(B, L, Di, N, db)["work_size"]] if backward else [params]


def _sequences(rt, B, L, Di, N, R, backward: bool) -> list:
    db = channels_per_workgroup(scan_lanes(rt), N)
    return split(rt, B, lambda nb: sequence_windows(nb, L, Di, N, R),
                 scratch=lambda nb: sequence_scratch(nb, L, Di, N, R, db, backward),
                 unit="one sequence of the selective scan", detail=f"seq_len {L}",
                 advice="a smaller --seq-len helps")


def _seq(t, b0, nb, per_seq):
    return span(t, b0 * per_seq, nb * per_seq)


def _params(rec: Recorder, work: Tensor, dt_bias: Tensor, A_log: Tensor, D: Tensor, Di: int, N: int):
    assert A_log.numel == Di * N and dt_bias.numel == Di and D.numel == Di
    rec.copy(A_log, work.view((Di * N,), 0))
    rec.copy(dt_bias, work.view((Di,), Di * N))
    rec.copy(D, work.view((Di,), Di * N + Di))


def _uniform(rt, B, L, Di, N, R, lay, offs):
    o = dict(y=0, u=0, delta=0, xdbl=0, xz=0, states=0, du=0, ddelta=0, dxz=0, dxdbl=0)
    o.update(offs)
    vals = [B, L, Di, N, R, R + 2 * N, lay["nchk"], lay["nblk"],
            o["y"], o["u"], o["delta"], o["xdbl"], o["xz"], o["states"], lay["off_pbc"], o["du"],
            o["ddelta"], o["dxz"], o["dxdbl"], lay["off_st"],
            lay["off_hc"], lay["off_pa"], lay["off_pb"], lay["off_pd"],
            lay["pbc_half"], 0, 0, 0]
    return rt.uniform(pack("28I", *vals))


def _check(B, L, Di, N, R, **shapes):
    M = B * L
    want = dict(u=M * Di, delta=M * Di, xdbl=M * (R + 2 * N), xz=M * 2 * Di, y=M * Di, dy=M * Di,
                du=M * Di, ddelta=M * Di, dxdbl=M * (R + 2 * N), dxz=M * 2 * Di)
    for k, t in shapes.items():
        if k in want:
            assert t.numel == want[k], (k, t.shape, want[k])


def _constants(rt):
    return None if rt.kernels.scan_subgroups else {"SUBGROUPS": 0}


def selective_scan_forward(rec: Recorder, y, states, u, delta, dt_bias, A_log, D, xdbl, xz,
                           *, B, L, Di, N, R):
    """y [M, Di] WRITE; states [scan_state_shape(B, L, Di, N)] WRITE (see the module docstring)."""
    B, L, Di, N, R = int(B), int(L), int(Di), int(N), int(R)
    rt = rec.rt
    if B * L * Di == 0:
        return
    parts = _sequences(rt, B, L, Di, N, R, False)
    if len(parts) > 1:
        S, W, X = cdiv(L, CHUNK) * Di * N, L * Di, L * (R + 2 * N)
        for b0, nb in parts:
            selective_scan_forward(
                rec, _seq(y, b0, nb, W), _seq(states, b0, nb, S), _seq(u, b0, nb, W), _seq(delta, b0, nb, W),
                dt_bias, A_log, D, _seq(xdbl, b0, nb, X), _seq(xz, b0, nb, 2 * W), B=nb, L=L, Di=Di, N=N, R=R)
        return
    _check(B, L, Di, N, R, y=y, u=u, delta=delta, xdbl=xdbl, xz=xz)
    assert states.numel == B * cdiv(L, CHUNK) * Di * N, (states.shape, scan_state_shape(B, L, Di, N))
    bt, offs = {}, {}
    for name, t in (("y", y), ("states", states), ("u", u), ("delta", delta), ("xdbl", xdbl), ("xz", xz)):
        bt[name], offs[name] = bound(rt, t)
    lanes = _lanes(rt, N, R, offs["xdbl"])
    lay = _layout(B, L, Di, N, LANE_DB if lanes else DB)
    work = rt.scratch("selective_scan.params", (Di * N + 2 * Di,))
    _params(rec, work, dt_bias, A_log, D, Di, N)
    uni = _uniform(rt, B, L, Di, N, R, lay, offs)
    bindings = {0: bt["y"], 1: bt["states"], 2: bt["u"], 3: bt["delta"], 4: bt["xdbl"], 5: bt["xz"],
                6: work, 14: uni}
    if lanes:
        rec.dispatch(SHADER, "scan_lanes_forward", bindings, B * lay["nblk"], _lane_constants(N, R, offs["xdbl"]))
    else:
        rec.dispatch(SHADER, "selective_scan_forward", bindings, B * lay["nblk"])


def selective_scan_backward(rec: Recorder, du, ddelta, ddt_bias, dA_log, dD, dxdbl, dxz, dy, states,
                            u, delta, dt_bias, A_log, D, xdbl, xz, *, B, L, Di, N, R):
    """Gradients of selective_scan_forward; see the module docstring for WRITE/ACC rules."""
    B, L, Di, N, R = int(B), int(L), int(Di), int(N), int(R)
    rt = rec.rt
    if B * L * Di == 0:
        return
    parts = _sequences(rt, B, L, Di, N, R, True)
    if len(parts) > 1:  # ACC outputs add up over the ranges; the others are per row
        S, W, X = cdiv(L, CHUNK) * Di * N, L * Di, L * (R + 2 * N)
        for b0, nb in parts:
            selective_scan_backward(
                rec, _seq(du, b0, nb, W), _seq(ddelta, b0, nb, W), ddt_bias, dA_log, dD,
                _seq(dxdbl, b0, nb, X), _seq(dxz, b0, nb, 2 * W), _seq(dy, b0, nb, W),
                _seq(states, b0, nb, S), _seq(u, b0, nb, W), _seq(delta, b0, nb, W), dt_bias, A_log, D,
                _seq(xdbl, b0, nb, X), _seq(xz, b0, nb, 2 * W), B=nb, L=L, Di=Di, N=N, R=R)
        return
    _check(B, L, Di, N, R, du=du, ddelta=ddelta, dxdbl=dxdbl, dxz=dxz, dy=dy, u=u, delta=delta,
           xdbl=xdbl, xz=xz)
    assert states.numel == cdiv(L, CHUNK) * B * Di * N, (states.shape, scan_state_shape(B, L, Di, N))
    if (dy.buffer, dy.offset) != (du.buffer, du.offset):   # the kernels read dy from du
        rec.copy(dy, du)
    bt, offs = {}, {}
    for name, t in (("u", u), ("delta", delta), ("xdbl", xdbl), ("xz", xz), ("du", du),
                    ("ddelta", ddelta), ("dxdbl", dxdbl), ("dxz", dxz)):
        bt[name], offs[name] = bound(rt, t)
    lanes = _lanes(rt, N, R, offs["xdbl"])
    lay = _layout(B, L, Di, N, LANE_DB if lanes else DB)
    M = lay["M"]
    work = rt.scratch("selective_scan.bwd_work", (lay["work_size"],))
    _params(rec, work, dt_bias, A_log, D, Di, N)
    # the saved states and the dB/dC partials go into `work` too: the kernels then bind 8
    # storage buffers (the 8-lane one binds `work` twice, in two ranges that do not overlap, as
    # WebGPU requires of writable bindings: up to off_pbc as f32, the partials as vec4)
    rec.copy(states, work.view((states.numel,), lay["off_st"]))
    uni = _uniform(rt, B, L, Di, N, R, lay, offs)
    bindings = {2: bt["u"], 3: bt["delta"], 4: bt["xdbl"], 5: bt["xz"], 6: work, 8: bt["du"],
                9: bt["ddelta"], 10: bt["dxz"], 14: uni}
    if lanes:
        head = work.view((lay["off_pbc"],), 0)
        partials = work.view((2 * lay["pbc_half"],), lay["off_pbc"])
        rec.dispatch(SHADER, "scan_lanes_backward", {**bindings, 6: head, 11: partials}, B * lay["nblk"],
                     _lane_constants(N, R, offs["xdbl"]))
    else:
        rec.dispatch(SHADER, "selective_scan_backward", bindings, B * lay["nblk"], _constants(rt))
    rec.dispatch(SHADER, "selective_scan_backward_dbc", {11: work, 12: bt["dxdbl"], 14: uni}, cdiv(M * N, 256))
    for out, n, base, stride, scale_a in ((ddt_bias, Di, lay["off_pb"], Di, 0),
                                          (dD, Di, lay["off_pd"], Di, 0),
                                          (dA_log, Di * N, lay["off_pa"], Di * N, 1)):
        if out is None:  # a frozen parameter: its gradient is not wanted
            continue
        assert out.numel == n, (out.shape, n)
        bo, oo = bound(rt, out)
        q = rt.uniform(pack("8I", n, B, base, stride, oo, scale_a, 0, 0))
        rec.dispatch(SHADER, "selective_scan_accumulate", {6: work, 13: bo, 15: q}, cdiv(n, 256))


def butterfly_lanes(rt, B, L, Di, N) -> int:
    """Diagnostic (a readback: benchmarks and tests only): how many channel lanes the last
    backward at this shape summed with subgroup shuffles, 1 = all through workgroup memory."""
    lay = _layout(int(B), int(L), int(Di), int(N))
    work = rt.scratch("selective_scan.bwd_work", (lay["work_size"],))
    return int(rt.read(work.view((1,), lay["off_q"]))[0])
