"""Recording dispatches: `Recorder` (one command encoder, submitted as one batch),
`StepFence` (bounds how many submitted steps are queued) and `Program` (a fixed list of
dispatches replayed into any encoder)."""

from __future__ import annotations

from memengine.engine import interrupts
from memengine.engine.runtime.tensor import Tensor, bound, cdiv, dispatch_groups, pack


class StepFence:
    """Bounds how many submitted steps may be queued on the GPU, without stalling it.

    Each step ends by copying 16 bytes into one of `depth` small mappable buffers; before
    step i is recorded, the buffer of step i-depth is mapped, which waits for that step
    only (the later ones keep the GPU busy).  Nothing is read: the progress a loop reports
    then tracks the GPU within `depth` steps, and an interrupted run stops within `depth`
    steps instead of after everything queued.
    """

    def __init__(self, rt, depth: int = 3, slots: int = 0):
        """`slots` (at least `depth`): buffers in the ring, so that `depth` may be changed
        later up to that many without making new ones."""
        self.rt = rt
        self.depth = max(1, int(depth))
        self.src = rt.empty((4,), "u32", "fence.src")
        self.bufs = [rt.readback_buffer(16, f"fence{i}") for i in range(max(self.depth, int(slots)))]
        self.steps = 0

    def wait(self) -> None:
        """Call before recording a step: waits for the step `depth` back to finish."""
        if self.steps >= self.depth:
            self.rt.wait_mapped(self.bufs[(self.steps - self.depth) % len(self.bufs)])

    def mark(self, rec: "Recorder") -> None:
        """Call after recording a step, before its submit."""
        rec._end_pass()
        rec.encoder.copy_buffer_to_buffer(self.src.buffer, 0, self.bufs[self.steps % len(self.bufs)], 0, 16)
        self.steps += 1


class Recorder:
    """Records dispatches into one command encoder; `submit()` sends them as one batch."""

    def __init__(self, rt):
        self.rt = rt
        self.encoder = rt.device.create_command_encoder()
        self._pass = None
        self.dispatches = 0

    def _compute_pass(self):
        if self._pass is None:
            self._pass = self.encoder.begin_compute_pass()
        return self._pass

    def _end_pass(self):
        if self._pass is not None:
            self._pass.end()
            self._pass = None

    def dispatch(self, shader: str, entry: str, bindings: dict, groups, constants: dict | None = None):
        groups = dispatch_groups(groups)
        if groups is None:
            return
        pl = self.rt.pipeline(shader, entry, constants)
        bg = self.rt.bind_group(pl, bindings)
        prof = getattr(self.rt, "profiler", None)
        if prof is not None:
            if prof.pending:
                prof.flush()
            # a kernel of several modes (a MODE constant: ssd_product) timed per mode
            mode = f"[{constants['MODE']}]" if constants and "MODE" in constants else ""
            i = prof.slot(f"{shader}.{entry}{mode}")
            if i is not None:
                self._end_pass()
                p = self.encoder.begin_compute_pass(timestamp_writes={
                    "query_set": prof.qs, "beginning_of_pass_write_index": i, "end_of_pass_write_index": i + 1})
                p.set_pipeline(pl)
                p.set_bind_group(0, bg)
                p.dispatch_workgroups(*groups)
                p.end()
                self.dispatches += 1
                return
        p = self._compute_pass()
        p.set_pipeline(pl)
        p.set_bind_group(0, bg)
        p.dispatch_workgroups(*groups)
        self.dispatches += 1

    def clear(self, t: Tensor):
        if t.nbytes:
            size = t.nbytes
            if (t.offset % 4) or (size % 4):
                raise ValueError("clear needs 4-byte alignment")
            if self.rt.copy_by_dispatch and self._storage(t):
                self._words("clear_words", None, t)
                return
            self._end_pass()
            self.encoder.clear_buffer(t.buffer, t.offset, size)

    def copy(self, src: Tensor, dst: Tensor, slot: bool = False):
        """dst = src.  `slot`: dst (or src) is one of many slots of a buffer, a different one
        at each call (a trace, a ring): a buffer copy then, as a dispatch would make a
        binding and uniform per slot."""
        assert src.nbytes == dst.nbytes
        if src.nbytes:
            if (self.rt.copy_by_dispatch and not (slot or src.offset % 4 or dst.offset % 4 or src.nbytes % 4)
                    and self._storage(src) and self._storage(dst)):
                self._words("copy_words", src, dst)
                return
            self._end_pass()
            self.encoder.copy_buffer_to_buffer(src.buffer, src.offset, dst.buffer, dst.offset, src.nbytes)

    def _storage(self, t: Tensor) -> bool:
        return bool(t.buffer.usage & self.rt.backend.STORAGE)

    def _words(self, entry: str, src: Tensor | None, dst: Tensor):
        """dst = src (or zeros) by shaders/copy.wgsl, as 32-bit words, in windows that fit a
        binding; the compute pass goes on (see Runtime.copy_by_dispatch)."""
        rt = self.rt
        total = dst.nbytes // 4
        step = max(1, (rt.max_binding - rt.storage_align) // 4)
        for i in range(0, total, step):
            n = min(step, total - i)
            bd, od = bound(rt, Tensor(dst.buffer, (n,), "u32", dst.offset + 4 * i))
            bindings = {0: bd}
            os_ = 0
            if src is not None:
                bindings[1], os_ = bound(rt, Tensor(src.buffer, (n,), "u32", src.offset + 4 * i))
            bindings[2] = rt.uniform(pack("4I", n, os_, od, 0))
            self.dispatch("copy", entry, bindings, cdiv(n, 256))

    def boundary(self):
        """A point where the recorded work may be submitted (between layers): while the
        runtime's pacer bounds its submissions (`Pacer.bounded`), submit it at every
        `Pacer.piece_span`-th boundary and keep at most `Pacer.piece_depth` pieces queued,
        checking for an interrupt while waiting."""
        pacer = self.rt.pacer
        if not pacer.bounded or not self.dispatches or not pacer.due():
            return
        fence = self.rt.piece_fence()
        fence.wait()
        fence.mark(self)
        self.submit()
        pacer.pieces += 1
        interrupts.check()

    def submit(self):
        self._end_pass()
        prof = getattr(self.rt, "profiler", None)
        if prof is not None:
            prof.resolve_into(self.encoder)
        self.rt.device.queue.submit([self.encoder.finish()])
        if prof is not None:
            prof.flush()
        self.encoder = self.rt.device.create_command_encoder()
        self.dispatches = 0
        self.rt.pacer.since_piece = 0


class Program(Recorder):
    """A fixed list of dispatches, resolved to (pipeline, bind group, grid) once and replayed
    into any command encoder (`encode`).  The op wrappers record into it as into a Recorder;
    it holds dispatches only (no copies or clears) and has no submission points."""

    def __init__(self, rt):  # no encoder: nothing is encoded until replay
        self.rt = rt
        self.ops: list = []
        self.dispatches = 0

    def dispatch(self, shader, entry, bindings, groups, constants=None):
        groups = dispatch_groups(groups)
        if groups is None:
            return
        pl = self.rt.pipeline(shader, entry, constants)
        self.ops.append((pl, self.rt.bind_group(pl, bindings), groups))
        self.dispatches += 1

    def boundary(self):
        """A program is replayed whole: no submission points."""

    def encode(self, encoder) -> None:
        p = encoder.begin_compute_pass()
        last = None
        for pl, bg, g in self.ops:
            if pl is not last:
                p.set_pipeline(pl)
                last = pl
            p.set_bind_group(0, bg)
            p.dispatch_workgroups(*g)
        p.end()
