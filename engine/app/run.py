"""Runs: `run_eval`, `run_train`, `run_adapt`, `run_generate` take an options dataclass (engine/options.py)
and a `Listener` (engine/listener.py), do the whole job and return a result; the command
line only parses and renders.

A training run: open the checkpoint (or the --resume checkpoint), tokenizer, data and
runtime; check the optimizer state; run the training loop (engine/loop.py) with periodic
checkpoints written by `_Run.save_step`; then write OUT (engine/staging.py) with the
model, optimizer state, trainer state and run record (engine/records.py).
"""

from __future__ import annotations

import contextlib
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from memengine.engine import interrupts, lora
from memengine.engine.app import records
from memengine.engine.app.options import AdaptOptions, EvalOptions, GenerateOptions, TrainOptions
from memengine.engine.app.setup import open_model, open_runtime, open_tokenizer, tokenizer_file
from memengine.engine.errors import Interrupted, MemengineError, NonFiniteError
from memengine.engine.io import staging
from memengine.engine.io import tokens
from memengine.engine.io.data import Batches, Windows, window_count
from memengine.engine.io.resolve import public_path, resolve_checkpoint
from memengine.engine.listener import Listener, TaskMeter
from memengine.engine.train import adapt as wsla
from memengine.engine.train import distributed, optim_state, snapshots, state_schema
from memengine.engine.train.loop import LoopState, TrainingLoop, reads_apart
from memengine.engine.train.sampler import held_out
from memengine.engine.train.trainer import EvalResult, Trainer, evaluate

STATE_VERSION = 2   # 2: with its checksum and the optimizer's step (engine/train/state_schema.py)

# --precision mixed on an adapter with f16 subgroup matrices (tensor cores, Dawn) against fp32,
# training tokens/s on an NVIDIA H100, mamba-130m, B 8, L 2048: 91,389 mixed and 38,298 fp32 under
# Dawn in one call (benchmarks/results/h100/sgmat_wg128, call 3); against wgpu-native's fp32
# 42,596 (results/h100/sgmat_interior, call 5: the same card and driver, its fp32 path unchanged)
MIXED_SPEEDUP = {"dawn": 2.39, "wgpu": 2.15}
MIXED_MEASURED_ON = "an NVIDIA H100 (mamba-130m, B 8, L 2048)"


def precision_note(rt, precision: str) -> str | None:
    """The run's one line on its precision where the adapter has tensor cores from WGSL:
    mixed says its products run on them; fp32 says mixed would be faster, by the factor
    measured against fp32 on this backend (wgpu-native when --backend auto passed over Dawn's
    subgroup matrices for an fp32 run)."""
    here = getattr(rt, "has_subgroup_matrix", False)
    if precision == "mixed":
        return ("--precision mixed: the matrix products run on this adapter's f16 subgroup matrices "
                "(tensor cores)") if here else None
    if here:
        what = f"trained {MIXED_SPEEDUP['dawn']:.2f}x as many tokens/s as fp32 on Dawn"
    elif getattr(rt, "dawn_tensor_cores", False):
        what = (f"(which --backend auto runs on Dawn) trained {MIXED_SPEEDUP['wgpu']:.2f}x as many tokens/s "
                f"as fp32 on wgpu-native")
    else:
        return None
    return f"this adapter has f16 subgroup matrices (tensor cores): --precision mixed {what} on {MIXED_MEASURED_ON}"


# =========================================================================== eval
@dataclass
class EvalReport:
    checkpoint: str
    result: EvalResult
    device: str                     # the GPU adapter it ran on
    compare: Optional[str] = None
    other: Optional[EvalResult] = None
    elapsed_s: float = 0.0

    def to_dict(self) -> dict:
        if self.other is None:
            return self.result.to_dict()
        a, b = self.result.to_dict(), self.other.to_dict()
        return {"a": {"checkpoint": self.checkpoint, **a}, "b": {"checkpoint": self.compare, **b},
                "difference": {k: b[k] - a[k] for k in a if k != "tokens"}}


def _evaluate_checkpoint(ref, sources, o: EvalOptions, listener: Listener, verbose: bool,
                         phase: str, base: Optional[str] = None) -> tuple[EvalResult, str]:
    opened = lora.open_source(ref, base=base, model_type=o.model_type, revision=o.revision, warn=listener.on_warning,
                              on_task=listener.on_task)
    c = opened.ckpt
    tok = open_tokenizer(c, lora.adapter_tokenizer(opened.adapter, o.tokenizer))
    stream = tokens.token_file(sources, tok, c.config.vocab_size, prompt_loss=o.prompt_loss,
                               on_task=listener.on_task)
    batches = Batches(Windows(stream.ids, o.seq_len, stream.mask), o.batch_size, o.seq_len)
    rt = open_runtime(o.device, verbose, o.backend)
    listener.on_device(rt.describe())
    ad = opened.adapter
    with TaskMeter(listener.on_task, f"loading {phase} onto the GPU", None):
        model = open_model(rt, c, "eval", o.batch_size, o.seq_len, eval_passes=(len(batches),),
                           adapter=None if ad is None else lora.plan_sizes(c.config, ad.spec, ad.tensors, train=False),
                           make_lora=None if ad is None else (
                               lambda rt: lora.LoraAdapter(rt, c.config, ad.spec, ad.tensors)))

    def progress(i, n):
        listener.on_eval_progress(phase, i, n)
        interrupts.check()

    with interrupts.deferred():
        return evaluate(model, batches, on_progress=progress), rt.describe()


def _eval_data(paths: list) -> list:
    """--data of eval: a directory's test.jsonl, else its valid.jsonl."""
    d = tokens.data_dir(paths)
    if d is None:
        return list(paths)
    return [tokens.split_file(d, "test", required=False) or tokens.split_file(d, "valid")]


