"""LoRA helpers (shaders/lora.wgsl): scaling in place, and the dropout PEFT applies to the
input of lora_A.  The adapter's products themselves are the matmul kernels
(engine/ops/matmul.py); see engine/lora.py.

Dropout is inverted dropout with a counter-based mask: element k = r * cols + c of a
(rows, cols) input is kept when hash(seed, step, salt, k) / 2^24 >= p, scaled by 1/(1-p).
`rng` is a [2] u32 tensor (seed, step) written once per optimizer step, so the same call
(and its bindings) draws a new mask every step, and the backward, with the same salt,
applies exactly the forward's mask.
"""

from __future__ import annotations

import struct

from memengine.engine.runtime import Recorder, Tensor, bound, cdiv

WG = 256


def scale_(rec: Recorder, x: Tensor, s: float) -> None:
    """x *= s (in place)."""
    n = x.numel
    if n == 0:
        return
    bx, ox = bound(rec.rt, x)
    u = rec.rt.uniform(struct.pack("<IIfI", n, ox, float(s), 0))
    rec.dispatch("lora", "lora_scale", {0: bx, 1: u}, cdiv(n, WG))


def dropout(rec: Recorder, out: Tensor, x: Tensor, rng: Tensor, *, rows: int, cols: int, p: float, salt: int,
            ld_x: int | None = None, x_col: int = 0, ld_out: int | None = None, out_col: int = 0,
            acc: bool = False) -> None:
    """out[r, out_col + c] (+)= x[r, x_col + c] * mask(r, c) / (1 - p) for a (rows, cols) block."""
    n = rows * cols
    if n == 0:
        return
    ld_x = cols if ld_x is None else ld_x
    ld_out = cols if ld_out is None else ld_out
    bo, oo = bound(rec.rt, out)
    bx, ox = bound(rec.rt, x)
    u = rec.rt.uniform(struct.pack("<8I2f2I", rows, cols, ld_out, ld_x, oo + out_col, ox + x_col,
                                   int(salt) & 0xFFFFFFFF, int(bool(acc)), float(p), 1.0 / (1.0 - float(p)), 0, 0))
    rec.dispatch("lora", "lora_dropout", {0: bo, 1: bx, 2: rng, 3: u}, cdiv(n, WG))
