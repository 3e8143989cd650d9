"""Optimizer side of a training step, all on the GPU, no readback inside a step.

* `GradClipper` – global L2 norm over every trainable gradient (a deterministic two-stage
  reduction, shaders/reduce.wgsl) and the clip factor.
* `LossScaler` – dynamic loss scaling for --precision mixed (torch.amp.GradScaler's rule,
  decided on the GPU: a non-finite gradient skips the step without a readback).
* `AdamW` – one fused kernel dispatch per parameter (shaders/adamw.wgsl, four elements per
  invocation; a second dispatch for the last 1-3 of a size not divisible by 4), moments keyed by
  parameter NAME (SPEC section 4), per-step uniforms in one persistent uniform buffer.
  A parameter larger than one storage binding is stepped in element ranges (one dispatch
  and one uniform slot each).  A whole parameter store that trains (every view) steps as
  its segments instead, one dispatch per segment, its moments one flat pair per segment
  (the names' moments are views into them).

Typical step (one `Recorder`, one submit per step)::

    clipper.record(rec, list(grads.values()), max_grad_norm)
    opt.record_step(rec, params, grads, clipper.factor)
    rec.submit()
"""

from __future__ import annotations

import struct

import numpy as np
from memengine.engine.kernels.reduce import count_partials, finish_window, partials_scratch, record_partials
from memengine.engine.runtime import Tensor, Uniform, cdiv, grid, pack, span, split

# torch.amp.GradScaler's growth_interval: finite steps in a row before the loss scale doubles
GROWTH_INTERVAL = 2000

_ADAM_FMT = "<I8fI2f"  # u32 count, f32 lr b1 b2 eps wd b1^t b2^t max_delta, u32 gpu_t, 2 f32 pad
_ADAM_BYTES = 48
assert struct.calcsize(_ADAM_FMT) == _ADAM_BYTES


class GradClipper:
    """Global gradient L2 norm and clip factor, computed on the GPU.

    After `record` (and a submit): ``factor[0]`` = max/norm when max > 0 and norm > max,
    else 1 (also 1 when the norm is NaN/Inf: AdamW then zeroes the non-finite steps);
    ``norm[0]`` = this step's pre-clip norm (the trainer copies it into its trace).
    """

    def __init__(self, rt):
        self.rt = rt
        self.factor: Tensor = rt.upload(np.ones(1, np.float32), name="clip.factor")
        self.norm: Tensor = rt.zeros((1,), name="clip.norm")

    def record(self, rec, grads: list[Tensor], max_grad_norm: float, scaler: "LossScaler | None" = None) -> None:
        """With `scaler` the gradients are S times the real ones: the norm and factor are
        the unscaled ones (factor / S), and a non-finite norm skips the step (scaler.amp)."""
        rt = self.rt
        grads = [g for g in grads if g is not None and g.numel > 0]
        total = sum(count_partials(rt, g) for g in grads)
        partials = partials_scratch(rt, max(total, 1), key="clip.partials")
        k = 0
        for g in grads:
            k += record_partials(rec, g, partials, k, square=True)
        if scaler is None:
            u = rt.uniform(pack("IIIIIIIIffff", k, 0, 0, 0, 0, 0, 0, 0, 0.0, float(max_grad_norm or 0.0), 0.0, 0.0))
            rec.dispatch("reduce", "clip_finish",
                         {1: finish_window(rt, partials, k), 2: u, 3: self.factor, 5: self.norm}, 1)
            return
        u = rt.uniform(pack("IIIIIIIIffff", k, 0, 0, 0, 0, 0, 0, 0, 0.0, float(max_grad_norm or 0.0),
                            float(scaler.growth_interval), 0.0))
        rec.dispatch("reduce", "clip_finish_scaled",
                     {1: finish_window(rt, partials, k), 2: u, 3: self.factor, 5: self.norm,
                      6: scaler.scale, 7: scaler.amp}, 1)