def run_eval(o: EvalOptions, listener: Listener | None = None, *, verbose: bool = False) -> EvalReport:
    """Loss, perplexity, bits per token and top-1/top-5 accuracy of a checkpoint on some
    text; with `compare`, of a second checkpoint on the same text too."""
    listener = listener or Listener()
    o.check_inputs()
    t0 = time.perf_counter()
    # before reading the data (stdin is read once); an adapter's base is found when it is opened
    a = o.ckpt if lora.is_adapter(o.ckpt) else resolve_checkpoint(o.ckpt, o.revision, o.model_type)
    b = None
    if o.compare is not None:
        b = o.compare if lora.is_adapter(o.compare) else resolve_checkpoint(o.compare, None, o.model_type)
    sources = tokens.resolve_sources(_eval_data(o.data), on_task=listener.on_task)   # stdin is read once
    res, device = _evaluate_checkpoint(a, sources, o, listener, verbose, str(o.ckpt), o.base)
    rep = EvalReport(str(o.ckpt), res, device)
    if b is not None:
        other, _ = _evaluate_checkpoint(b, sources, o, listener, verbose, str(o.compare))
        if other.tokens != res.tokens:
            listener.on_warning(f"the two checkpoints tokenize the data differently ({res.tokens:,} vs "
                                f"{other.tokens:,} tokens): per-token figures are not comparable")
        rep.compare, rep.other = str(o.compare), other
    rep.elapsed_s = time.perf_counter() - t0
    return rep


# =========================================================================== generate
def run_generate(o: GenerateOptions, listener: Listener | None = None, *, verbose: bool = False, on_text=None):
    """Continue --prompt with the checkpoint (engine/generate.py); `on_text(str)` gets the
    new text as it becomes final.  Ctrl-C ends the text where it is: the result says
    "interrupted" and holds the tokens so far."""
    from memengine.engine.app.generate import (
        STOP_INTERRUPTED,
        check_prompt_fits,
        eos_token_ids,
        generate,
        prompt_ids,
        read_prompt,
    )
    from memengine.engine.models.lm import LanguageModel

    listener = listener or Listener()
    o.check_inputs()
    ref = o.ckpt if lora.is_adapter(o.ckpt) else resolve_checkpoint(o.ckpt, o.revision, o.model_type)
    text = read_prompt(o.prompt)
    opened = lora.open_source(ref, base=o.base, model_type=o.model_type, revision=o.revision, warn=listener.on_warning,
                              on_task=listener.on_task)
    c, ad = opened.ckpt, opened.adapter
    tok = open_tokenizer(c, lora.adapter_tokenizer(ad, o.tokenizer))
    ids = prompt_ids(tok, text, c.config.vocab_size)
    rt = open_runtime(o.device, verbose, o.backend)
    listener.on_device(rt.describe())
    check_prompt_fits(rt, c.config, ids.size)
    # an adapter is applied on the GPU, not merged (prompt pass and every decoding step)
    with TaskMeter(listener.on_task, f"loading {ref} onto the GPU", None):
        model = LanguageModel.from_checkpoint(rt, c, lora=None if ad is None else lora.LoraAdapter(
            rt, c.config, ad.spec, ad.tensors))
    res = None
    try:
        with interrupts.deferred():
            res = generate(model, ids, o, decode=tok.decode, eos_id=eos_token_ids(tok, c.config, c.directory),
                           on_text=on_text, on_token=lambda _id: interrupts.check())
    except KeyboardInterrupt:
        if res is None:
            raise
        res.stop = STOP_INTERRUPTED  # the signal came after the last token
    beyond = sum(1 for t in res.tokens if t >= 256) if getattr(tok, "name", "") == "bytes" else 0
    if beyond:
        listener.on_warning(f"{beyond} of the {len(res.tokens)} generated token ids are beyond the byte-level "
                            f"tokenizer's 256 (the model's vocabulary is {c.config.vocab_size:,}): they have no "
                            "text and are left out of it (the ids are in --json's \"tokens\"); give --tokenizer "
                            "the model's tokenizer.json")
    return res


# =========================================================================== train / adapt
@dataclass
class RunResult:
    kind: str
    output: Optional[Path]          # None when nothing was written (adapt rolled back)
    state: LoopState
    device: str                     # the GPU adapter it ran on
    elapsed_s: float
    adapt: Optional[wsla.AdaptResult] = None
    best: Optional[dict] = None
    exit_code: int = 0
    checkpoints: Optional[Path] = None  # where the run's checkpoints are, when OUT's model was not written

    def epochs(self) -> list[dict]:
        return [e for e in self.state.history if e["event"] == "epoch"]

    def summary(self) -> dict:
        ep = self.epochs()
        last_eval = self.state.last_eval
        out = {"event": "summary"}
        if self.adapt is not None:
            out.update(self.adapt.summary())
        out.update({
            "output": None if self.output is None else str(self.output),
            "final_loss": ep[-1]["loss"] if ep else float("nan"),
            "first_loss": ep[0]["loss"] if ep else float("nan"),
            "epochs": ep[-1]["epoch"] if ep else 0,
            "steps": self.state.step,
            "tokens": int(sum(e["tokens"] for e in ep)),
            "elapsed_s": self.elapsed_s,
            "adapter": self.device,
        })
        if last_eval is not None:
            out["val_loss"] = last_eval["val_loss"]
            out["val_perplexity"] = last_eval["val_perplexity"]
        if self.best is not None:
            out["best_step"] = self.best["step"]
            out["best_val_loss"] = self.best["val_loss"]
        return out


