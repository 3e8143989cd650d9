"""`memengine export`: a checkpoint (or a LoRA adapter, merged into its base first) as one
GGUF file that llama.cpp runs (the format: engine/io/gguf.py).

Everything that can be refused is refused before the file is written: a type the `gguf`
package cannot write, a model llama.cpp cannot run, a tokenizer it cannot take, an output
that exists (without --force), is a directory, or lies inside an input."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from memengine.engine import models
from memengine.engine.errors import MemengineError
from memengine.engine.io import gguf as gg
from memengine.engine.io import staging


@dataclass
class ExportReport:
    src: str                       # the checkpoint (or adapter) as given
    base: str                      # the checkpoint whose weights were written
    output: Path
    type: str
    model_type: str
    vocab: str                     # what the tokenizer became
    tensors: list = field(default_factory=list)   # gg.GGUFTensor
    merged_adapter: Optional[str] = None
    notes: list = field(default_factory=list)
    bytes: int = 0                 # the file's size
    architecture: str = ""         # llama.cpp's name of the architecture

    @property
    def n_params(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors)

    def to_dict(self) -> dict:
        return {"event": "summary", "src": self.src, "base": self.base, "output": str(self.output),
                "type": self.type, "model_type": self.model_type, "architecture": self.architecture,
                "vocab": self.vocab, "merged_adapter": self.merged_adapter, "n_params": self.n_params,
                "bytes": self.bytes, "notes": list(self.notes),
                "tensors": [{"name": t.name, "source": t.source, "shape": list(t.shape), "type": t.type,
                             "bytes": t.nbytes} for t in self.tensors]}


def _real(p) -> Path:
    return Path(os.path.realpath(p))


def check_output(out: Path, force: bool, inputs: list) -> Path:
    """OUT is a file path beside which a temporary can be made: not a directory, not an
    existing file without --force, not one of the inputs nor inside an input directory."""
    out = Path(out)
    flag = f"--output {out}"
    if str(out) in ("", "-", ".") or out.name in ("", ".", ".."):
        raise MemengineError("--output must be a file path (model.gguf)")
    if out.is_dir():
        raise MemengineError(f"{flag}: is a directory; give the .gguf file's path")
    if os.path.lexists(out) and not out.is_file():
        raise MemengineError(f"{flag}: exists and is not a regular file")
    ro = _real(out)
    for what, p in inputs:
        if p is None:
            continue
        files = staging.input_files(p)   # each file of an input directory by its real path
        rp = files[0]
        if ro in files or (rp.is_dir() and rp in ro.parents):
            raise MemengineError(f"{flag}: lies in {what} {p} (export never writes into an input); write "
                                 "it elsewhere")
    if os.path.lexists(out) and not force:
        raise MemengineError(f"{flag}: exists (use --force to replace it)")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise MemengineError(f"{flag}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise MemengineError(f"{flag}: cannot write in {parent}; choose a writable directory")
    return out


def export_gguf(ckpt: str, output, type_: str = "f16", *, revision: Optional[str] = None,
                model_type: Optional[str] = None, base: Optional[str] = None, force: bool = False,
                warn: Optional[Callable[[str], None]] = None,
                step: Optional[Callable[[str], None]] = None,
                on_tensor: Optional[Callable[[int, int, str], None]] = None) -> ExportReport:
    """Write CKPT as the GGUF file `output` (see the module doc). `step` hears each stage,
    `on_tensor` each tensor converted, `warn` the loader's assumptions and the conversion's notes."""
    from memengine.engine import lora
    from memengine.engine.app.setup import open_tokenizer, tokenizer_file

    gg.gguf_module()                  # the gguf package is there, before any work
    t = gg.normalize_type(type_)
    out = Path(output)
    adapter_dir = Path(str(ckpt)) if lora.is_adapter(ckpt) else None
    if adapter_dir is not None:
        check_output(out, force, [("the adapter", adapter_dir)])
    say = step or (lambda s: None)
    say(f"reading {ckpt}")
    op = lora.open_source(ckpt, revision=revision, model_type=model_type, base=base, warn=warn)
    cfg = op.ckpt.config
    mapping = models.of(cfg).gguf()
    notes = mapping.check_runnable(cfg)
    check_output(out, force, [("the input checkpoint", op.ref.path), ("the adapter", adapter_dir)])
    tok = open_tokenizer(op.ckpt, lora.adapter_tokenizer(op.adapter, None))
    tok_path = tokenizer_file(tok)
    gg.check_tokenizer(tok_path, cfg)
    tensors = op.ckpt.tensors
    if op.adapter is not None:
        say(f"merging the adapter (r={op.adapter.spec.r}, scaling {op.adapter.spec.scaling:g}) into "
            f"{op.ref.public_name}")
        tensors = lora.merged_tensors(tensors, op.adapter)
    for n in notes:
        if warn is not None:
            warn(n)
    say(f"converting {len(tensors)} tensors to {t} for llama.cpp (architecture '{mapping.ARCH}'"
        f"{mapping.describe(cfg)})")
    name = (adapter_dir.name if adapter_dir is not None else Path(op.ref.public_name).name) or "memengine"
    written, vocab = gg.write_gguf(out, cfg, tensors, t, tokenizer_path=tok_path, name=name, on_tensor=on_tensor)
    return ExportReport(src=str(ckpt), base=op.ref.public_name, output=out, type=t, model_type=cfg.model_type,
                        vocab=vocab, tensors=written, merged_adapter=str(adapter_dir) if adapter_dir else None,
                        notes=notes, bytes=out.stat().st_size, architecture=mapping.ARCH)