class LossScaler:
    """Dynamic loss scaling (--precision mixed), all on the GPU.

    `scale` [1]: S, which the cross-entropy multiplies into the loss gradient, so every
    gradient (and the f16 copies the matmuls read) carries a factor S that keeps small
    values above f16's underflow.  `GradClipper.record(..., scaler=self)` checks the
    step's gradients: non-finite -> the step is skipped (AdamW reads `amp[0]`), S halves;
    `growth_interval` finite steps in a row -> S doubles (torch.amp.GradScaler's
    defaults: 2^16, 2000).  `amp` [4] = (skip this step, finite steps in a row, skipped
    steps so far, optimizer steps applied = AdamW's t); the trainer copies amp[0] into
    its trace (no readback per step).
    """

    def __init__(self, rt, init_scale: float = 2.0 ** 16, growth_interval: int = GROWTH_INTERVAL,
                 scale: Tensor | None = None):
        """`scale`: the [1] tensor to keep S in (a model's loss scale), else one of its own."""
        self.rt = rt
        self.growth_interval = int(growth_interval)
        if scale is None:
            scale = rt.upload(np.array([init_scale], np.float32), name="loss_scale")
        else:
            rt.write(scale, np.array([init_scale], np.float32))
        self.scale: Tensor = scale
        self.amp: Tensor = rt.zeros((4,), name="loss_scale.state")

    def state(self) -> np.ndarray:
        """(scale, finite steps in a row, skipped steps): what a checkpoint keeps."""
        return np.array([self.rt.read(self.scale)[0], *self.rt.read(self.amp)[1:3]], np.float32)

    def applied_steps(self) -> int:
        return int(self.rt.read(self.amp)[3])

    def load(self, state, applied_steps: int = 0) -> None:
        """Continue from `state` (None: the initial scale) with AdamW's t = applied_steps."""
        if state is not None:
            s = np.asarray(state, np.float32).reshape(-1)
            self.rt.write(self.scale, s[:1])
        else:
            s = np.zeros(3, np.float32)
        self.rt.write(self.amp, np.array([0.0, s[1], s[2], applied_steps], np.float32))

    def read(self) -> dict:
        """{'loss_scale', 'skipped_steps'} (a GPU sync point: not inside a step loop)."""
        s, a = self.rt.read(self.scale), self.rt.read(self.amp)
        return {"loss_scale": float(s[0]), "skipped_steps": int(a[2])}


