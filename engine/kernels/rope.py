"""Rotary position embedding in place (shaders/rope.wgsl), as transformers applies it:
`rope_forward` rotates the first R channels of each head of q or k by the position's angles,
`rope_backward` the gradient back (the transpose: the rotation by minus the angles).  The
table of cos and sin is made on the host (`rope_table`) exactly as transformers makes its
f32 angles, once per length."""

from __future__ import annotations

import struct

import numpy as np
from memengine.engine.runtime import Recorder, Tensor, bound, cdiv

WG = 256


def inv_freq(rot_dims: int, theta: float) -> np.ndarray:
    """transformers' default RoPE: 1 / theta^(arange(0, R, 2) / R), in f32."""
    import math

    e = np.arange(0, rot_dims, 2, dtype=np.int64).astype(np.float32) / np.float32(rot_dims)
    return (1.0 / np.array([math.pow(theta, float(x)) for x in e], np.float64)).astype(np.float32)


def rope_table(T: int, rot_dims: int, theta: float) -> np.ndarray:
    """[T, R]: cos of the f32 angles t * inv_freq in columns 0..R/2, sin in R/2..R."""
    f = inv_freq(rot_dims, theta)
    ang = (np.arange(T, dtype=np.float32)[:, None] * f[None, :]).astype(np.float32)   # f32 as torch
    a = ang.astype(np.float64)
    return np.concatenate([np.cos(a), np.sin(a)], axis=1).astype(np.float32)


def _rope(rec: Recorder, entry: str, x: Tensor, table: Tensor, *, rows: int, L: int, heads: int, D: int, R: int,
          ld: int, pos0: int = 0) -> None:
    n = rows * heads * (R // 2)
    if n == 0:
        return
    bx, ox = bound(rec.rt, x)
    bt, ot = bound(rec.rt, table)
    assert ot == 0, "the rope table is bound whole"
    u = rec.rt.uniform(struct.pack("<8I", rows, L, heads, D, R // 2, ld, ox, pos0))
    rec.dispatch("rope", entry, {0: bx, 1: bt, 2: u}, cdiv(n, WG))


def rope_forward(rec: Recorder, x: Tensor, table: Tensor, *, rows: int, L: int, heads: int, D: int, R: int,
                 ld: int, pos0: int = 0) -> None:
    """x [rows, ld] (heads of D channels from column 0) rotated in place; row m at position
    m % L + pos0."""
    _rope(rec, "rope_forward", x, table, rows=rows, L=L, heads=heads, D=D, R=R, ld=ld, pos0=pos0)


def rope_backward(rec: Recorder, dx: Tensor, table: Tensor, *, rows: int, L: int, heads: int, D: int, R: int,
                  ld: int) -> None:
    """The gradient of rope_forward's input from its output's, in place."""
    _rope(rec, "rope_backward", dx, table, rows=rows, L=L, heads=heads, D=D, R=R, ld=ld)


def rope_step(rec: Recorder, x: Tensor, table: Tensor, pos: Tensor, *, heads: int, D: int, R: int) -> None:
    """One decode step's x [heads*D] rotated in place at the position pos[0] (a u32 on the GPU)."""
    bx, ox = bound(rec.rt, x)
    u = rec.rt.uniform(struct.pack("<8I", 1, 1, heads, D, R // 2, heads * D, ox, 0))
    rec.dispatch("rope", "rope_step", {0: bx, 1: table, 2: u, 3: pos}, cdiv(heads * (R // 2), WG))
