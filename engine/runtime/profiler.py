"""Kernel timing with timestamp queries (`Runtime.enable_profiling`)."""

from __future__ import annotations

import numpy as np


class Profiler:
    """Pairs of timestamp queries around single-dispatch compute passes."""

    SIZE = 4096

    def __init__(self, rt):
        b = rt.backend
        self.rt = rt
        self.qs = rt.device.create_query_set(type="timestamp", count=self.SIZE)
        self.resolve = rt.device.create_buffer(size=8 * self.SIZE, usage=b.QUERY_RESOLVE | b.COPY_SRC)
        self.labels: list = []
        self.pending: list = []
        self.totals: dict = {}

    def slot(self, label: str) -> int | None:
        if 2 * (len(self.labels) + 1) > self.SIZE:
            return None
        self.labels.append(label)
        return 2 * (len(self.labels) - 1)

    def resolve_into(self, encoder) -> None:
        n = 2 * len(self.labels)
        if n:
            encoder.resolve_query_set(self.qs, 0, n, self.resolve, 0)
            self.pending = self.labels
            self.labels = []

    def flush(self) -> None:
        if not self.pending:
            return
        n = 2 * len(self.pending)
        raw = np.frombuffer(self.rt.device.queue.read_buffer(self.resolve, 0, 8 * n), dtype=np.uint64)
        for i, label in enumerate(self.pending):
            dt = float(raw[2 * i + 1]) - float(raw[2 * i])
            cnt, tot = self.totals.get(label, (0, 0.0))
            self.totals[label] = (cnt + 1, tot + max(dt, 0.0))
        self.pending = []

