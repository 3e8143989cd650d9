"""The SwiGLU gate (shaders/swiglu.wgsl): out = r * silu(gate) * up from gu [rows, ld] (gate in
columns 0..I, up in I..2I), and its backward into dgu (WRITE).  r is Granite's residual
multiplier (1 elsewhere), folded into the down projection's input."""

from __future__ import annotations

import struct

from memengine.engine.runtime import Recorder, Tensor, bound, cdiv

WG = 256


def swiglu_forward(rec: Recorder, out: Tensor, gu: Tensor, *, rows: int, I: int, ld: int | None = None,
                   r: float = 1.0) -> None:
    ld = 2 * I if ld is None else ld
    if rows * I == 0:
        return
    (bg, og), (bo, oo) = bound(rec.rt, gu), bound(rec.rt, out)
    u = rec.rt.uniform(struct.pack("<6IfI", rows, I, ld, og, oo, 0, float(r), 0))
    rec.dispatch("swiglu", "swiglu_forward", {0: bg, 1: bo, 2: u}, cdiv(rows * I, WG))


def swiglu_backward(rec: Recorder, dgu: Tensor, dout: Tensor, gu: Tensor, *, rows: int, I: int,
                    ld: int | None = None, r: float = 1.0) -> None:
    ld = 2 * I if ld is None else ld
    if rows * I == 0:
        return
    (bg, og), (bo, oo), (bd, od) = bound(rec.rt, gu), bound(rec.rt, dout), bound(rec.rt, dgu)
    u = rec.rt.uniform(struct.pack("<6IfI", rows, I, ld, og, oo, od, float(r), 0))
    rec.dispatch("swiglu", "swiglu_backward", {0: bg, 1: bo, 2: bd, 3: u}, cdiv(rows * I, WG))
