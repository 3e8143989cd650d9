"""Token embedding (shaders/embedding.wgsl).

`embedding_forward` gathers rows; `EmbeddingBackward` scatters the gradient back without
float atomics: the ids of a step are known on the host, so `prepare` builds a CSR of row
positions per unique token and writes it into a buffer made once; `record` then adds the
per-token sums into dweight (ACC), deterministically (fixed summation order).

Order of use per step: ``prepare(ids)`` for the batch, then ``record(...)`` and submit.
`prepare` uses a queue write, which lands before any command buffer submitted after it,
so do not call it again for the next batch before this step's recorder is submitted.
"""

from __future__ import annotations

import numpy as np
from memengine.engine.runtime import Recorder, Tensor, bound, cdiv, pack, rows, split


def _vocab_ranges(rt, weight: Tensor) -> list:
    E = int(weight.shape[-1])
    return split(rt, int(weight.shape[0]), lambda n: (4 * n * E,),
                 unit=f"one row of {weight.name or 'the embedding table'} ({E} values)")


def _row_ranges(rt, M: int, E: int) -> list:
    return split(rt, M, lambda n: (4 * n * E, 4 * n), unit=f"one activation row ({E} values)")


def embedding_forward(rec: Recorder, out: Tensor, ids: Tensor, weight: Tensor) -> None:
    """out[M, E] = weight[ids[m]] (WRITE); ids is i32 [M]; ids outside [0, V) give zeros.
    Tables and outputs larger than one binding are gathered in (row, vocabulary) ranges."""
    V, E = int(weight.shape[0]), int(weight.shape[-1])
    M = ids.numel
    assert out.numel == M * E, (out.shape, ids.shape, weight.shape)
    if M * E == 0:
        return
    rt = rec.rt
    for m0, mn in _row_ranges(rt, M, E):
        bo, oo = bound(rt, rows(out, m0, mn, E))
        bi, oi = bound(rt, rows(ids, m0, mn, 1))
        for v0, vn in _vocab_ranges(rt, weight):
            bw, ow = bound(rt, rows(weight, v0, vn))
            u = rt.uniform(pack("8I", mn, E, vn, oo, oi, ow, v0, V))
            rec.dispatch("embedding", "embedding_forward", {0: bo, 1: bi, 2: bw, 3: u}, cdiv(mn * E, 256))


class EmbeddingBackward:
    """Deterministic dweight += scatter-add of dout rows by token id (see module doc)."""

    @staticmethod
    def csr_size(M: int) -> int:
        return 2 + 3 * int(M)

    def __init__(self, rt, M: int):
        self.rt = rt
        self.M = int(M)
        self.csr = rt.empty((self.csr_size(M),), "i32", name="embedding_csr")
        self._host = np.zeros(self.csr_size(M), np.int32)
        self.unique = 0

    def prepare(self, ids_np) -> None:
        """Build the CSR for this batch's ids (host) and queue-write it (no new buffers).
        Negative ids (padding) get no gradient."""
        M = self.M
        ids = np.asarray(ids_np).reshape(-1).astype(np.int64)
        assert ids.size == M, (ids.size, M)
        pos = np.flatnonzero(ids >= 0)
        order = pos[np.argsort(ids[pos], kind="stable")]
        toks, starts = np.unique(ids[order], return_index=True)
        U = int(toks.size)
        h = self._host
        h[:] = 0
        h[0] = U
        h[1:1 + U] = starts
        h[1 + U] = order.size
        h[2 + M:2 + M + U] = toks
        h[2 + 2 * M:2 + 2 * M + order.size] = order
        self.unique = U
        self.rt.write(self.csr, h)

    def record(self, rec: Recorder, dweight: Tensor, dout: Tensor) -> None:
        """dweight[V, E] += sum of dout[M, E] rows per token (ACC)."""
        V, E = int(dweight.shape[0]), int(dweight.shape[-1])
        M = self.M
        assert dout.numel == M * E, (dout.shape, M, E)
        if M * E == 0:
            return
        rt = rec.rt
        nblk = cdiv(E, 64)
        # Sized for the worst case (M unique tokens) so the recording does not depend on
        # the batch; segments beyond the CSR's U return at once.  Tables and gradients
        # larger than one binding are added in (vocabulary, row) ranges.
        for v0, vn in _vocab_ranges(rt, dweight):
            bd, od = bound(rt, rows(dweight, v0, vn))
            for m0, mn in _row_ranges(rt, M, E):
                bg, og = bound(rt, rows(dout, m0, mn, E))
                u = rt.uniform(pack("12I", M, E, vn, nblk, od, og, v0, m0, mn, 0, 0, 0))
                rec.dispatch("embedding", "embedding_backward", {0: bd, 1: self.csr, 2: bg, 3: u}, M * nblk)