class _Run:
    """The set-up and the outputs of one train/adapt invocation."""

    def __init__(self, o: TrainOptions, listener: Listener, verbose: bool):
        o.check_inputs()
        self.o = o
        self.listener = listener
        try:
            self._setup(verbose)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Give up OUT's lock (the run is over, or never started)."""
        out = getattr(self, "out", None)
        if out is not None:
            staging.release_lock(out)
        if self.o.resume is not None:
            run_dir = snapshots.run_dir_of(self.o.resume)
            if run_dir is not None:
                staging.release_lock(run_dir)

    def _setup(self, verbose: bool) -> None:
        o = self.o
        self._join_ranks()
        opened = self._open_source()
        self._check_output(opened)
        self._choose_lora(opened)
        opt_state, opt_file = self._optimizer_state()
        self._read_data()
        if o.dry_run:
            self.dry = self._dry_run(verbose)
            return
        self.dry = None
        self._open_model(verbose)
        self._build_loop(opt_state, opt_file)

    def _dry_run(self, verbose: bool) -> dict:
        """What the run would do, checked as far as it can be without training: the options,
        the data, the steps, the checkpoints and the memory plan on this device (a plan
        that does not fit is the same one-line refusal as a real run's)."""
        from memengine.engine.app.plan import check_run
        from memengine.engine.train.loop import total_steps

        o = self.o
        rt = self._open_device(verbose)
        kind, evals, trace, adapter = self._plan_request()
        plan = check_run(rt, self.ckpt.config, o.batch_size, o.seq_len, kind, evals, trace, adapter=adapter,
                         precision=getattr(o, "precision", "fp32"))
        per_epoch = math.ceil(len(self.windows) / (o.batch_size * o.grad_accum))
        start = int((self.snap.state.get("step") if self.snap is not None else 0) or 0)
        return {"event": "dry_run", "kind": o.KIND, "input": self.input, "output": public_path(self.out),
                "resume": None if self.snap is None else {"from": public_path(self.snap.dir), "step": start},
                "options": self.recorded_options(), "data": self.data_info,
                "windows": {"train": len(self.windows), "held_out": window_count(self.val_batches)},
                "steps": {"per_epoch": per_epoch, "total": total_steps(o, per_epoch), "from": start},
                "checkpoints": {"every": o.save_every, "every_minutes": o.save_every_minutes,
                                "on_interrupt": self.world == 1, "policy": self.checkpoint_policy(),
                                "keep_last": o.keep_last, "keep_best": o.keep_best},
                "device": self.device, "memory": plan.to_dict()}

    def _join_ranks(self) -> None:
        """This rank's process group (engine/train/distributed.py) when the run has several;
        rank 0 alone writes outputs."""
        o = self.o
        self.group = distributed.current()
        self.world = 1 if self.group is None else self.group.world
        self.writer = self.group is None or self.group.rank == 0
        if self.group is None and o.nproc_per_node > 1:
            raise MemengineError(f"--nproc-per-node {o.nproc_per_node}: the ranks are started by the memengine "
                                 "command (or torchrun), not inside a running process")
        if self.group is not None and any(str(d) == "-" for d in o.data):
            raise MemengineError("--data -: standard input cannot be read by several ranks; give a file")

    def _open_source(self):
        """The run's checkpoint: CKPT, or the step directory --resume names."""
        o = self.o
        if o.resume is not None and self.writer:
            # continuing in place: OUT is locked (one writer) and a commit a killed run left
            # half-done is finished, before its state is read
            run_dir = snapshots.run_dir_of(o.resume)
            if run_dir is not None and (o.output is None or Path(o.output).resolve() == run_dir.resolve()):
                staging.lock_output(run_dir)
                for note in staging.recover(run_dir):
                    self.listener.on_note(note)
        self.snap = snapshots.locate(o.resume) if o.resume is not None else None
        snap = self.snap
        if snap is not None and snap.kind != o.KIND:
            raise MemengineError(f"--resume {o.resume}: that run was '{snap.kind}'; continue it with "
                                 f"memengine {snap.kind} --resume")
        self.out = Path(o.output) if o.output is not None else snap.run_dir
        self.in_place = snap is not None and self.out.resolve() == snap.run_dir.resolve()
        if snap is not None and o.ckpt is not None:
            self._check_resumed_ckpt(str(snap.state.get("input")))
        return lora.open_source(snap.dir if snap is not None else o.ckpt, revision=None if snap else o.revision,
                                model_type=None if snap else o.model_type, base=o.base,
                                warn=self.listener.on_warning, on_task=self.listener.on_task)

    def _finished_times(self, run_dir: Path) -> None:
        """A step checkpoint's state was written before its invocation ended: the end times
        of the invocations that finished come from the run's record (memengine.json)."""
        from memengine.engine.io.inputs import read_json

        rec_file = Path(run_dir) / staging.RECORD_FILE
        if not rec_file.is_file():
            return
        try:
            done = {s.get("started"): s.get("finished") for s in read_json(rec_file, "run record").get("segments", [])
                    if isinstance(s, dict)}
        except (MemengineError, AttributeError):
            return  # an unreadable record: the times stay unknown
        for seg in self.segments:
            if seg.get("finished") is None and done.get(seg.get("started")) is not None:
                seg["finished"] = done[seg["started"]]

    def _check_resumed_ckpt(self, started_from: str) -> None:
        """CKPT beside --resume (the command that was run, plus --resume) is accepted when it is
        the checkpoint the resumed run started from, and refused naming both otherwise."""
        given = str(self.o.ckpt)
        same = started_from in (given, public_path(given))
        if not same and Path(given).exists() and Path(started_from).exists():
            same = Path(given).resolve() == Path(started_from).resolve()
        if not same:
            raise MemengineError(f"CKPT {given} and --resume {self.o.resume}: the resumed run started from "
                                 f"{started_from}; leave out CKPT (--resume continues from its own checkpoint) "
                                 "or give that one")

    def _check_output(self, opened) -> None:
        """OUT may be written (and is none of the inputs); a resumed run is the same run."""
        o, snap, lis = self.o, self.snap, self.listener
        ref = opened.ref
        inputs = self._inputs(ref.path) + [("the adapter", Path(p)) for p in
                                           (opened.adapter and opened.adapter.path, o.lora_from) if p]
        if self.in_place:   # the resumed checkpoint lies in OUT by definition
            inputs = inputs[1:]
        if snap is not None:
            was = int(snap.state.get("world_size", 1))
            if was != self.world:
                raise MemengineError(f"--resume {o.resume}: the run had {was} rank(s), this one {self.world}; "
                                     f"it continues on {was} (--nproc-per-node {was}), which decides which "
                                     "windows each step sees")
        hint = None
        if not self.in_place and snapshots.resumable(self.out):
            hint = (f"it holds a run that --resume {self.out} continues; --force replaces it" if snap is None
                    else "use --force to replace it")
        if self.writer:   # rank 0 alone looks after OUT
            staging.check_output(self.out, o.force, inputs=inputs, owned=self.in_place, on_note=lis.on_note,
                                 hint=hint)
        if self.in_place and self.writer:
            for note in staging.clean_leftovers(self.out / snapshots.CHECKPOINTS_DIR):
                lis.on_note(note)
        if self.in_place:
            later = snapshots.later_steps(self.out, snap.step)
            if later and not o.force:
                raise MemengineError(
                    f"--resume {o.resume}: {self.out} holds checkpoints after step {snap.step} "
                    f"({later[0].name}, ...); continuing from step {snap.step} would mix two runs "
                    "(use --force to delete them)")
        self.input = str(snap.state.get("input")) if snap is not None else ref.public_name
        if snap is not None:
            self._check_same_run(snap.state.get("options") or {})

    def _choose_lora(self, opened) -> None:
        """The adapter the run trains or applies (engine/lora `for_run`), if any."""
        o = self.o
        self.ckpt, self.ref = opened.ckpt, opened.ref
        # the base an adapter names: kept when it came as CKPT (or is resumed) and --base is not given
        kept = opened.adapter.spec.base if opened.adapter is not None and o.base is None else None
        self.run_lora = lora.for_run(o, opened.adapter, self.ckpt.config, kept or opened.ref.public_name)

    def _optimizer_state(self) -> tuple:
        """(moments, their file) beside what the run starts from: the resumed step, CKPT, or
        the adapter a LoRA run continues (none for a fresh adapter, nor for one applied
        frozen: its moments are not x_proj's); checked against the shapes before any upload."""
        snap, run_lora = self.snap, self.run_lora
        if snap is not None:
            opt_dir = snap.dir
        elif run_lora is None:
            opt_dir = self.ckpt.directory
        else:
            opt_dir = run_lora.source.path if run_lora.train and run_lora.source is not None else None
        from memengine.engine import models

        shapes = ({n: tuple(a.shape) for n, a in run_lora.tensors.items()} if run_lora is not None and run_lora.train
                  else models.of(self.ckpt.config).shapes(self.ckpt.config))
        rows = {}   # adapt's row ranges (Mamba-2: in_proj's B, C, dt rows): an adapt run's moments
        if self.o.WSLA and run_lora is None:
            arch = models.of(self.ckpt.config)
            for n, shape in shapes.items():
                rr = arch.wsla_rows(self.ckpt.config, n)
                if rr is not None:
                    rows[n] = (rr[1],) + tuple(shape[1:])
        opt_file = opt_dir / optim_state.OPTIMIZER_FILE if opt_dir is not None else None
        opt_state = optim_state.load(opt_file, shapes, rows) if opt_file is not None else None
        if snap is not None and opt_state is None:
            raise MemengineError(f"--resume {snap.dir}: no {optim_state.OPTIMIZER_FILE}; cannot continue exactly")
        return opt_state, opt_file

    def _read_data(self) -> None:
        """The tokenizer, --data (and --val-data, a directory's valid.jsonl or the --val-fraction
        split) as windows read from token files (engine/io/tokens.py)."""
        o, snap, lis = self.o, self.snap, self.listener
        self.tok = open_tokenizer(self.ckpt, lora.adapter_tokenizer(self.run_lora and self.run_lora.source,
                                                                    o.tokenizer))
        vocab = self.ckpt.config.vocab_size
        data, val = list(o.data), list(o.val_data)
        d = tokens.data_dir(data)
        if d is not None:
            data = [tokens.split_file(d, "train")]
            valid = tokens.split_file(d, "valid", required=False)
            if valid is not None and not val:
                val = [valid]
                if o.val_fraction > 0:
                    lis.on_note(f"validating on {valid} (--val-fraction is not used when --data's directory holds "
                                "valid.jsonl)")

        def stream(paths, flag):
            src = tokens.resolve_sources(paths, flag, on_task=lis.on_task)
            return tokens.token_file(src, self.tok, vocab, prompt_loss=o.prompt_loss, on_task=lis.on_task)

        self.stream = stream(data, "--data")
        windows = Windows(self.stream.ids, o.seq_len, self.stream.mask)
        self.all_windows = windows
        val_windows = None
        self.val_stream = None
        if val:
            self.val_stream = stream(val, "--val-data")
            val_windows = Windows(self.val_stream.ids, o.seq_len, self.val_stream.mask)
        elif o.val_fraction > 0:
            held = held_out(len(windows), o.val_fraction, o.seed)
            val_windows = windows.only(held)
            windows = windows.without(held)
        self.windows = windows
        self.val_batches = Batches(val_windows, o.batch_size, o.seq_len) if val_windows is not None else None
        self.data_info = {"sha256": self.stream.fingerprint(), "tokens": self.stream.size,
                          "documents": self.stream.documents, "windows": len(self.all_windows)}
        if self.stream.mask_sha256 is not None:
            self.data_info["mask_sha256"] = self.stream.mask_sha256
        if self.val_stream is not None:
            self.data_info["val_sha256"] = self.val_stream.fingerprint()
            if self.val_stream.mask_sha256 is not None:
                self.data_info["val_mask_sha256"] = self.val_stream.mask_sha256
        if snap is not None:
            self._check_same_data(snap.state.get("data") or {})

    def _open_device(self, verbose: bool):
        """The runtime of this rank's device, shown to the listener."""
        rt = open_runtime(distributed.device_request(self.o.device, self.group), verbose, self.o.backend,
                          self.o.precision)
        self.device = rt.describe()
        self.backend = rt.backend_name
        self.listener.on_device(self.device)
        note = precision_note(rt, self.o.precision)
        if note:
            self.listener.on_note(note)
        return rt

    def _plan_request(self) -> tuple:
        """(kind, evaluation passes, trace steps, adapter sizes) of the run's memory plan:
        what the model is opened with, and what --dry-run shows."""
        o, run_lora = self.o, self.run_lora
        val = (len(self.val_batches),) if self.val_batches else ()
        evals = (math.ceil(len(self.all_windows) / o.batch_size),) + val if o.WSLA else val
        adapter = None if run_lora is None else lora.plan_sizes(self.ckpt.config, run_lora.spec, run_lora.tensors,
                                                                train=run_lora.train)
        return ("lora" if run_lora and run_lora.train else o.KIND), evals, reads_apart(o, len(self.windows)), adapter

    def _open_model(self, verbose: bool) -> None:
        """The runtime, and the model on it once the memory plan passes (with its adapter)."""
        o, run_lora = self.o, self.run_lora
        self.rt = self._open_device(verbose)
        kind, evals, trace, adapter = self._plan_request()
        with TaskMeter(self.listener.on_task, "loading the model onto the GPU", None):
            self.model = open_model(self.rt, self.ckpt, kind, o.batch_size, o.seq_len, eval_passes=evals,
                                    trace_steps=trace, adapter=adapter,
                                    make_lora=None if run_lora is None else (
                                        lambda rt: lora.LoraAdapter(rt, self.ckpt.config, run_lora.spec,
                                                                    run_lora.tensors, seed=o.seed,
                                                                    train=run_lora.train)),
                                    precision=o.precision)

    def _build_loop(self, opt_state, opt_file) -> None:
        """The trainer (AdamW with the moments read), the loop's state, and the loop."""
        o, snap, lis, run_lora = self.o, self.snap, self.listener, self.run_lora
        if snap is None and opt_state is not None:
            n = sum(1 for k in opt_state if k.endswith(".exp_avg"))
            lis.on_note(f"resuming optimizer state from {opt_file} ({n} moments)")
        self.state = LoopState.from_dict(snap.state.get("loop") or {}) if snap is not None else LoopState()
        self.segments = [dict(s) for s in snap.state.get("segments") or []] if snap is not None else []
        if snap is not None:
            self._finished_times(snap.run_dir)
        self.segments.append(records.segment(self.device, None if snap is None else public_path(snap.dir),
                                             self.state.step, backend=self.backend))
        if snap is not None:
            lis.on_note(f"resuming {snap.dir} at step {snap.step}")
        self.trainer = Trainer(self.model, o, opt_state, wsla=o.WSLA,
                               trace_capacity=reads_apart(o, len(self.windows)), group=self.group)
        if snap is not None:   # the two files of the checkpoint belong together
            state_schema.check_optimizer_agrees(snap.state, opt_state, list(self.trainer.names),
                                                f"--resume {snap.dir}", opt_file)
            state_schema.check_order_rng((snap.state.get("loop") or {}).get("order"), o.seed, f"--resume {snap.dir}")
        self.claimed = self.in_place
        self.extra_state: dict = dict(snap.state.get("extra") or {}) if snap is not None else {}
        title = f"{'adapt (WSLA)' if o.WSLA else 'train'} {o.ckpt if snap is None else snap.dir} -> {self.out}"
        if o.report_to == "tensorboard" and self.writer:
            lis = self._tensorboard(lis)
        self.loop = TrainingLoop(self.trainer, self.windows, o, val_batches=self.val_batches, listener=lis,
                                 state=self.state, on_save=self.save_step, title=title)
        if self.in_place and o.force and self.writer:
            for d in snapshots.later_steps(self.out, snap.step):
                staging.remove_dir(d)
        lp = self.loop
        what = (f"adapting {len(self.trainer.names)} selection tensor(s) ({self.model.arch.wsla_scope})" if o.WSLA
                else f"training {len(self.trainer.names)} tensors")
        if run_lora is not None and run_lora.train:
            n = sum(t.numel for t in self.trainer.params.values())
            spec = run_lora.spec
            what = (f"training a LoRA adapter (r {spec.r}, alpha {spec.alpha:g}, {', '.join(spec.targets)}: "
                    f"{len(self.trainer.names)} tensors, {n:,} parameters; the base is frozen)")
        elif run_lora is not None:
            what += f" with the adapter {run_lora.source.path} applied"
        val = f", {window_count(lp.val_batches)} held out" if lp.val_batches else ""
        lis.on_note(f"{what} on {self.stream.size:,} tokens ({len(self.windows)} windows{val}; "
                    f"{lp.steps_per_epoch} step(s)/epoch, {lp.total} step(s) in all)"
                    + (f", max delta {o.max_delta:g}, tolerance x{o.tolerance:g}" if o.WSLA else "")
                    + f"; {self.checkpoint_policy()}")

    def checkpoint_policy(self) -> str:
        """When the run writes checkpoints, in the words of its plan line."""
        o = self.o
        when = []
        if o.save_every:
            when.append(f"every {o.save_every} steps (--save-every)")
        if o.save_every_minutes:
            when.append(f"every {o.save_every_minutes:g} min (--save-every-minutes)")
        if self.world == 1:
            when.append("on Ctrl-C/SIGTERM")
        if not when:
            return "no checkpoints until the end"
        return "checkpoints " + ", ".join(when)

    def _tensorboard(self, lis: Listener) -> Listener:
        """--report-to tensorboard: OUT is the run's directory from the start (as with
        checkpoints), its runs/<time>/ the event files of this invocation."""
        from memengine.engine.app import curves

        if not self.claimed:
            # the event files need OUT from the start: a new OUT is made now; an old one that
            # --force replaces goes now too (without --report-to it stays until the first
            # checkpoint is complete)
            if self.out.exists():
                with staging.staged_output(self.out, self.o.force, record=False):
                    pass
            else:
                self.out.mkdir(parents=True)
            self.claimed = True
        logdir = self.out / curves.RUNS_DIR / time.strftime("%Y%m%d-%H%M%S")
        board = curves.TensorBoard(logdir)
        lis.on_note(f"TensorBoard event files: {logdir} (tensorboard --logdir {self.out / curves.RUNS_DIR})")
        return curves.Reporting(lis, [board])

    def recorded_options(self) -> dict:
        """The options as the run record and trainer_state.json keep them: a LoRA run's
        effective --lora-* values (what a resume continues with) in place of those given."""
        options = self.o.to_dict(public=True)
        if self.run_lora is not None:
            options.update(self.run_lora.options())
        return options

    def _inputs(self, source: Path) -> list:
        """(what, path) of every file the run reads: OUT may not be, contain or lie in one."""
        o = self.o
        items = [("the input checkpoint", source)]
        items += [("the --data file", d) for d in o.data]
        items += [("the --val-data file", d) for d in o.val_data]
        if o.tokenizer not in (None, "bytes"):
            items.append(("the --tokenizer file", o.tokenizer))
        if o.config_file is not None:
            items.append(("the --config file", o.config_file))
        return items

    # options that fix which windows each step sees: a resumed run keeps them
    SAME_RUN = ("seq_len", "batch_size", "grad_accum", "seed", "shuffle", "val_fraction")

    def _check_same_run(self, recorded: dict) -> None:
        from memengine.engine.app.options import given

        cls = type(self.o)
        for key in self.SAME_RUN:
            if key in recorded and recorded[key] != getattr(self.o, key):
                raise MemengineError(
                    f"--resume: {given(cls, key, getattr(self.o, key))} differs from the resumed run's "
                    f"{given(cls, key, recorded[key])}; it decides which windows each step sees, so a resumed run "
                    "keeps it")

    def _check_same_data(self, rec: dict) -> None:
        for key, flag in (("sha256", "--data"), ("val_sha256", "--val-data")):
            if rec.get(key) != self.data_info.get(key):
                raise MemengineError(
                    f"--resume: {flag} is not the data the run was trained on (its tokens differ); a resumed "
                    "run continues on the same data (start a new run from the checkpoint to train on other data)")
        for key in ("mask_sha256", "val_mask_sha256"):
            if rec.get(key) != self.data_info.get(key):
                raise MemengineError(
                    "--resume: the tokens the loss is on differ from the resumed run's (--train-on-prompt, or the "
                    "data's prompts); a resumed run keeps them")
        for key in ("tokens", "windows", "documents"):
            if key in rec and rec[key] != self.data_info.get(key):
                raise MemengineError(f"--resume {self.snap.dir}: its trainer state says the data has {rec[key]} "
                                     f"{key}, the data read now {self.data_info.get(key)}; the state does not "
                                     "belong to this data")

    # ------------------------------------------------------------------ writing
    def trainer_state(self, moments: Optional[dict] = None) -> dict:
        segs = [dict(s) for s in self.segments]
        segs[-1]["last_step"] = self.state.step
        options = self.recorded_options()
        for key in snapshots.RUN_RELATIVE:  # found again by --resume, wherever it is run from
            options[key] = [snapshots.relative_to_run(d, self.out) for d in getattr(self.o, key)]
        return {"format": snapshots.STATE_FORMAT, "version": STATE_VERSION, "kind": self.o.KIND,
                "world_size": self.world, "step": self.state.step, "epoch": (self.loop.order.state()["epoch"]), "input": self.input,
                "options": options, "data": self.data_info, "extra": self.extra_state,
                "segments": segs, "optimizer_step": optim_state.step_count(moments), "loop": self.loop.state_dict()}

    def write_checkpoint(self, directory: Path, final: Path) -> None:
        """Model (F32) or a LoRA run's adapter, optimizer state and trainer state into
        `directory` (renamed to `final` afterwards).  An adapt with an adapter applied writes
        the model with the adapter merged (what it evaluated)."""
        import numpy as np
        from memengine.engine.io.checkpoint import save_checkpoint, side_files

        run_lora = self.run_lora
        tensors = self.model.lora.state_dict() if run_lora and run_lora.train else self.model.state_dict()
        for name, a in tensors.items():
            if not np.all(np.isfinite(a)):
                raise NonFiniteError(f"tensor {name} holds NaN/Inf after training")
        tok = tokenizer_file(self.tok)
        if run_lora and run_lora.train:
            lora.write_run_adapter(directory, run_lora, tensors, tok)
            moments = self._moments()
            optim_state.save(directory, moments)
            state = self.trainer_state(moments)
            state["extra"] = {**state["extra"], "lora": {
                "base_relative": None if self.ref.repo_id else snapshots.relative_to_run(str(self.ref.path), final)}}
            snapshots.write_state(directory, state)
            self._curves(directory)
            return
        if run_lora is not None:
            tensors = lora.merged_tensors(tensors, run_lora.source)
        save_checkpoint(directory, self.ckpt.config, tensors, dtype="F32", tokenizer_path=tok,
                        extra_files=side_files(self.ckpt.directory, tok.parent if tok else None),
                        metadata={"producer": f"memengine {records.version()}", "step": str(self.state.step)},
                        max_shard_size=self.o.max_shard_bytes)
        moments = self._moments()
        optim_state.save(directory, moments)
        snapshots.write_state(directory, self.trainer_state(moments))
        self._curves(directory)

    def _curves(self, directory: Path) -> None:
        """loss.png of the history so far (engine/app/curves.py; nothing without matplotlib)."""
        from memengine.engine.app import curves

        curves.write_png(directory, self.state.history, f"{self.o.KIND} {self.input} -> {public_path(self.out)}")

    def _moments(self) -> dict:
        """The trainer's optimizer state; with --shard-moments gathered from every rank (each
        calls this at every save and publish, whichever writes), once per step."""
        if not self.trainer.shard:
            return self.trainer.optimizer_state()
        cached = getattr(self, "_moments_at", None)
        if cached is None or cached[0] != self.state.step:
            cached = self._moments_at = (self.state.step, self.trainer.optimizer_state())
        return cached[1]

    def save_step(self, loop: TrainingLoop) -> Path:
        if self.trainer.shard:
            self._moments()
        if not self.writer:   # rank 0 writes the run's checkpoints
            return snapshots.step_dir(self.out, self.state.step)
        d = snapshots.step_dir(self.out, self.state.step)
        if not self.claimed:
            # the first checkpoint makes OUT: staged inside a new OUT and put in place whole, so
            # an old OUT (--force) stays until the new one holds a complete checkpoint
            with staging.staged_output(self.out, self.o.force, record=False) as tmp:
                inner = tmp / snapshots.CHECKPOINTS_DIR / d.name
                inner.mkdir(parents=True)
                self.write_checkpoint(inner, d)
            self.claimed = True
        else:
            with staging.staged_output(d, force=True, record=False) as tmp:
                self.write_checkpoint(tmp, d)
        best = self.state.best["step"] if (self.o.keep_best and self.state.best) else None
        snapshots.prune(self.out, self.o.keep_last, keep=best)
        return d

    def publish(self, result: dict) -> Path:
        """Write OUT: the final (or with --keep-best the best) model, optimizer and trainer
        state, and memengine.json (rank 0 of a multi-rank run; the others write nothing)."""
        st = self.state
        if self.trainer.shard:
            self._moments()
        if not self.writer:
            return self.out
        result = {**result, "output": public_path(self.out)}  # no absolute local path in an output
        if self.trainer.scaler is not None:  # --precision mixed: final loss scale, steps skipped
            result.update(self.trainer.scaler.read())
        best_dir = None
        if self.o.keep_best and st.best is not None:
            best_dir = snapshots.step_dir(self.out, st.best["step"])
        # this invocation's segment ends now: OUT's trainer state carries it, so a later --resume
        # keeps the time in the history
        self.segments[-1]["finished"] = records.now()
        ctx = staging.publish_files(self.out) if self.claimed else staging.staged_output(self.out, self.o.force)
        with ctx as tmp:
            if best_dir is not None and best_dir.is_dir():
                for f in sorted(best_dir.iterdir()):
                    if f.is_file():
                        shutil.copyfile(f, tmp / f.name)
            else:
                self.write_checkpoint(tmp, self.out)
            segs = [dict(s) for s in self.segments]
            segs[-1].update(last_step=st.step)
            extra = {"best": st.best} if self.o.keep_best else {}
            if self.world > 1:
                extra["world_size"] = self.world
            rec = records.run_record(self.o.KIND, self.recorded_options(), input_path=self.input,
                                     device=self.device, backend=self.backend,
                                     segments=segs, history=st.history, result=result,
                                     extra=extra or None)
            staging.write_json(tmp / staging.RECORD_FILE, rec)
            spec = self.run_lora.spec if self.run_lora is not None and self.run_lora.train else None
            card = records.model_card(self.o.KIND, base=self.input, model_type=self.ckpt.config.model_type,
                                      options=self.recorded_options(), data=self.data_info, result=result,
                                      lora=None if spec is None else {"r": spec.r, "alpha": spec.alpha,
                                                                      "dropout": spec.dropout,
                                                                      "targets": list(spec.targets)})
            staging.write_text(tmp / records.CARD_FILE, card)
        return self.out

    def finish(self) -> None:
        """A multi-rank run ends on every rank once rank 0 has written OUT."""
        if self.group is not None:
            self.group.finish()

    def checkpoint_now(self) -> None:
        """After an interrupt outside the steps (adapt's perplexity after them): a checkpoint
        of where the run is, unless the last one is of this step (one process only: ranks stop)."""
        if self.world != 1 or not self.writer or self.state.step == 0:
            return
        steps = snapshots.list_steps(self.out) if self.claimed else []
        if steps and steps[-1][0] == self.state.step:
            return
        self.loop.checkpoint()

    def last_checkpoint(self) -> Optional[Path]:
        steps = snapshots.list_steps(self.out) if getattr(self, "claimed", False) else []
        return steps[-1][1] if steps else None

    def left(self) -> str:
        """What an interrupted or failed run leaves behind, for its one-line message: what is
        on disk now (also asked by the emergency exit of a second Ctrl-C, from its thread)."""
        if not self.writer:
            return "rank 0 writes the run's outputs and says what it leaves"
        if interrupts.was_completed(self.out):
            return f"{self.out} had been written completely and is kept"
        steps = snapshots.list_steps(self.out) if getattr(self, "claimed", False) else []
        if not steps:
            if self.out.exists():
                return f"nothing was written ({self.out} is as it was)"
            return "nothing was written"
        last = steps[-1][1]
        n = f"{len(steps)} complete checkpoints, resumable" if len(steps) > 1 else "complete, resumable"
        return f"the last checkpoint is {last} ({n}; continue with --resume {self.out})"

    @contextlib.contextmanager
    def interruptible(self):
        """A Ctrl-C/SIGTERM in here says what the run leaves behind; OUT's lock is given up
        at the end."""
        try:
            with interrupts.leaving(self.left):
                yield
        except Interrupted:
            raise
        except KeyboardInterrupt:
            raise Interrupted(f"{interrupts.signal_name()}; {self.left()}") from None
        finally:
            self.release()

    def train(self) -> None:
        try:
            self.loop.run()
        except NonFiniteError as e:
            raise NonFiniteError(f"{e}; {self.left()}") from None


