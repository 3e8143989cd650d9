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
    (bq, oq), (bk, ok), (bv, ov), (bdo, odo), (bo, oo), (bm, om), (be, oe) = (
        bound(rt, t) for t in (q, k, v, do, o, lse, delta))
    u = rt.uniform(_u(B, L, Hq, Hkv, D, 0, 0, 0, M, (0, 0, 0, oo, 0, 0, odo, oe), scale, 1.0 / o_scale))
    rec.dispatch("attention", "attention_delta", {0: bdo, 1: bo, 2: be, 3: u}, cdiv(M * Hq, WG))
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
