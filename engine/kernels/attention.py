"""Causal self-attention with grouped KV heads (shaders/attention.wgsl): forward and backward
with an online softmax, no L x L matrix in memory.

    s[t, j] = scale * q[t] . k[j]  (j <= t),  o[t] = sum_j softmax_j(s[t]) v[j]

Layouts (rows m = b*L + t): q and o [M, Hq*D] (head h at columns h*D..), k and v [M, Hkv*D];
query head h reads kv head h // (Hq/Hkv) (transformers' repeat_kv).  The forward writes o
and `lse` [M, Hq] (the softmax's log-normaliser, which the backward takes to recompute each
probability).  Tiled kernels: a workgroup takes 64 query rows (forward, dq) or 64 keys (dk,
dv, summed over the REP query heads of their kv head in the workgroup: no atomics) and walks
the other side in blocks of 32 staged in workgroup memory (16 KiB), below the diagonal only.
On a GPU each walk is one dispatch; on a CPU adapter the key range (forward, dq) or the query
range (dk, dv) is split into segments of whole blocks, one dispatch each, short enough that
no invocation's loops pass `LOOP_BUDGET` iterations (lavapipe's gallivm silently stops an
invocation's loops after 65535 in all); between segments the online state (o unnormalised,
running max and sum; the gradients) stays in the output buffers.
"""

from __future__ import annotations

import math
import struct

from memengine.engine.errors import MemengineError
from memengine.engine.kernels.lanes import is_cpu
from memengine.engine.runtime import Recorder, Tensor, bound, cdiv

WG = 256
MAX_HEAD_DIM = 256      # the kernels' registers: 4 column chunks of 16 vec4s (the decode step: MAXD4 vec4s)
LOOP_BUDGET = 24000     # loop iterations one invocation may make in one dispatch
TILE = 32               # keys (query rows) of a block that a workgroup walks


def check_shape(D: int, Hq: int, Hkv: int, where: str = "attention") -> None:
    """Refuse, in one line, a head shape the kernels do not run."""
    if D % 4 or D < 4 or D > MAX_HEAD_DIM:
        raise MemengineError(f"{where}: head_dim {D} is not supported by memengine's attention kernel "
                             f"(a multiple of 4 up to {MAX_HEAD_DIM})")
    if Hkv < 1 or Hq % Hkv:
        raise MemengineError(f"{where}: num_key_value_heads {Hkv} must divide num_attention_heads {Hq}")


def _u(B, L, Hq, Hkv, D, s0, s1, first, rows, offs, scale, factor=1.0) -> bytes:
    o = list(offs) + [0] * (8 - len(offs))
    return struct.pack("<20I2f2I", B, L, Hq, Hkv, D // 4, Hq // Hkv, Hq * D, Hkv * D, s0, s1, int(first), rows,
                       *o, float(scale), float(factor), 0, 0)