def run_train(o: TrainOptions, listener: Listener | None = None, *, verbose: bool = False):
    """Fine-tune every parameter as `o` says and write OUT (see the module doc).  With
    --dry-run, the dict of what the run would do instead (nothing trained or written)."""
    r = _Run(o, listener or Listener(), verbose)
    if r.dry is not None:
        r.release()
        return r.dry
    with r.interruptible():
        t0 = time.perf_counter()
        r.train()
        elapsed = time.perf_counter() - t0
        res = RunResult("train", r.out, r.state, r.device, elapsed, best=r.state.best if o.keep_best else None)
        summary = res.summary()
        r.publish({k: v for k, v in summary.items() if k != "event"})
        r.finish()
    return res


def run_adapt(o: AdaptOptions, listener: Listener | None = None, *, verbose: bool = False) -> RunResult:
    """WSLA as `o` says: perplexity before, training of x_proj, perplexity after, and
    rollback (exit status 3, nothing written) on regression."""
    lis = listener or Listener()
    r = _Run(o, lis, verbose)
    if r.dry is not None:
        r.release()
        return r.dry
    with r.interruptible():
        return _adapt(r, o, lis)


def _adapt(r: _Run, o: AdaptOptions, lis: Listener) -> RunResult:
    batches = Batches(r.all_windows, o.batch_size, o.seq_len)

    def measure(phase: str) -> EvalResult:
        def progress(i, n):
            lis.on_eval_progress(f"perplexity {phase}", i, n)
            interrupts.check()

        with interrupts.deferred():
            return evaluate(r.model, batches, on_progress=progress, fence=r.trainer.fence)

    before = r.extra_state.get("before")
    if before is None:
        ev = measure("before")
        if not math.isfinite(ev.perplexity):
            raise MemengineError(f"perplexity of the input model on the adapt text is not finite "
                                 f"({ev.perplexity}); the checkpoint cannot be adapted")
        before = {"perplexity": ev.perplexity, "loss": ev.loss, "tokens": ev.tokens}
        r.extra_state["before"] = before
    start = wsla.snapshot(r.model)
    t0 = time.perf_counter()
    failure = ""
    try:
        r.train()
    except NonFiniteError as e:
        failure = f"non-finite training loss ({e})"
    try:
        after = measure("after") if not failure else None
    except KeyboardInterrupt:
        r.checkpoint_now()   # the training is done: a resumed run measures again and decides
        raise
    elapsed = time.perf_counter() - t0
    ppl_after = after.perplexity if after is not None else float("nan")
    reason = wsla.regression(before["perplexity"], ppl_after, o.tolerance, failure)
    if r.group is not None:   # one decision for all ranks: rank 0's
        reason = r.group.broadcast(reason)
    changed, max_abs = wsla.changes(start, r.model.state_dict(), r.trainer.names)
    epochs = [e for e in r.state.history if e["event"] == "epoch"]
    norms = [e["grad_norm"] for e in epochs]
    rolled_back = bool(reason) and o.rollback
    if rolled_back:
        r.model.load_state_dict(start)
    elif reason:
        reason = "not rolled back (--no-rollback): " + reason
    else:
        reason = f"perplexity {before['perplexity']:.4f} -> {ppl_after:.4f} (within x{o.tolerance:g})"
    result = wsla.AdaptResult(
        perplexity_before=before["perplexity"], perplexity_after=ppl_after,
        grad_norm=float(sum(norms) / len(norms)) if norms else float("nan"), rolled_back=rolled_back,
        reason=reason, changed_tensors=changed, max_abs_delta=max_abs, loss_before=before["loss"],
        loss_after=after.loss if after is not None else float("nan"))
    res = RunResult("adapt", None if rolled_back else r.out, r.state, r.device, elapsed, adapt=result,
                    best=r.state.best if o.keep_best else None, exit_code=3 if rolled_back else 0,
                    checkpoints=(r.out / snapshots.CHECKPOINTS_DIR) if rolled_back and r.last_checkpoint() else None)
    if not rolled_back:
        summary = res.summary()
        r.publish({k: v for k, v in summary.items() if k != "event"})
    r.finish()
    return res
