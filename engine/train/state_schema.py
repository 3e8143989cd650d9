"""The schema of trainer_state.json, checked as strictly as optimizer.safetensors is
(engine/train/optim_state.py): every field's type and range, and the fields against each
other, before anything of a resumed run is built.  A state that does not pass is one
`MemengineError` line naming the field (exit status 2), never an internal error and never
a run that silently starts over (a missing `loop` would restart at step 0 on top of the
saved weights).

A state memengine writes carries `checksum` (sha256 of its canonical JSON without that
field): a resumed run continues exactly only from the state that was written, so an edited
or damaged file is refused too.  Options are changed on --resume by flags, not by editing.

What needs the data or the optimizer state is checked where they are known: the windows and
tokens against the data read now (engine/app/run.py), the shuffle generator's state
against --seed (`check_order_rng`), and the step counts and moments against
optimizer.safetensors (`check_optimizer_agrees`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any, Optional

from memengine.engine.errors import MemengineError

STATE_FORMAT = "memengine-trainer-state"
VERSIONS = (1, 2)          # 1: before the checksum and the optimizer's step were recorded
MAX_STEP = 2 ** 53         # a step count an f64 (optimizer.safetensors' __step__) holds exactly
EVENTS = {
    "step": {"step": "int", "epoch": "int", "loss": "num", "grad_norm": "num", "lr": "num", "tokens": "int",
             "tokens_per_s": "num"},
    "epoch": {"epoch": "int", "step": "int", "loss": "num", "grad_norm": "num", "tokens": "int",
              "tokens_per_s": "num", "elapsed_s": "num"},
    "eval": {"step": "int", "val_loss": "num", "val_perplexity": "num", "val_tokens": "int"},
    "checkpoint": {"step": "int", "path": "str"},
}
SUMS = {"loss": "num", "grad_norm": "num", "steps": "int", "tokens": "int", "elapsed_s": "num"}
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def checksum(state: dict) -> str:
    """sha256 of the state's canonical JSON, its `checksum` field left out."""
    body = {k: v for k, v in state.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str, allow_nan=True)
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def with_checksum(state: dict) -> dict:
    return {**{k: v for k, v in state.items() if k != "checksum"}, "checksum": checksum(state)}


class _Check:
    def __init__(self, where: str):
        self.where = where

    def bad(self, field: str, why: str) -> MemengineError:
        return MemengineError(f"{self.where}: trainer state field '{field}' {why}; the file is not a state "
                              "memengine wrote (resume from another checkpoint, or start a new run)")

    def get(self, d: dict, key: str, field: str, kind: str, *, optional: bool = False, lo=None, hi=None) -> Any:
        if key not in d:
            if optional:
                return None
            raise self.bad(field, "is missing")
        v = d[key]
        if v is None and optional:
            return None
        return self.value(v, field, kind, lo=lo, hi=hi)

    def value(self, v: Any, field: str, kind: str, *, lo=None, hi=None) -> Any:
        if kind == "int":
            if not isinstance(v, int) or isinstance(v, bool):
                raise self.bad(field, f"is {_shown(v)}, not an integer")
        elif kind == "num":
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise self.bad(field, f"is {_shown(v)}, not a number")
            if isinstance(v, float) and math.isinf(v) and (lo is not None or hi is not None):
                raise self.bad(field, f"is {v}, not a finite number")
        elif kind == "fin":   # a finite number
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise self.bad(field, f"is {_shown(v)}, not a finite number")
        elif kind == "str":
            if not isinstance(v, str):
                raise self.bad(field, f"is {_shown(v)}, not a string")
        elif kind == "bool":
            if not isinstance(v, bool):
                raise self.bad(field, f"is {_shown(v)}, not true or false")
        elif kind == "dict":
            if not isinstance(v, dict):
                raise self.bad(field, f"is {_shown(v)}, not an object")
        elif kind == "list":
            if not isinstance(v, list):
                raise self.bad(field, f"is {_shown(v)}, not a list")
        if kind in ("int", "num", "fin") and isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)):
            if lo is not None and v < lo:
                raise self.bad(field, f"is {v}, below {lo}")
            if hi is not None and v > hi:
                raise self.bad(field, f"is {v}, above {hi}")
        return v


