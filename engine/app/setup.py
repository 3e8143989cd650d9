"""Opening what a run works on: the checkpoint (resolved by engine/io/resolve.py's
`resolve_checkpoint`: a path or a model id), its tokenizer, the GPU runtime, and the model
on it once the memory plan says the run fits."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional


def open_checkpoint(ref, warn: Optional[Callable[[str], None]] = None, read_tensors: bool = True,
                    on_task: Optional[Callable] = None):
    """Load a resolved checkpoint (or only its config and headers: `read_tensors=False`);
    the loader's assumptions go to `warn`; reading the tensors is a task for `on_task` (a
    Listener's: a line when it takes a while, a bf16 130m model's decode ~2 s)."""
    from memengine.engine.io.checkpoint import load_checkpoint
    from memengine.engine.listener import TaskMeter

    remote = list(ref.headers) if getattr(ref, "headers", None) else None
    assert remote is None or not read_tensors, "a model id resolved without its weights has only headers"
    with TaskMeter(on_task if read_tensors else None, f"reading {ref}", None):
        c = load_checkpoint(ref.path, model_type=ref.model_type, read_tensors=read_tensors, headers=remote)
    for w in c.warnings:
        if warn is not None:
            warn(w)
    return c


def open_tokenizer(ckpt, override: Optional[str]):
    """--tokenizer, else the tokenizer.json beside the loaded checkpoint, else bytes."""
    from memengine.engine.io.tokenizer import load_tokenizer

    return load_tokenizer(ckpt.directory, override=override)


def tokenizer_file(tok) -> Optional[Path]:
    """The tokenizer.json a tokenizer was read from (copied into outputs), None for bytes."""
    p = getattr(tok, "path", None)
    return Path(p) if p else None


def open_runtime(device: Optional[str], verbose: bool, backend: Optional[str] = None,
                 precision: Optional[str] = None):
    """The runtime for --device, --backend and --precision (auto takes Dawn's tensor cores
    for mixed runs only), its caches emptied: each command builds its own model, so what an
    earlier one in this process (the demo runs several) left can go."""
    from memengine.engine.runtime import get_runtime

    rt = get_runtime(device or None, verbose=verbose, backend=backend, precision=precision)
    rt.trim()
    return rt


def open_model(rt, ckpt, kind: str, batch_size: int, seq_len: int, eval_passes: tuple = (),
               trace_steps: int = 1, adapter: tuple | None = None, make_lora=None, precision: str = "fp32"):
    """The checkpoint's model on `rt`, after the memory plan of a `kind` run (eval, train,
    adapt) at batch_size x seq_len passed (engine/plan.py; `eval_passes`: batches of each
    evaluation the run makes, `trace_steps`: the trainer's trace): nothing is uploaded for
    a run that cannot work, which is refused with one MemengineError line naming the figure
    and the flag that would help.  `adapter`: (elements, per-row activation elements) of a
    LoRA adapter applied (kind "lora": trained, the base frozen), engine/lora.plan_sizes;
    `make_lora(rt)` makes that adapter on the GPU (an engine.lora.LoraAdapter, given to the
    model), `precision`: "fp32" or "mixed"."""
    from memengine.engine.app.plan import check_run
    from memengine.engine.models.lm import LanguageModel

    check_run(rt, ckpt.config, batch_size, seq_len, kind, eval_passes, trace_steps, adapter=adapter,
              precision=precision)
    model = LanguageModel.from_checkpoint(rt, ckpt, lora=make_lora(rt) if make_lora is not None else None)
    model.set_precision(precision)
    return model
