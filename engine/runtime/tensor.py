"""Tensors (typed, shaped views of GPU buffers), uniform blocks, and the arithmetic of
views and workgroup grids every kernel wrapper uses."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

DTYPES = {"f32": np.float32, "u32": np.uint32, "i32": np.int32, "f16": np.float16}
# bytes per element: 4, except f16 (mixed precision: the matmul operands' copies)
ITEMSIZE = {"f16": 2}
MAX_GROUPS = 65535


@dataclass(eq=False)
class Tensor:
    """A typed, shaped view of a GPU buffer (4-byte elements, 2 for f16; row-major)."""

    buffer: object
    shape: tuple
    dtype: str = "f32"
    offset: int = 0  # bytes
    name: str = ""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def itemsize(self) -> int:
        return ITEMSIZE.get(self.dtype, 4)

    @property
    def nbytes(self) -> int:
        return self.itemsize * self.numel

    def view(self, shape: tuple, offset_elems: int = 0) -> "Tensor":
        t = Tensor(self.buffer, tuple(shape), self.dtype, self.offset + self.itemsize * offset_elems)
        assert t.offset + t.nbytes <= self.offset + self.nbytes, "view past the end of its tensor"
        return t


def bound(rt, t: Tensor, n: int | None = None) -> tuple[Tensor, int]:
    """Bind `t` (a view at any 4-byte offset) from the aligned offset below it.

    Returns the Tensor to bind, covering t's first `n` elements (all by default), and the
    element index of t[0] inside that binding, which the kernel adds to its indices.
    """
    isz = t.itemsize
    if t.offset % isz:
        raise ValueError(f"tensor offset must be a multiple of {isz} bytes")
    n = t.numel if n is None else n
    al = rt.storage_align
    start = (t.offset // al) * al
    extra = (t.offset - start) // isz
    return Tensor(t.buffer, (extra + max(n, 1),), t.dtype, start), extra


@dataclass(eq=False)
class Uniform:
    """A uniform block: `size` bytes of a uniform buffer from `offset`."""

    buffer: object
    offset: int = 0
    size: int = 0


def rows(t: Tensor, r0: int, n: int, width: int | None = None) -> Tensor:
    """Rows [r0, r0+n) of a row-major tensor of `width` elements per row (default: the size
    of its first dimension's rows); the tensor itself when that is all of it."""
    per = int(width) if width is not None else (t.numel // int(t.shape[0]) if t.shape and t.shape[0] else 1)
    if r0 == 0 and n * per == t.numel:
        return t
    out = Tensor(t.buffer, (int(n), per) if per > 1 else (int(n),), t.dtype, t.offset + t.itemsize * int(r0) * per, t.name)
    assert out.offset + out.nbytes <= t.offset + t.nbytes, "rows past the end of its tensor"
    return out


def span(t: Tensor, start: int, n: int) -> Tensor:
    """Elements [start, start+n) of t, flat."""
    out = Tensor(t.buffer, (int(n),), t.dtype, t.offset + t.itemsize * int(start), t.name)
    assert out.offset + out.nbytes <= t.offset + t.nbytes, "span past the end of its tensor"
    return out


def grid(n_groups: int) -> tuple[int, int, int]:
    """Fold a 1-D count of workgroups into (x, y, 1) within the 65535 limit."""
    n_groups = max(1, int(n_groups))
    if n_groups <= MAX_GROUPS:
        return (n_groups, 1, 1)
    y = (n_groups + MAX_GROUPS - 1) // MAX_GROUPS
    x = (n_groups + y - 1) // y
    return (x, y, 1)


def dispatch_groups(groups) -> tuple | None:
    """(x, y, z) workgroup counts of a dispatch (an int is folded by grid()); None when
    there is nothing to run."""
    if isinstance(groups, int):
        groups = grid(groups)
    groups = tuple(int(g) for g in groups) + (1,) * (3 - len(groups))
    return groups if min(groups) > 0 else None


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def pack(fmt: str, *values) -> bytes:
    """struct.pack with 16-byte padding, for uniform blocks ('I' = u32, 'f' = f32, 'i' = i32)."""
    data = struct.pack("<" + fmt, *values)
    if len(data) % 16:
        data += b"\0" * (16 - len(data) % 16)
    return data

