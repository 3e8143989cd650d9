"""Which windows each optimizer step trains on, and the held-out split.

Every epoch visits all training windows once, in an order drawn from --seed (one numpy
PCG64 generator for the whole run, one permutation per epoch), or in file order with
--no-shuffle.  An optimizer step takes the next B*K windows of that order (K
micro-batches of B, --grad-accum), so accumulation sees the same windows in the same
order as one big batch.  `state()` is the data position (epoch, steps done in it, and the
generator's state before this epoch's permutation); `WindowOrder(..., state=...)` takes
it up exactly where it was.

Up to `PERMUTE_MAX` windows the order is numpy's `permutation`; beyond, an array of one
index per window would grow with the corpus, so the order is a permutation computed where
it is read (`_Shuffled`: a keyed Feistel network over the next power of four, walked back
into range; its keys drawn from the same generator), and --no-shuffle a range.
"""

from __future__ import annotations

import math

import numpy as np
from memengine.engine.errors import MemengineError


PERMUTE_MAX = 1 << 21   # windows whose order is held as an array (16 MB of int64)


class _Range:
    def __init__(self, n: int):
        self.n = n

    def __getitem__(self, s: slice) -> np.ndarray:
        return np.arange(*s.indices(self.n), dtype=np.int64)


class _Shuffled:
    """A permutation of range(n) drawn from `rng`, never stored: x -> a 4-round Feistel
    network on 2·h bits (4^h >= n), applied again while the result is >= n."""

    M1, M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)

    def __init__(self, n: int, rng: np.random.Generator):
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.h = np.uint64((bits + 1) // 2)
        self.low = np.uint64((1 << int(self.h)) - 1)
        self.keys = [np.uint64(k) for k in rng.integers(0, 2 ** 63, size=4, dtype=np.int64)]

    def _mix(self, r: np.ndarray, k) -> np.ndarray:
        x = (r + k) * self.M1
        x ^= x >> np.uint64(31)
        x *= self.M2
        x ^= x >> np.uint64(29)
        return x & self.low

    def _f(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.h, x & self.low
        for k in self.keys:
            left, right = right, left ^ self._mix(right, k)
        return (left << self.h) | right

    def __getitem__(self, s: slice) -> np.ndarray:
        x = self._f(np.arange(*s.indices(self.n), dtype=np.uint64))
        out = x >= np.uint64(self.n)
        while out.any():
            x[out] = self._f(x[out])
            out = x >= np.uint64(self.n)
        return x.astype(np.int64)


class WindowOrder:
    def __init__(self, n_windows: int, per_step: int, seed: int, shuffle: bool, state: dict | None = None):
        if n_windows < 1:
            raise MemengineError("no training window (the data holds fewer than 2 tokens)")
        self.n = int(n_windows)
        self.per_step = int(per_step)
        self.shuffle = bool(shuffle)
        self.rng = np.random.Generator(np.random.PCG64(int(seed)))
        self.steps_per_epoch = math.ceil(self.n / self.per_step)
        self.epoch = 0        # the epoch being visited (1-based; 0 before the first)
        self.index = 0        # steps taken in it
        self.perm: np.ndarray | None = None
        self._rng_at_epoch: dict | None = None
        if state:
            self._restore(state)

    def _begin_epoch(self) -> None:
        self.epoch += 1
        self.index = 0
        self._rng_at_epoch = self.rng.bit_generator.state
        if self.n <= PERMUTE_MAX:
            self.perm = self.rng.permutation(self.n) if self.shuffle else np.arange(self.n)
        else:
            self.perm = _Shuffled(self.n, self.rng) if self.shuffle else _Range(self.n)

    @property
    def epoch_done(self) -> bool:
        return self.perm is not None and self.index >= self.steps_per_epoch

    def next(self) -> tuple[int, int, np.ndarray]:
        """(epoch, step in the epoch from 1, window indices of this optimizer step)."""
        if self.perm is None or self.epoch_done:
            self._begin_epoch()
        i = self.index
        self.index += 1
        return self.epoch, self.index, self.perm[i * self.per_step:(i + 1) * self.per_step]

    # ------------------------------------------------------------------ resume
    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "windows": self.n, "per_step": self.per_step,
                "shuffle": self.shuffle, "rng": self._rng_at_epoch}

    def _restore(self, st: dict) -> None:
        if int(st.get("windows", self.n)) != self.n or int(st.get("per_step", self.per_step)) != self.per_step:
            raise MemengineError(
                f"--resume: the run had {st.get('windows')} windows of {st.get('per_step')} per step, now "
                f"{self.n} of {self.per_step}; the data position does not carry over "
                "(same --data, --seq-len, --batch-size and --grad-accum are needed)")
        if int(st.get("epoch", 0)) == 0:
            return
        if st.get("rng") is not None:
            self.rng.bit_generator.state = st["rng"]
        self.epoch = int(st["epoch"]) - 1
        self._begin_epoch()
        self.index = int(st["index"])


def split_windows(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training, held-out) window indices, both in file order: round(fraction * n)
    windows (at least 1) drawn from --seed are held out."""
    held = held_out(n, fraction, seed)
    mask = np.ones(n, bool)
    mask[held] = False
    return np.flatnonzero(mask), held


def held_out(n: int, fraction: float, seed: int) -> np.ndarray:
    """The held-out window indices of `split_windows`, in file order (the training ones are
    the rest: `Windows.without`).  Up to PERMUTE_MAX windows numpy draws them (`choice`,
    which permutes all n when k > n/50); beyond, they are the first k of a permutation
    computed where it is read (`_Shuffled`), so the draw takes the memory of the k indices
    only, not 8 bytes of every window."""
    k = max(1, int(round(fraction * n)))
    if k >= n:
        raise MemengineError(f"--val-fraction {fraction:g}: holding out {k} of {n} window(s) leaves none "
                             "to train on; use a smaller fraction or more data")
    rng = np.random.Generator(np.random.PCG64([int(seed), 0x76616C]))  # its own stream ("val")
    if n <= PERMUTE_MAX:
        return np.sort(rng.choice(n, size=k, replace=False))
    held = _Shuffled(n, rng)[0:k]
    held.sort()
    return held