class AdamW:
    """AdamW with decoupled weight decay and an optional trust region (SPEC section 4).

    `moments[name] = (exp_avg, exp_avg_sq)`, created as zeros the first time `name` is
    stepped, reused whenever the same name comes back (whatever the order or subset of the
    parameter dict).  `step_count` is the global t; bias correction uses b1^t, b2^t with t
    counted after the increment.  `lr` is the default learning rate of a step; a schedule
    passes each step's own to `record_step` (as torch's LR schedulers set the group's lr
    before `step()`, without reaching into the optimizer from outside).

    Per-step uniforms: one 48-byte block per parameter name (a fixed slot), all in ONE uniform
    buffer created once (re-created larger only when a new name appears beyond its
    capacity) at offsets aligned to ``rt.uniform_align``, filled by one
    ``queue.write_buffer`` per step.  Because that write happens at record time, a recorder
    must be submitted between two `record_step` calls (checked).
    """

    def __init__(self, rt, *, lr: float = 1e-4, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, max_delta: float = 0.0):
        self.rt = rt
        self.lr = float(lr)
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.max_delta = float(max_delta)
        self.moments: dict[str, tuple[Tensor, Tensor]] = {}
        self.step_count = 0
        self._slots: dict[str, int] = {}
        self._stride = cdiv(_ADAM_BYTES, rt.uniform_align) * rt.uniform_align
        self._ubuf = None
        self._ucap = 0  # slots
        self._uniforms: dict[int, Uniform] = {}
        self._ones: Tensor | None = None
        self._last_encoder = None
        self._flat: dict = {}          # id(parameter segment buffer) -> (exp_avg, exp_avg_sq) flat pair
        self._flat_names: set = set()  # names whose moments are views into a flat pair
        self.uniform_buffers_created = 0  # for tests / diagnostics

    # ------------------------------------------------------------------ state
    def _moment(self, name: str, p: Tensor) -> tuple[Tensor, Tensor]:
        mv = self.moments.get(name)
        if mv is None:
            mv = (self.rt.zeros(p.shape, name=f"{name}.exp_avg"),
                  self.rt.zeros(p.shape, name=f"{name}.exp_avg_sq"))
            self.moments[name] = mv
        elif mv[0].numel != p.numel:
            raise ValueError(f"AdamW: parameter {name!r} has {p.numel} elements but its moments "
                             f"have {mv[0].numel}")
        return mv

    def _flat_moments(self, P, seg: int) -> tuple[Tensor, Tensor]:
        """The flat moment pair of segment `seg` of parameter store `P`, made on first use;
        the moments of its names become views into it (moments made or loaded before are
        copied in and freed: read back once, so nothing queued still uses them)."""
        pseg = P.segments[seg]
        pair = self._flat.get(id(pseg.buffer))
        if pair is not None:
            return pair
        pair = (self.rt.zeros(pseg.shape, name=f"{pseg.name}.exp_avg"),
                self.rt.zeros(pseg.shape, name=f"{pseg.name}.exp_avg_sq"))
        self._flat[id(pseg.buffer)] = pair
        for name, (s_, off) in P.where.items():
            if s_ != seg:
                continue
            shape = P.shapes[name]
            views = tuple(Tensor(t.buffer, shape, "f32", 4 * off, f"{name}.{k}")
                          for t, k in zip(pair, ("exp_avg", "exp_avg_sq")))
            old = self.moments.get(name)
            if old is not None and name not in self._flat_names:
                for o, v in zip(old, views):
                    self.rt.write(v, self.rt.read(o))
                    self.rt.free(o)
            self.moments[name] = views
            self._flat_names.add(name)
        return pair

    def _ranges(self, p: Tensor) -> list:
        """Element ranges of a parameter whose four bound views (p, g, m, v) fit a binding;
        starts are multiples of 256 elements, so the views stay offset-aligned."""
        return split(self.rt, p.numel, lambda n: (4 * n,) * 4, step=256, unit=f"one element of {p.name}")

    def _slot(self, name) -> int:
        s = self._slots.get(name)
        if s is None:
            s = len(self._slots)
            self._slots[name] = s
        return s

    def _ensure_uniform_capacity(self) -> None:
        need = len(self._slots)
        if self._ubuf is not None and need <= self._ucap:
            return
        cap = max(8, self._ucap)
        while cap < need:
            cap *= 2
        self._ubuf = self.rt.uniform_buffer(cap * self._stride)
        self._ucap = cap
        self._uniforms = {}
        self.uniform_buffers_created += 1

    def _uniform(self, slot: int) -> Uniform:
        u = self._uniforms.get(slot)
        if u is None:
            u = Uniform(self._ubuf, slot * self._stride, _ADAM_BYTES)
            self._uniforms[slot] = u
        return u

    def _ones_tensor(self) -> Tensor:
        if self._ones is None:
            self._ones = self.rt.upload(np.ones(1, np.float32), name="adamw.one")
        return self._ones

    # ------------------------------------------------------------------ step
    def record_step(self, rec, params: dict[str, Tensor], grads: dict[str, Tensor],
                    clip_factor: Tensor | None = None, skip: Tensor | None = None, whole=(),
                    lr: float | None = None) -> None:
        """Record one AdamW step for every parameter in `params` (grads by the same names).
        `whole`: (parameter store, gradient store) pairs (model.FlatStore, one layout) whose
        every view is in `params`: they step as their segments (the padding between views
        holds zeros and stays zero), one dispatch per segment range instead of per name.
        `clip_factor`: a [1] f32 tensor multiplied into every gradient (None: 1).  `skip`:
        a tensor whose element 0, when non-zero at run time, leaves every parameter and
        moment unchanged (LossScaler.amp; None: never); the bias correction then uses
        t = skip[3], the steps applied (counted on the GPU), not `step_count`.  `lr`: this
        step's learning rate (None: the one AdamW was made with)."""
        rt = self.rt
        if rec.encoder is self._last_encoder:
            raise RuntimeError("AdamW.record_step called twice on one recorder without submit(); "
                               "its per-step uniforms are written at record time")
        missing = [n for n in params if n not in grads]
        if missing:
            raise KeyError(f"AdamW: no gradient for {missing}")
        fused = self._whole_segments(whole, params)
        in_fused = {n for P, _ in whole for n in P.views}
        params = {n: p for n, p in params.items() if n not in in_fused}
        ranges = self._plan_ranges(params, grads, fused)
        self._ensure_uniform_capacity()
        self.step_count += 1
        self._write_uniforms(params, fused, ranges, self.lr if lr is None else float(lr), skip)

        clip = clip_factor if clip_factor is not None else self._ones_tensor()
        if skip is None:
            skip_t = rt.scratch("adamw.noskip", (4,))
            if not getattr(skip_t, "filled", False):
                rt.write(skip_t, np.zeros(4, np.float32))
                skip_t.filled = True
        else:
            skip_t = skip
        work = [(name, p, grads[name], *self.moments[name], ranges[name]) for name, p in params.items()]
        work += [(key, ps, gs, m, v, ranges[id(ps.buffer)]) for key, ps, gs, m, v in fused]
        for name, p, g, m, v, parts in work:
            if p.numel == 0:
                continue
            for i, (s0, n) in enumerate(parts):
                views = (p, g, m, v) if len(parts) == 1 else (span(t, s0, n) for t in (p, g, m, v))
                bp, bg, bm, bv = views
                binds = {0: bp, 1: bg, 2: bm, 3: bv, 4: clip,
                         5: self._uniform(self._slots[name if i == 0 else (name, i)]), 6: skip_t}
                if n >= 4:
                    rec.dispatch("adamw", "adamw_step", binds, grid(cdiv(n // 4, 256)))
                if n % 4:
                    rec.dispatch("adamw", "adamw_tail", binds, 1)
        self._last_encoder = rec.encoder

    def _whole_segments(self, whole, params: dict) -> list:
        """(slot key, p, g, m, v) of every segment of the stores that train whole."""
        fused = []
        for P, G in whole:
            if not set(P.views) <= set(params) or P.where != G.where:
                raise ValueError("AdamW: a whole store must train every view and share the gradients' layout")
            for seg, (ps, gs) in enumerate(zip(P.segments, G.segments)):
                m, v = self._flat_moments(P, seg)
                fused.append((("__segment__", id(ps.buffer)), ps, gs, m, v))
        return fused

    def _plan_ranges(self, params: dict, grads: dict, fused: list) -> dict:
        """The element ranges each tensor (or whole segment) steps in, each with its uniform
        slot; the per-name tensors checked and their moments made."""
        rt = self.rt
        al = rt.storage_align
        ranges = {}
        for _, ps, _, _, _ in fused:
            ranges[id(ps.buffer)] = [(0, ps.numel)] if rt.unsplit else self._ranges(ps)
        for key, ps, _, _, _ in fused:
            for i in range(len(ranges[id(ps.buffer)])):
                self._slot(key if i == 0 else (key, i))
        for name, p in params.items():
            g = grads[name]
            if p.numel != g.numel:
                raise ValueError(f"AdamW: {name!r}: parameter has {p.numel} elements, gradient {g.numel}")
            if p.dtype != "f32" or g.dtype != "f32":
                raise ValueError(f"AdamW: {name!r}: f32 tensors expected")
            for what, t in (("parameter", p), ("gradient", g)):
                if t.offset % al:
                    raise ValueError(f"AdamW: {name!r}: {what} view offset {t.offset} is not a multiple "
                                     f"of the storage-offset alignment {al}")
            self._moment(name, p)
            ranges[name] = [(0, p.numel)] if rt.unsplit else self._ranges(p)
            for i in range(len(ranges[name])):
                self._slot(name if i == 0 else (name, i))
        return ranges

    def _write_uniforms(self, params: dict, fused: list, ranges: dict, step_lr: float, skip) -> None:
        """This step's uniforms (one per range: its size, lr, betas and their powers, ...)."""
        t = self.step_count
        # The kernel sees b1, b2 as f32; bias-correct with powers of those same f32 values
        # (computed in double), so v / (1 - b2^t) stays unbiased for the betas actually used.
        b1, b2 = (float(np.float32(b)) for b in self.betas)
        data = bytearray(len(self._slots) * self._stride)
        keyed = [(name, ranges[name]) for name in params]
        keyed += [(key, ranges[id(ps.buffer)]) for key, ps, *_ in fused]
        for key, parts in keyed:
            for i, (_, n) in enumerate(parts):
                struct.pack_into(_ADAM_FMT, data, self._slots[key if i == 0 else (key, i)] * self._stride,
                                 n, step_lr, b1, b2, self.eps, self.weight_decay,
                                 b1 ** t, b2 ** t, self.max_delta, 0 if skip is None else 1, 0.0, 0.0)
        self.rt.write_buffer(self._ubuf, 0, bytes(data))

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, np.ndarray]:
        """Moments read back by name ("<name>.exp_avg", "<name>.exp_avg_sq") plus "__step__"."""
        out: dict[str, np.ndarray] = {}
        for name, (m, v) in self.moments.items():
            out[f"{name}.exp_avg"] = self.rt.read(m)
            out[f"{name}.exp_avg_sq"] = self.rt.read(v)
        out["__step__"] = np.array([self.step_count], dtype=np.int64)
        return out

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Replace moments and step count with `state` (as produced by `state_dict`)."""
        new: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for key, arr in state.items():
            if key == "__step__":
                continue
            if key.endswith(".exp_avg"):
                name = key[: -len(".exp_avg")]
                sq = state.get(f"{name}.exp_avg_sq")
                if sq is None:
                    raise ValueError(f"optimizer state: {key} without {name}.exp_avg_sq")
                a = np.asarray(arr, dtype=np.float32)
                sq = np.asarray(sq, dtype=np.float32)
                if a.shape != sq.shape:
                    raise ValueError(f"optimizer state: {name}: exp_avg {a.shape} vs exp_avg_sq {sq.shape}")
                new[name] = (a, sq)
            elif key.endswith(".exp_avg_sq"):
                if f"{key[: -len('.exp_avg_sq')]}.exp_avg" not in state:
                    raise ValueError(f"optimizer state: {key} without its exp_avg")
            else:
                raise ValueError(f"optimizer state: unexpected entry {key!r}")
        for name in list(self.moments):
            if name not in new:
                if name in self._flat_names:   # a view into a flat pair: back to zeros
                    for t in self.moments[name]:
                        self.rt.write(t, np.zeros(t.shape, np.float32))
                    continue
                m, v = self.moments.pop(name)
                self.rt.free(m)
                self.rt.free(v)
        for name, (a, sq) in new.items():
            cur = self.moments.get(name)
            if name in self._flat_names and cur[0].numel != a.size:
                raise ValueError(f"optimizer state: {name} has {a.size} values, the parameter {cur[0].numel}")
            if cur is None or cur[0].numel != a.size:
                if cur is not None:
                    self.rt.free(cur[0])
                    self.rt.free(cur[1])
                cur = (self.rt.empty(a.shape, name=f"{name}.exp_avg"),
                       self.rt.empty(a.shape, name=f"{name}.exp_avg_sq"))
                self.moments[name] = cur
            self.rt.write(cur[0], a.reshape(cur[0].shape))
            self.rt.write(cur[1], sq.reshape(cur[1].shape))
        step = state.get("__step__")
        self.step_count = int(np.asarray(step).reshape(-1)[0]) if step is not None else 0