def _shown(v: Any) -> str:
    text = json.dumps(v, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def validate(st: Any, where: str, kinds: tuple = ("train", "adapt")) -> dict:
    """Check a parsed trainer_state.json (see the module doc); returns it."""
    c = _Check(where)
    if not isinstance(st, dict) or st.get("format") != STATE_FORMAT:
        raise MemengineError(f"{where}: not a memengine trainer state")
    version = c.get(st, "version", "version", "int")
    if version not in VERSIONS:
        raise c.bad("version", f"is {version}; this memengine reads versions {', '.join(map(str, VERSIONS))}")
    if version >= 2:
        got = c.get(st, "checksum", "checksum", "str")
        if got != checksum(st):
            raise MemengineError(f"{where}: the trainer state does not match its checksum (edited or damaged); "
                                 "a resumed run continues exactly only from the state memengine wrote (change "
                                 "options with flags on --resume, not in the file)")
    kind = c.get(st, "kind", "kind", "str")
    if kind not in kinds:
        raise c.bad("kind", f"is {kind!r}, not one of {', '.join(kinds)}")
    c.get(st, "world_size", "world_size", "int", lo=1, hi=1 << 20)
    step = c.get(st, "step", "step", "int", lo=0, hi=MAX_STEP)
    c.get(st, "epoch", "epoch", "int", lo=0, hi=MAX_STEP)
    c.get(st, "input", "input", "str")
    c.get(st, "options", "options", "dict")
    data = c.get(st, "data", "data", "dict")
    sha = c.get(data, "sha256", "data.sha256", "str")
    if not _HEX64.match(sha):
        raise c.bad("data.sha256", "is not a sha256 in hex")
    if "val_sha256" in data and not (isinstance(data["val_sha256"], str) and _HEX64.match(data["val_sha256"])):
        raise c.bad("data.val_sha256", "is not a sha256 in hex")
    for key in ("tokens", "documents", "windows"):
        c.get(data, key, f"data.{key}", "int", lo=0 if key == "documents" else 1)
    extra = c.get(st, "extra", "extra", "dict")
    _extra(c, extra)
    segs = c.get(st, "segments", "segments", "list")
    if not segs:
        raise c.bad("segments", "is empty (every invocation of a run adds one)")
    for i, s in enumerate(segs):
        f = f"segments[{i}]"
        c.value(s, f, "dict")
        c.get(s, "started", f + ".started", "str")
        c.get(s, "finished", f + ".finished", "str", optional=True)
        c.get(s, "resumed_from", f + ".resumed_from", "str", optional=True)
        c.get(s, "first_step", f + ".first_step", "int", lo=0, hi=step)
        c.get(s, "last_step", f + ".last_step", "int", lo=0, hi=step, optional=True)
    if "optimizer_step" in st or version >= 2:
        c.get(st, "optimizer_step", "optimizer_step", "int", lo=0, hi=MAX_STEP)
    loop = c.get(st, "loop", "loop", "dict")
    _loop(c, loop, step, int(st["epoch"]))
    return st


def _extra(c: _Check, extra: dict) -> None:
    if "before" in extra:
        b = c.get(extra, "before", "extra.before", "dict")
        c.get(b, "perplexity", "extra.before.perplexity", "fin", lo=1.0)
        c.get(b, "loss", "extra.before.loss", "fin", lo=0.0)
        c.get(b, "tokens", "extra.before.tokens", "int", lo=1)
    if "lora" in extra:
        ld = c.get(extra, "lora", "extra.lora", "dict")
        c.get(ld, "base_relative", "extra.lora.base_relative", "str", optional=True)


def _event(c: _Check, ev: Any, field: str, step: int) -> dict:
    c.value(ev, field, "dict")
    kind = c.get(ev, "event", field + ".event", "str")
    if kind not in EVENTS:
        raise c.bad(field + ".event", f"is {kind!r}, not one of {', '.join(EVENTS)}")
    for key, k in EVENTS[kind].items():
        lo = 0 if k == "int" else None
        hi = step if key == "step" else None
        c.get(ev, key, f"{field}.{key}", k, lo=lo, hi=hi)
    if "skipped_steps" in ev:
        c.get(ev, "skipped_steps", field + ".skipped_steps", "int", lo=0, hi=step)
    if "f16_scales" in ev:   # --precision mixed (engine/kernels/matmul.py F16Scales.summary)
        f = c.get(ev, "f16_scales", field + ".f16_scales", "dict")
        for key in ("min", "max"):
            c.get(f, key, f"{field}.f16_scales.{key}", "fin", lo=2.0 ** -115, hi=2.0 ** 60)
        for key in ("changes", "tensors"):
            c.get(f, key, f"{field}.f16_scales.{key}", "int", lo=0)
    return ev


def _loop(c: _Check, loop: dict, step: int, epoch: int) -> None:
    if c.get(loop, "step", "loop.step", "int", lo=0, hi=MAX_STEP) != step:
        raise c.bad("loop.step", f"is {loop['step']}, but the state's step is {step}")
    order = c.get(loop, "order", "loop.order", "dict", optional=step == 0)
    if order is not None:
        o_epoch = c.get(order, "epoch", "loop.order.epoch", "int", lo=0, hi=MAX_STEP)
        index = c.get(order, "index", "loop.order.index", "int", lo=0, hi=MAX_STEP)
        windows = c.get(order, "windows", "loop.order.windows", "int", lo=1, hi=MAX_STEP)
        per_step = c.get(order, "per_step", "loop.order.per_step", "int", lo=1, hi=MAX_STEP)
        c.get(order, "shuffle", "loop.order.shuffle", "bool")
        per_epoch = -(-windows // per_step)
        if index > per_epoch:
            raise c.bad("loop.order.index", f"is {index}, beyond the {per_epoch} steps of an epoch")
        if o_epoch != epoch:
            raise c.bad("loop.order.epoch", f"is {o_epoch}, but the state's epoch is {epoch}")
        done = (o_epoch - 1) * per_epoch + index if o_epoch else 0
        if done != step:
            raise c.bad("loop.order", f"is at epoch {o_epoch}, step {index} of {per_epoch} (step {done} of the "
                                      f"run), but the state's step is {step}")
        rng = c.get(order, "rng", "loop.order.rng", "dict", optional=o_epoch == 0)
        if rng is not None:
            if rng.get("bit_generator") != "PCG64":
                raise c.bad("loop.order.rng.bit_generator", f"is {_shown(rng.get('bit_generator'))}, not PCG64")
            inner = c.get(rng, "state", "loop.order.rng.state", "dict")
            c.get(inner, "state", "loop.order.rng.state.state", "int", lo=0, hi=2 ** 128 - 1)
            c.get(inner, "inc", "loop.order.rng.state.inc", "int", lo=0, hi=2 ** 128 - 1)
            c.get(rng, "has_uint32", "loop.order.rng.has_uint32", "int", lo=0, hi=1)
            c.get(rng, "uinteger", "loop.order.rng.uinteger", "int", lo=0, hi=2 ** 32 - 1)
    elif step:
        raise c.bad("loop.order", "is missing")
    for name in ("epoch_sums", "window_sums"):
        sums = c.get(loop, name, f"loop.{name}", "dict")
        for key, k in SUMS.items():
            c.get(sums, key, f"loop.{name}.{key}", k, lo=0 if key != "loss" else None,
                  hi=step if key == "steps" else None)
        if "skipped" in sums:
            c.get(sums, "skipped", f"loop.{name}.skipped", "int", lo=0, hi=step)
    c.get(loop, "last_loss", "loop.last_loss", "num", optional=True)
    last_eval = c.get(loop, "last_eval", "loop.last_eval", "dict", optional=True)
    if last_eval is not None:
        if last_eval.get("event") != "eval":
            raise c.bad("loop.last_eval.event", "is not 'eval'")
        _event(c, last_eval, "loop.last_eval", step)
    best = c.get(loop, "best", "loop.best", "dict", optional=True)
    if best is not None:
        c.get(best, "step", "loop.best.step", "int", lo=0, hi=step)
        c.get(best, "val_loss", "loop.best.val_loss", "num")
    history = c.get(loop, "history", "loop.history", "list")
    for i, ev in enumerate(history):
        _event(c, ev, f"loop.history[{i}]", step)
    if "schedule" in loop:
        sch = c.get(loop, "schedule", "loop.schedule", "dict")
        c.get(sch, "kind", "loop.schedule.kind", "str")
        for key in ("lr", "min_lr"):
            c.get(sch, key, f"loop.schedule.{key}", "fin", lo=0.0)
        for key in ("warmup_steps", "total_steps"):
            c.get(sch, key, f"loop.schedule.{key}", "int", lo=0, hi=MAX_STEP)


def check_order_rng(order: Optional[dict], seed: int, where: str) -> None:
    """The shuffle generator's state at the saved epoch's start is what --seed gives after
    the epochs before it: a state from anything else is refused (it would shuffle other
    windows than the run it claims to continue)."""
    import numpy as np

    if not order or not order.get("epoch") or order.get("rng") is None:
        return
    rng = np.random.Generator(np.random.PCG64(int(seed)))
    n = int(order["windows"])
    epochs_before = int(order["epoch"]) - 1
    if order.get("shuffle"):
        from memengine.engine.hostmem import check_fits

        check_fits(8 * n, f"{where}: replaying the shuffle of {n:,} windows", "")
        if epochs_before * n > 10 ** 10:
            return  # too long to replay; the fields were checked above
        for _ in range(epochs_before):
            rng.permutation(n)
    if rng.bit_generator.state != order["rng"]:
        raise _Check(where).bad("loop.order.rng", f"is not the generator state --seed {seed} gives at the start of "
                                                  f"epoch {order['epoch']}")


def check_optimizer_agrees(state: dict, opt: Optional[dict], trained: list, where: str, opt_file) -> None:
    """optimizer.safetensors and trainer_state.json of one checkpoint agree: `__step__` is the
    optimizer step the state recorded, and every trained tensor has both moments once the
    run has taken a step."""
    import numpy as np

    step = int(state.get("step") or 0)
    if opt is None:
        if step:
            raise MemengineError(f"{where}: no {opt_file} beside the state of step {step}; cannot continue exactly")
        return
    got = opt.get("__step__")
    want = state.get("optimizer_step")
    if want is not None:
        have = None if got is None else float(np.asarray(got).reshape(-1)[0])
        if have is None or have != float(want):
            raise MemengineError(f"{opt_file}: '__step__' is {have if have is None else int(have)}, but the trainer "
                                 f"state beside it recorded optimizer step {want} (the two files belong to different "
                                 "checkpoints); resume from a checkpoint whose files agree")
    if step == 0:
        return
    missing = [n for n in trained if f"{n}.exp_avg" not in opt or f"{n}.exp_avg_sq" not in opt]
    if missing:
        raise MemengineError(f"{opt_file}: no AdamW moments for '{missing[0]}'"
                             + (f" and {len(missing) - 1} more trained tensor(s)" if len(missing) > 1 else "")
                             + f", which the run trained for {step} step(s); the state is incomplete and the run "
                               "cannot continue exactly")
