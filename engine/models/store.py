"""FlatStore: named tensors in flat f32 GPU buffers (parameters, gradients, a LoRA
adapter's matrices), each view aligned for binding."""

from __future__ import annotations

import numpy as np

from memengine.engine.errors import MemengineError
from memengine.engine.hostmem import fmt_bytes
from memengine.engine.runtime import Recorder, Runtime, Tensor


def store_layout(shapes: dict, align: int, max_bytes: int) -> tuple[dict, list]:
    """Where each tensor of a FlatStore goes: ({name: (segment, element offset)}, [segment
    sizes in elements]).  Views start on the storage-offset alignment (`align` elements);
    a new segment (buffer) starts when the next tensor would pass `max_bytes`.  A tensor
    larger than `max_bytes` is refused (one buffer must hold it)."""
    where: dict = {}
    sizes = [0]
    for name, shape in shapes.items():
        n = int(np.prod(shape)) if len(shape) else 1
        if 4 * n > max_bytes:
            raise MemengineError(
                f"tensor {name} needs {fmt_bytes(4 * n)} in one GPU buffer but the adapter's largest "
                f"buffer is {fmt_bytes(max_bytes)}")
        off = (sizes[-1] + align - 1) // align * align
        if 4 * (off + n) > max_bytes:
            sizes.append(0)
            off = 0
        where[name] = (len(sizes) - 1, off)
        sizes[-1] = off + n
    return where, [max(n, 1) for n in sizes]


class FlatStore:
    """Named views into flat f32 buffers (segments), each view aligned for binding.

    Usually one segment; a model larger than the adapter's largest buffer gets several
    (`store_layout`).  Parameters and gradients share the layout, so the optimizer and the
    gradient clear address both by name / segment."""

    def __init__(self, rt: Runtime, shapes: dict, label: str):
        self.rt = rt
        self.shapes = {n: tuple(s) for n, s in shapes.items()}
        self.where, sizes = store_layout(self.shapes, rt.storage_align // 4, rt.max_buffer)
        self.segments = [Tensor(rt.create_buffer(4 * n, f"{label}{i}"), (n,), "f32", 0, f"{label}{i}")
                         for i, n in enumerate(sizes)]
        self.views = {name: Tensor(self.segments[seg].buffer, shape, "f32", 4 * off, name)
                      for name, shape in self.shapes.items() for seg, off in [self.where[name]]}

    def clear(self, rec: Recorder) -> None:
        for t in self.segments:
            rec.clear(t)

    def drop(self) -> None:
        """The store is no longer used: its buffers leave the runtime's allocation count."""
        for t in self.segments:
            self.rt.forget(t.buffer)

    def write(self, tensors: dict) -> None:
        """Upload every tensor (host arrays by name), one segment at a time."""
        for i, seg in enumerate(self.segments):
            flat = np.zeros(seg.numel, np.float32)
            for name, (s, off) in self.where.items():
                if s == i:
                    a = np.asarray(tensors[name], dtype=np.float32).reshape(-1)
                    flat[off:off + a.size] = a
            self.rt.write(seg, flat)

    def read(self) -> dict:
        """Every tensor, read back (one readback per segment)."""
        out = {}
        for i, seg in enumerate(self.segments):
            flat = self.rt.read(seg)
            for name, (s, off) in self.where.items():
                if s == i:
                    shape = self.shapes[name]
                    n = int(np.prod(shape)) if len(shape) else 1
                    out[name] = flat[off:off + n].copy()
            del flat
        return out
