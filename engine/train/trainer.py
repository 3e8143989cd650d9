"""One optimizer step on the GPU, and evaluation (SPEC section 4).  No loop over epochs
here (that is engine/loop.py) and no rich: nothing prints.

A step is K micro-batches (--grad-accum), each one command submission: upload the
batch, forward, loss, backward, gradients added up (cleared by the first).  The last
one also records the global-norm clip factor and one AdamW dispatch per trainable
parameter, with this step's learning rate (the schedule's, an argument of the step) written
into AdamW's persistent uniform block.
Each step's mean loss and pre-clip gradient norm go into a small GPU trace that the loop
reads back every few steps (`read_trace`), never per step.  A `StepFence` keeps at most
a few submissions queued, so progress follows the GPU and Ctrl-C stops promptly.
With --precision mixed (the model's), a `LossScaler` scales the loss gradient and decides on
the GPU whether the step is applied; whether each step was skipped goes into the trace.
The f16 operands' per-tensor scales (the model's `half.scales`, engine/kernels/matmul.py
F16Scales) are rescaled on the GPU at the end of each step from the amax its casts saw
(what evaluation casts between two steps recorded is cleared at the start of each), so a
step's scales come from the step before; the first step of a run calibrates (each cast
takes its own tensor's amax).  The table goes into the optimizer state (F16_SCALES_KEY),
so a resumed run continues with the scales it stopped with.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
from memengine.engine.errors import MemengineError
from memengine.engine.kernels.reduce import sum_into
from memengine.engine.models.lm import LanguageModel, perplexity
from memengine.engine.runtime import Pacer, StepFence
from memengine.engine.train.optim import AdamW, GradClipper, LossScaler
from memengine.engine.train.optim_state import F16_SCALES_KEY, LOSS_SCALE_KEY


@dataclass
class EvalResult:
    loss: float              # mean next-token loss (nats)
    perplexity: float
    tokens: int              # targets scored
    bits_per_token: float = float("nan")
    top1_accuracy: float = float("nan")
    top5_accuracy: float = float("nan")

    def to_dict(self, prefix: str = "") -> dict:
        return {f"{prefix}loss": self.loss, f"{prefix}perplexity": self.perplexity, f"{prefix}tokens": self.tokens,
                f"{prefix}bits_per_token": self.bits_per_token, f"{prefix}top1_accuracy": self.top1_accuracy,
                f"{prefix}top5_accuracy": self.top5_accuracy}


def shard_owners(sizes: dict, world: int) -> dict:
    """name -> the rank that keeps its moments (--shard-moments): the largest tensors first,
    each to the rank with the fewest elements so far (the same on every rank)."""
    load = [0] * world
    owner = {}
    for n in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[n] = r
        load[r] += sizes[n]
    return owner


def batch_shape(batches) -> tuple[int, int]:
    if not len(batches):
        raise MemengineError("no data: the text is too short to form one window of 2 tokens")
    if getattr(batches, "shape", None) is not None:  # engine/io/data.Batches: one shape by construction
        return tuple(batches.shape)
    shapes = {tuple(b.ids.shape) for b in batches}
    if len(shapes) != 1:
        raise ValueError(f"batches must share one shape, got {sorted(shapes)}")
    return shapes.pop()


class Trainer:
    """Full fine-tuning, WSLA (x_proj only), or a LoRA adapter (when the model has a trained
    one attached: `model.lora`), with AdamW on the GPU.

    `options` needs lr, beta1, beta2, eps, weight_decay, max_delta, max_grad_norm (a
    TrainOptions); `wsla` picks the trainable set.  `trace_capacity`: the most steps
    between two `read_trace` calls.  `group`: this rank's process group in a data-parallel
    run (engine/train/distributed.py): the gradients and the loss of each step are summed
    over the ranks after its backward, before the clip."""

    def __init__(self, model: LanguageModel, options, optimizer_state: dict | None = None, *, wsla: bool = False,
                 trace_capacity: int = 1, group=None):
        self.model = model
        self.group = group
        self.options = options
        rt = model.rt
        self.opt = AdamW(rt, lr=options.lr, betas=(options.beta1, options.beta2), eps=options.eps,
                         weight_decay=options.weight_decay, max_delta=options.max_delta)
        optimizer_state = dict(optimizer_state or {})
        scaler_state = optimizer_state.pop(LOSS_SCALE_KEY, None)
        f16_state = optimizer_state.pop(F16_SCALES_KEY, None)
        # --shard-moments: this rank keeps (and steps) the moments of its share of the tensors
        self.shard = bool(getattr(options, "shard_moments", False)) and group is not None and group.world > 1
        self.owner: dict = {}
        if self.shard:
            names = model.trainable_names(wsla)
            shapes = {**model.shapes, **(model.lora.shapes if model.lora is not None else {})}
            self.owner = shard_owners({n: int(np.prod(shapes[n])) for n in names}, group.world)
            optimizer_state = {k: v for k, v in optimizer_state.items()
                               if k.startswith("__") or self.owner.get(k.rsplit(".", 1)[0]) == group.rank}
        if optimizer_state:
            self.opt.load_state_dict(optimizer_state)
        self.clipper = GradClipper(rt)
        self.names = model.trainable_names(wsla)
        self.trainable = set(self.names)
        self.params, self.grads = model.trainable_views(self.names)
        self._whole = model.whole_stores(self.trainable)      # stepped as whole segments
        self._norm_views = model.norm_views(self.trainable)   # what the gradient norm sums
        if wsla:
            self._wsla_rows(model)
        self.scaler = None
        if model.mixed:
            # the scale lives in the model's tensor, which its cross-entropy multiplies in
            self.scaler = LossScaler(rt, scale=model.loss_scale)
            # a resumed mixed run continues its loss scale; AdamW's t is counted on the GPU
            self.scaler.load(scaler_state, self.opt.step_count)
        # --precision mixed: the f16 operands' per-tensor scales (a fresh run calibrates its first step)
        self.f16 = model.half.scales if model.mixed else None
        if self.f16 is not None:
            if f16_state is not None:
                self.f16.load(f16_state)
            else:
                self.f16.calibrate = True
        self.capacity = max(1, int(trace_capacity))
        # trace[j] = loss of the j-th step since the last read, trace[cap + j] = its grad norm,
        # trace[2 cap + j] = 1 when loss scaling skipped it; a step sums its loss into one
        # fixed scalar and copies it there (no binding per slot)
        self.trace = rt.zeros((3 * self.capacity,), name="trace")
        self.last_skipped = np.zeros(0, bool)
        self.step_loss = rt.zeros((1,), name="step_loss")
        self.pending = 0
        self.fence = StepFence(rt)
        self._last_step = None
        # how this trainer's steps are submitted (whole, or in pieces while slow): the
        # runtime's recorders pace by it
        self.pacer = rt.pacer = Pacer()

    def _wsla_rows(self, model) -> None:
        """Where the architecture's WSLA set is a row range of a tensor (Mamba-2: in_proj's B,
        C and dt rows), the optimizer and the gradient norm see those rows only, so the other
        rows stay bit-identical (weight decay included)."""
        al = model.rt.storage_align
        for n in self.names:
            rr = model.arch.wsla_rows(model.cfg, n)
            if rr is None:
                continue
            r0, nr = rr
            shape = tuple(model.gpu_shapes[n])
            width = int(np.prod(shape[1:]))
            full_g = self.grads[n]
            if (r0 * width * 4) % al:
                raise MemengineError(f"adapt: the rows {r0}.. of {n} that adapt trains do not start at a "
                                     f"{al}-byte boundary of the tensor ({r0} x {width} values); this shape cannot "
                                     "be adapted here")
            self.params[n] = self.params[n].view((nr,) + shape[1:], r0 * width)
            self.grads[n] = full_g.view((nr,) + shape[1:], r0 * width)
            self._moment_rows(n, shape, r0, nr)
            self._norm_views = [self.grads[n] if v is full_g else v for v in self._norm_views]

    def _moment_rows(self, name: str, shape: tuple, r0: int, nr: int) -> None:
        """Moments of the whole tensor (CKPT's optimizer state from full training): keep the
        rows adapt trains, as the moments of those rows."""
        mv = self.opt.moments.get(name)
        if mv is None or mv[0].numel != int(np.prod(shape)) or name in self.opt._flat_names:
            return
        rt = self.model.rt
        rows = [rt.read(t).reshape(shape)[r0:r0 + nr] for t in mv]
        for t in mv:
            rt.free(t)
        self.opt.moments[name] = tuple(rt.upload(np.ascontiguousarray(a, np.float32), name=f"{name}.{k}")
                                       for a, k in zip(rows, ("exp_avg", "exp_avg_sq")))

    def optimizer_state(self) -> dict:
        """The moments by name (with --shard-moments gathered from their ranks: every rank
        calls this at the same point) and the step count."""
        state = self.opt.state_dict()
        if self.shard:
            state = self._gather_moments(state)
        if self.scaler is not None:   # t = the steps loss scaling let through
            state[LOSS_SCALE_KEY] = self.scaler.state()
            state["__step__"] = np.array([self.scaler.applied_steps()], dtype=np.int64)
        if self.f16 is not None:
            state[F16_SCALES_KEY] = self.f16.state()
        return state

    def step(self, micro: list, lr: float, n_total: int | None = None) -> int:
        """Record and submit one optimizer step over the micro-batches `micro` (Batch of one
        shape); returns the input tokens it trained on.  No readback (except, with a
        `group`, the gradients' all-reduce).  `n_total`: the targets the step's loss is the
        mean over (default: those of `micro`; a rank passes the step's over all ranks)."""
        if self.pending >= self.capacity:
            raise RuntimeError("Trainer.step: the trace is full; read_trace() first")
        model, rt = self.model, self.model.rt
        B, L = batch_shape(micro)
        ws = model.workspace(B, L)
        if n_total is None:
            n_total = sum(int(b.n_targets) for b in micro)
        j = self.pending
        tokens = 0
        for i, b in enumerate(micro):
            self.fence.wait()  # keeps at most fence.depth submissions queued (no readback)
            model.write_batch(ws, b.ids, b.targets, denominator=n_total)
            if model.lora is not None:  # the dropout mask of this micro-batch (from --seed)
                rank, world = (0, 1) if self.group is None else (self.group.rank, self.group.world)
                model.lora.set_counter(self.opt.step_count * 65536 + i * world + rank)
            rec = rt.recorder()
            if i == 0:
                rec.clear(self.step_loss)
                if self.f16 is not None:
                    self.f16.clear_amax(rec)
            model.record_gradients(rec, ws, b.ids, self.trainable, self.step_loss, clear=(i == 0))
            if i == len(micro) - 1 and self.group is not None:
                self.fence.mark(rec)
                rec.submit()
                self._all_reduce()
                rec = rt.recorder()
            if i == len(micro) - 1:
                if self.f16 is not None:   # the next step's f16 scales (after the ranks' amax)
                    self.f16.record_rescale(rec)
                self.clipper.record(rec, self._norm_views, self.options.max_grad_norm, self.scaler)
                rec.copy(self.step_loss, self.trace.view((1,), j), slot=True)
                rec.copy(self.clipper.norm, self.trace.view((1,), self.capacity + j), slot=True)
                skip = None
                if self.scaler is not None:
                    skip = self.scaler.amp
                    rec.copy(skip.view((1,)), self.trace.view((1,), 2 * self.capacity + j), slot=True)
                if self.shard:   # this rank's share, tensor by tensor; the weights exchanged below
                    mine = [n for n in self.names if self.owner[n] == self.group.rank]
                    self.opt.record_step(rec, {n: self.params[n] for n in mine}, {n: self.grads[n] for n in mine},
                                         self.clipper.factor, skip, whole=(), lr=lr)
                else:
                    self.opt.record_step(rec, self.params, self.grads, self.clipper.factor, skip,
                                         whole=self._whole, lr=lr)
            self.fence.mark(rec)
            rec.submit()
            if self.shard and i == len(micro) - 1:
                self._exchange_weights()
            tokens += int(b.n_tokens)
        if self.f16 is not None:
            self.f16.calibrate = False
        self.pending += 1
        self._pace()
        return tokens

    def _all_reduce(self) -> None:
        """Sum this step's gradients and loss over the ranks: each gradient-store segment
        (or trained view, `norm_views`) read back, all-reduced on the host, written back.
        After the whole backward: the engine records a step's backward before submitting
        it, so nothing here overlaps the backward yet."""
        rt = self.model.rt
        for t in [self.step_loss, *self._norm_views]:
            a = rt.read(t)
            self.group.all_reduce(a)
            rt.write(t, a)
        if self.f16 is not None:   # the f16 casts' amax: the largest over the ranks (one table on all)
            amax = self.f16.region(1)
            a = rt.read(amax)
            self.group.all_reduce(a, op="max")
            rt.write(amax, a)

    def _sum_over_ranks(self, parts: list) -> list:
        """Host arrays (one per tensor, each rank's own filled, the others zeros) summed over
        the ranks in one all-reduce: every rank gets every owner's values exactly (x + 0 = x)."""
        flat = np.concatenate([np.ravel(a).astype(np.float32) for a in parts]) if parts else np.zeros(0, np.float32)
        self.group.all_reduce(flat)
        out, o = [], 0
        for a in parts:
            out.append(flat[o:o + a.size].reshape(a.shape))
            o += a.size
        return out

    def _exchange_weights(self) -> None:
        """--shard-moments: after each rank stepped its share, every rank takes the others'."""
        rt, me = self.model.rt, self.group.rank
        parts = [rt.read(self.params[n]) if self.owner[n] == me else np.zeros(self.params[n].shape, np.float32)
                 for n in self.names]
        for n, a in zip(self.names, self._sum_over_ranks(parts)):
            if self.owner[n] != me:
                rt.write(self.params[n], a)

    def _gather_moments(self, state: dict) -> dict:
        keys = [f"{n}.{k}" for n in self.names for k in ("exp_avg", "exp_avg_sq")]
        parts = [state[k] if k in state else np.zeros(self.params[k.rsplit(".", 1)[0]].shape, np.float32)
                 for k in keys]
        out = dict(zip(keys, self._sum_over_ranks(parts)))
        out["__step__"] = state["__step__"]
        return out

    def _pace(self) -> None:
        """Submit steps whole while they are fast, in pieces (layers holding ~pacing.PIECE_S
        of work each) while they are slow, so that an interrupt acts within a piece at any
        model size (Recorder.boundary): the step's time goes to this trainer's pacer."""
        now = time.perf_counter()
        self.pacer.step_done(None if self._last_step is None else now - self._last_step)
        self._last_step = now

    def read_trace(self) -> tuple[np.ndarray, np.ndarray]:
        """(losses, grad norms) of the steps since the last read (a GPU sync point);
        `last_skipped` then says which of them loss scaling skipped (their norm is not
        finite)."""
        n = self.pending
        if n == 0:
            self.last_skipped = np.zeros(0, bool)
            return np.zeros(0), np.zeros(0)
        rt = self.model.rt
        both = rt.read(self.trace).astype(np.float64)
        rec = rt.recorder()
        rec.clear(self.trace)
        rec.submit()
        self.pending = 0
        self.last_skipped = both[2 * self.capacity:2 * self.capacity + n] != 0
        return both[:n], both[self.capacity:self.capacity + n]


EVAL_READ_WINDOWS = 1 << 16   # window sums read back at a time (and added up per block of this many)


def eval_group(batch_size: int, total: int) -> int:
    """Batches whose per-window sums one read-back of `evaluate` holds (its GPU buffer)."""
    return max(1, min(int(total), EVAL_READ_WINDOWS // max(1, int(batch_size))))


class _WindowSums:
    """The (loss, top-1, top-5) sums of windows added in window order, in float64, in blocks
    of EVAL_READ_WINDOWS windows counted from the first (numpy's sum within a block, the
    blocks one after the other): the same for any batching, and O(1) memory however many
    windows there are (a pass of up to one block adds up exactly as one sum of them all)."""

    def __init__(self):
        self.total = np.zeros(3, np.float64)
        self.pending: list = []
        self.n = 0

    def add(self, cols: np.ndarray) -> None:
        self.pending.append(cols)
        self.n += cols.shape[1]
        while self.n >= EVAL_READ_WINDOWS:
            cat = np.concatenate(self.pending, axis=1)
            self.total += cat[:, :EVAL_READ_WINDOWS].sum(axis=1)
            rest = cat[:, EVAL_READ_WINDOWS:]
            self.pending, self.n = [rest], rest.shape[1]

    def result(self) -> np.ndarray:
        if self.n:
            self.total += np.concatenate(self.pending, axis=1).sum(axis=1)
            self.pending, self.n = [], 0
        return self.total


def evaluate(model: LanguageModel, batches: list, on_progress: Callable | None = None,
             fence: StepFence | None = None) -> EvalResult:
    """Mean next-token loss, perplexity, bits per token and top-1/top-5 next-token accuracy
    over the batches.  Everything is summed on the GPU, per window, into a buffer of
    `eval_group` batches read back each time it is full and added up in float64 in window
    order (`_WindowSums`), so the result does not depend on how the windows were batched (a
    training run's held-out pass at its batch size equals `memengine eval` at batch size 1)
    and neither GPU nor host memory grows with the number of windows.  `fence`: a training
    loop's own, so repeated evaluations create no buffers."""
    rt = model.rt
    B, L = batch_shape(batches)
    ws = model.workspace(B, L, grad=False)
    M = ws.M
    hits = rt.scratch(("eval.hits", M), (2 * M,))
    total = len(batches)
    group = eval_group(B, total)
    # per batch: window r's loss / top-1 / top-5 sums go to block[k * B + r] (fixed slots, so
    # fixed bindings), and the block is copied to sums[batch % group] (a buffer copy)
    block = rt.scratch(("eval.block", B), (3 * B,))
    sums = rt.scratch(("eval.sums", group, B), (group * 3 * B,))
    rec = rt.recorder()
    n_targets = 0
    fence = fence or StepFence(rt)
    windows = np.zeros(group, np.int64)
    acc = _WindowSums()

    def read_back(k: int) -> None:   # the first k slots of sums, in window order
        per = rt.read(sums).astype(np.float64).reshape(group, 3, B)
        acc.add(np.concatenate([per[j, :, :int(windows[j])] for j in range(k)], axis=1))

    for i, batch in enumerate(batches):
        g = i % group
        if g == 0 and i > 0:
            read_back(group)
        windows[g] = int(batch.n_windows)
        fence.wait()
        n_targets += model.write_batch(ws, batch.ids, batch.targets)
        model.record_forward(rec, ws)
        model.record_loss(rec, ws, want_grad=False, hits=hits)
        rec.clear(block)
        for r in range(int(batch.n_windows)):
            for k, x in enumerate((ws.loss_rows, hits.view((M,)), hits.view((M,), M))):
                sum_into(rec, block.view((1,), k * B + r), x.view((L,), r * L))
        rec.copy(block, sums.view((3 * B,), 3 * B * g), slot=True)
        fence.mark(rec)
        rec.submit()
        if on_progress is not None:
            on_progress(i + 1, total)
    read_back((total - 1) % group + 1)
    s = acc.result()  # in window order: the same for any batching
    n = max(n_targets, 1)
    loss = float(s[0] / n)
    return EvalResult(loss=loss, perplexity=perplexity(loss), tokens=n_targets,
                      bits_per_token=loss / math.log(2.0), top1_accuracy=float(s[1] / n),
                      top5_accuracy=float(s[2] / n))