def _nch(D: int) -> dict:
    return {"NCH": cdiv(D // 4, 16)}


def block_costs(D: int, rep: int) -> tuple[int, int, int]:
    """Loop iterations an invocation of the kernels makes per block of 32 (keys for the
    forward and dq, query rows of each of the REP heads for dk, dv), every loop counted."""
    D4, n = D // 4, cdiv(D // 4, 16)
    fwd = 8 + cdiv(D4, 8) * 42 + 8 + 32 + 4 * (2 + n) + n * 162
    dq = 16 + cdiv(D4, 4) * 22 + 10 + n * 162
    dkv = rep * (16 + cdiv(D4, 4) * 22 + 10 + 2 * n * 162)
    return fwd, dq, dkv


def segment(rt, L: int, per_block: int) -> int:
    """Keys (or query rows) one dispatch of a kernel walks, a multiple of 32: all of L on
    a GPU; on a CPU adapter as many as keep an invocation under LOOP_BUDGET iterations."""
    if not is_cpu(rt):
        return max(TILE, cdiv(L, TILE) * TILE)
    return TILE * max(1, LOOP_BUDGET // per_block)


def attention_forward(rec: Recorder, o: Tensor, lse: Tensor, q: Tensor, k: Tensor, v: Tensor, lsum: Tensor, *,
                      B: int, L: int, Hq: int, Hkv: int, D: int, scale: float) -> None:
    """o [M, Hq*D] and lse [M, Hq] (WRITE) from q, k, v; `lsum` [M, Hq] is scratch."""
    M = B * L
    assert o.numel == q.numel == M * Hq * D and k.numel == v.numel == M * Hkv * D, (o.shape, q.shape, k.shape)
    assert lse.numel == lsum.numel == M * Hq
    if M == 0:
        return
    rt = rec.rt
    (bq, oq), (bk, ok), (bv, ov), (bo, oo), (bm, om), (bl, ol) = (bound(rt, t) for t in (q, k, v, o, lse, lsum))
    binds = {0: bq, 1: bk, 2: bv, 3: bo, 4: bm, 5: bl}
    seg = segment(rt, L, block_costs(D, Hq // Hkv)[0])
    nqb = cdiv(L, 64)
    for s0 in range(0, L, seg):
        s1 = min(L, s0 + seg)
        u = rt.uniform(_u(B, L, Hq, Hkv, D, s0, s1, s0 == 0, M, (oq, ok, ov, oo, om, ol), scale))
        rec.dispatch("attention", "attention_forward", {**binds, 6: u}, B * Hq * (nqb - s0 // 64), _nch(D))


def _delta(rec: Recorder, delta: Tensor, do: Tensor, o: Tensor, *, B: int, L: int, Hq: int, Hkv: int, D: int,
           o_scale: float) -> None:
    """delta [M, Hq] = rowsum(do * o) / o_scale per head (attention_delta): both backwards' first pass."""
    rt = rec.rt
    (bdo, odo), (bo, oo), (be, oe) = (bound(rt, t) for t in (do, o, delta))
    u = rt.uniform(_u(B, L, Hq, Hkv, D, 0, 0, 0, B * L, (0, 0, 0, oo, 0, 0, odo, oe), 1.0, 1.0 / o_scale))
    rec.dispatch("attention", "attention_delta", {0: bdo, 1: bo, 2: be, 3: u}, cdiv(B * L * Hq, WG))


def attention_backward(rec: Recorder, dq: Tensor, dk: Tensor, dv: Tensor, delta: Tensor, do: Tensor, o: Tensor,
                       lse: Tensor, q: Tensor, k: Tensor, v: Tensor, *, B: int, L: int, Hq: int, Hkv: int, D: int,
                       scale: float, o_scale: float = 1.0) -> None:
    """dq [M, Hq*D], dk, dv [M, Hkv*D] (WRITE) from do (d loss / d o) and the forward's o and
    lse; `delta` [M, Hq] is scratch.  `o_scale`: the o given is o_scale times the forward's
    (the residual multiplier folded into o_proj's input)."""
    M = B * L
    if M == 0:
        return
    rt = rec.rt
    _delta(rec, delta, do, o, B=B, L=L, Hq=Hq, Hkv=Hkv, D=D, o_scale=o_scale)
    (bq, oq), (bk, ok), (bv, ov), (bdo, odo), (bm, om), (be, oe) = (
        bound(rt, t) for t in (q, k, v, do, lse, delta))
    (bdq, odq), (bdk, odk), (bdv, odv) = (bound(rt, t) for t in (dq, dk, dv))
    _, cq, ckv = block_costs(D, Hq // Hkv)
    c = _nch(D)
    seg, nqb = segment(rt, L, cq), cdiv(L, 64)
    for s0 in range(0, L, seg):   # dq over key segments
        s1 = min(L, s0 + seg)
        u = rt.uniform(_u(B, L, Hq, Hkv, D, s0, s1, s0 == 0, M, (oq, ok, ov, odq, om, 0, odo, oe), scale))
        rec.dispatch("attention", "attention_backward_dq",
                     {0: bq, 1: bk, 2: bv, 3: bdo, 4: bm, 5: be, 6: bdq, 8: u}, B * Hq * (nqb - s0 // 64), c)
    seg = segment(rt, L, ckv)
    for s0 in reversed(range(0, L, seg)):   # dk, dv over query segments, the last first (it covers every key)
        s1 = min(L, s0 + seg)
        u = rt.uniform(_u(B, L, Hq, Hkv, D, s0, s1, s1 == L, M, (oq, ok, ov, odk, om, odv, odo, oe), scale))
        rec.dispatch("attention", "attention_backward_dkv",
                     {0: bq, 1: bk, 2: bv, 3: bdo, 4: bm, 5: be, 6: bdk, 7: bdv, 8: u}, B * Hkv * cdiv(s1, 64), c)


# ---------------------------------------------------------------- tensor cores (--precision mixed)
SG_SHADER = "attention_sgmat"
SG_PAD_ROWS = 64        # rows of zeros past the f16 copies' last row (attention_sgmat.wgsl loads
                        # a block's matrices without bounds)
SG_CEXP = 18            # ds's f16 scale 2^(edo + ev - cexp), cexp = ceil(log2 D) + SG_CEXP


def sg_head_dim(D: int) -> bool:
    """Head dims the subgroup-matrix kernels take: multiples of 16 up to 128 (their registers)."""
    return D % 16 == 0 and 16 <= D <= 128


def takes_subgroup_matrices(rt, D: int) -> bool:
    """Whether --precision mixed runs this head dim's attention on subgroup matrices
    (shaders/attention_sgmat.wgsl): adapters that have them, as the products do."""
    return bool(getattr(rt, "has_subgroup_matrix", False) and rt.kernels.sgmat and sg_head_dim(D))


def _sg_table(rt, *ts):
    """(scale table, slots) of f16 operands: their F16Scales slots (one table), or the unit
    scale's slot 0 for those without."""
    from memengine.engine.kernels.matmul import scale_of, unit_scales
    scales = [scale_of(t) for t in ts]
    tables = {id(s.table): s.table for s in scales if s is not None}
    assert len(tables) <= 1, "the f16 operands' scales come from different tables"
    if not tables:
        return unit_scales(rt), (0,) * len(ts)
    table = next(iter(tables.values()))
    return table.table, tuple(0 if s is None else s.slot for s in scales)


def _sg_clear_pad(rec, t: Tensor, M: int, cols: int) -> None:
    assert t.numel >= (M + SG_PAD_ROWS) * cols, "an f16 copy without its rows of padding"
    rec.clear(t.view((SG_PAD_ROWS * cols,), M * cols))


def _usg(B, L, Hq, Hkv, D, offs, slots, scale) -> bytes:
    o = list(offs) + [0] * (8 - len(offs))
    cexp = math.ceil(math.log2(D)) + SG_CEXP
    return struct.pack("<20IiIfI", B, L, Hq, Hq // Hkv, Hq * D, Hkv * D, cdiv(L, 64), cdiv(L, 64), *o, *slots,
                       cexp, Hkv, float(scale), 0)


def attention_forward_f16(rec: Recorder, o: Tensor, lse: Tensor, q16: Tensor, k16: Tensor, v16: Tensor, *,
                          B: int, L: int, Hq: int, Hkv: int, D: int, scale: float) -> None:
    """attention_forward on subgroup matrices: o [M, Hq*D] and lse [M, Hq] (WRITE) from the
    f16 copies q16 [M + SG_PAD_ROWS, Hq*D], k16 and v16 [M + SG_PAD_ROWS, Hkv*D] (cast_f16 with
    their scale slots; their padding rows are cleared here)."""
    M = B * L
    if M == 0:
        return
    rt = rec.rt
    for t, c in ((q16, Hq * D), (k16, Hkv * D), (v16, Hkv * D)):
        _sg_clear_pad(rec, t, M, c)
    table, (sq, sk, sv) = _sg_table(rt, q16, k16, v16)
    (bq, oq), (bk, ok), (bv, ov), (bo, oo), (bl, ol) = (bound(rt, t) for t in (q16, k16, v16, o, lse))
    u = rt.uniform(_usg(B, L, Hq, Hkv, D, (oq, ok, ov, 0, oo, ol, 0, 0), (sq, sk, sv, 0), scale))
    rec.dispatch(SG_SHADER, "attention_sg_forward", {0: bq, 1: bk, 2: bv, 3: bq, 4: bo, 5: bl, 8: table, 9: u},
                 B * Hq * cdiv(L, 64), {"D16": D // 16})


def attention_backward_f16(rec: Recorder, dq: Tensor, dk: Tensor, dv: Tensor, delta: Tensor, do: Tensor, o: Tensor,
                           lse: Tensor, q16: Tensor, k16: Tensor, v16: Tensor, do16: Tensor, *, B: int, L: int,
                           Hq: int, Hkv: int, D: int, scale: float, o_scale: float = 1.0) -> None:
    """attention_backward on subgroup matrices: dq, dk, dv (WRITE) from the forward's f16
    copies, do16 (the f16 copy of do, its padding cleared here) and, for delta, do and o in
    f32 (as attention_backward takes them)."""
    M = B * L
    if M == 0:
        return
    rt = rec.rt
    _delta(rec, delta, do, o, B=B, L=L, Hq=Hq, Hkv=Hkv, D=D, o_scale=o_scale)
    _sg_clear_pad(rec, do16, M, Hq * D)
    (be, oe) = bound(rt, delta)
    table, slots = _sg_table(rt, q16, k16, v16, do16)
    (bq, oq), (bk, ok), (bv, ov), (bg, og) = (bound(rt, t) for t in (q16, k16, v16, do16))
    (bl, ol), (bdq, odq), (bdk, odk), (bdv, odv) = (bound(rt, t) for t in (lse, dq, dk, dv))
    c = {"D16": D // 16}
    binds = {0: bq, 1: bk, 2: bv, 3: bg, 6: bl, 7: be, 8: table}
    dummy = rt.scratch("attention_sg.dummy", (4,))
    u = rt.uniform(_usg(B, L, Hq, Hkv, D, (oq, ok, ov, og, odq, 0, ol, oe), slots, scale))
    rec.dispatch(SG_SHADER, "attention_sg_dq", {**binds, 4: bdq, 5: dummy, 9: u}, B * Hq * cdiv(L, 64), c)
    rep = Hq // Hkv   # dk, dv: each query head's share (into scratch where REP > 1), then summed
    if rep == 1:
        u = rt.uniform(_usg(B, L, Hq, Hkv, D, (oq, ok, ov, og, odk, odv, ol, oe), slots, scale))
        rec.dispatch(SG_SHADER, "attention_sg_dkv", {**binds, 4: bdk, 5: bdv, 9: u}, B * Hq * cdiv(L, 64), c)
        return
    n = M * Hkv * D
    (bp1, op1), (bp2, op2) = (bound(rt, rt.scratch(f"attention_sg.{x}_parts", (rep * n,))) for x in ("dk", "dv"))
    u = rt.uniform(_usg(B, L, Hq, Hkv, D, (oq, ok, ov, og, op1, op2, ol, oe), slots, scale))
    rec.dispatch(SG_SHADER, "attention_sg_dkv", {**binds, 4: bp1, 5: bp2, 9: u}, B * Hq * cdiv(L, 64), c)
    for (bp, op), (bd, od) in (((bp1, op1), (bdk, odk)), ((bp2, op2), (bdv, odv))):
        u = rt.uniform(struct.pack("<4I", n, rep, op, od))
        rec.dispatch("attention", "attention_sum_parts", {0: bp, 1: bd, 2: u}, cdiv(n, WG))


# ---------------------------------------------------------------- decoding (batch 1)
DECODE_SEGMENT = 128    # keys one invocation of a decode step walks


def decode_segments(cap: int) -> int:
    return cdiv(cap, DECODE_SEGMENT)


def decode_part_elems(Hq: int, D: int, cap: int) -> int:
    """The scratch a decode step's segments write: [Hq, nseg, D + 2]."""
    return Hq * decode_segments(cap) * (D + 2)


def attention_decode(rec: Recorder, out: Tensor, q: Tensor, k: Tensor, v: Tensor, kc: Tensor, vc: Tensor,
                     pos: Tensor, part: Tensor, *, Hq: int, Hkv: int, D: int, cap: int, scale: float) -> None:
    """One token at position pos[0] (a u32 on the GPU): append k, v [Hkv*D] to the cache rows
    pos of kc, vc [cap, Hkv*D], then out [Hq*D] = softmax(scale q.k_j, j <= pos) . v_j."""
    rt = rec.rt
    nseg = decode_segments(cap)
    u = rt.uniform(struct.pack("<8If3I", Hq, Hkv, D // 4, Hq // Hkv, cap, DECODE_SEGMENT, nseg, Hkv * D,
                               float(scale), 0, 0, 0))
    for t in (out, q, k, v, kc, vc, part):
        assert t.offset % rt.storage_align == 0, "the decode step binds whole tensors"
    rec.dispatch("attention", "attention_decode_append", {0: k, 1: v, 2: kc, 3: vc, 4: pos, 5: u},
                 cdiv(Hkv * D, WG))
    rec.dispatch("attention", "attention_decode_partial", {0: q, 1: kc, 2: vc, 3: pos, 4: part, 5: u},
                 cdiv(Hq * nseg, WG))
    rec.dispatch("attention", "attention_decode_combine", {0: part, 1: out, 2: u}, cdiv(Hq * D, WG))


def decode_advance(rec: Recorder, pos: Tensor) -> None:
    """pos[0] += 1 (after a step)."""
    rec.dispatch("attention", "attention_decode_advance", {0: pos}, 1)
