"""Opening what a run works on: the checkpoint, its tokenizer and the GPU runtime."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from .errors import MemengineError


def checkpoint_dir(path: Path) -> Path:
    p = Path(path)
    return p if p.is_dir() else p.parent


def open_checkpoint(path: Path):
    from .checkpoint import load_checkpoint

    p = Path(path)
    if not p.exists():
        raise MemengineError(f"{p}: no such checkpoint (expected a directory or a .safetensors file)")
    return load_checkpoint(p)


def open_tokenizer(ckpt_path: Path, override: Optional[str]):
    from .tokenizer import load_tokenizer

    return load_tokenizer(checkpoint_dir(ckpt_path), override=override)


def tokenizer_file(tok) -> Optional[Path]:
    """The tokenizer.json a tokenizer was read from (copied into outputs), None for bytes."""
    p = getattr(tok, "path", None)
    return Path(p) if p else None


def open_runtime(device: Optional[str], verbose: bool):
    """The runtime for --device, its caches emptied: each command builds its own model, so
    what an earlier one in this process (the demo runs several) left can go."""
    from .gpu import get_runtime

    rt = get_runtime(device or None, verbose=verbose)
    rt.trim()
    return rt
