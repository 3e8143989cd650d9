"""Pacing a step's submissions: while steps are slow, a step goes to the GPU in pieces (a
few layers' forward or backward each) so that the queue never holds more than a few pieces
and an interrupt acts within one (`Recorder.boundary`).  A `Pacer` holds the state: the
trainer owns one, hands it to the runtime (`Runtime.pacer`) and times its steps with it.
"""

from __future__ import annotations

from memengine.engine.runtime.tensor import cdiv

# a step is submitted in pieces (a layer's forward or backward each) while steps are slow,
# so the GPU queue never holds more than a few pieces and an interrupt acts within one
BOUNDED_STEP_S = 0.25
# pieces queued ahead: as many as hold about QUEUED_PIECES_S of GPU work, 2 to 8.  Two
# starve a fast GPU while the host records the next piece (mamba-130m, B 8, L 2048 on the
# H200: 37,235 tokens/s with 2, 37,781 with 4, 38,050 with 8; benchmarks/README.md)
QUEUED_PIECES_S = 0.1
MIN_PIECES, MAX_PIECES = 2, 8
# a piece spans as many boundaries (a layer's forward or backward, an LM-head chunk) as hold
# about PIECE_S of GPU work: each submission costs the GPU time (H200, mamba-130m B 8 L 2048,
# 61 boundaries of 6.6 ms: 40,616 / 40,640 tokens/s with a piece at each, 40,895 / 40,904 at
# every second, 40,949 / 40,992 at every fourth; benchmarks/README.md)
PIECE_S = 0.03


def piece_depth(step_s: float, pieces: int) -> int:
    """Pieces to keep queued when a step of `step_s` seconds is submitted in `pieces`."""
    per_piece = step_s / max(1, pieces)
    return int(min(MAX_PIECES, max(MIN_PIECES, QUEUED_PIECES_S // max(per_piece, 1e-9))))


def piece_span(step_s: float, boundaries: int) -> int:
    """Layer boundaries per piece when a step of `step_s` seconds has `boundaries`."""
    return max(1, int(PIECE_S // max(step_s / max(1, boundaries), 1e-9)))

class Pacer:
    """Whether and how a step is submitted in pieces; `Recorder.boundary` counts the
    boundaries and pieces, `step_done` sets the piece span and depth from a step's time."""

    def __init__(self):
        self.bounded = True  # submit steps in pieces (Recorder.boundary); cleared while steps are fast
        self.piece_depth = MIN_PIECES  # pieces kept queued while bounded; set from the step time
        self.piece_span = 1  # boundaries per piece while bounded; set from the step time
        self.pieces = 0  # pieces submitted at boundaries so far
        self.boundaries = 0  # boundaries passed while bounded so far
        self.since_piece = 0  # boundaries passed since the last submission
        self._last_pieces = 0  # pieces and boundaries when the last step ended
        self._last_boundaries = 0

    def due(self) -> bool:
        """Count a boundary (while bounded): whether the work recorded since the last
        submission is a piece to submit now."""
        self.boundaries += 1
        self.since_piece += 1
        return self.since_piece >= self.piece_span

    def step_done(self, dt: float | None) -> None:
        """A step ended `dt` seconds after the one before (None: the first).  Steps are
        submitted whole while they are fast, in pieces (boundaries holding ~PIECE_S of work
        each, ~QUEUED_PIECES_S of work queued) while they are slow."""
        if dt is not None:
            if dt < BOUNDED_STEP_S:
                self.bounded = False
            elif dt > 4 * BOUNDED_STEP_S:
                self.bounded = True
            if self.pieces > self._last_pieces:   # this step went in pieces of ~PIECE_S; ~0.1 s queued
                n = self.boundaries - self._last_boundaries
                self.piece_span = piece_span(dt, n)
                self.piece_depth = piece_depth(dt, cdiv(n, self.piece_span) + 1)
        self._last_pieces = self.pieces
        self._last_boundaries = self.boundaries
