"""Checkpoints: a directory with model.safetensors + config.json (+ tokenizer.json), or a bare
.safetensors file (config from its `__metadata__["config"]`, else inferred from shapes).

Every tensor is decoded to float32 and checked against `expected_shapes(config)`: a missing,
unexpected or misshaped tensor, or a NaN/Inf weight, is a one-line `MemengineError` naming
the tensor. Writing is atomic per file (temp file in the target dir + os.replace).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .config import MambaConfig, expected_shapes
from .errors import MemengineError
from .safetensors_io import BF16Bits, F16Bits, atomic_write_bytes, read_header, read_safetensors, write_safetensors

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
OPTIMIZER_FILE = "optimizer.safetensors"
CONFIG_METADATA_KEY = "config"

_ALIASES = {"backbone.embedding.weight": "backbone.embeddings.weight"}


@dataclass
class Checkpoint:
    config: MambaConfig
    tensors: dict[str, np.ndarray]  # float32, canonical HF names, model order
    dtypes: dict[str, str]  # source dtype per tensor ("F32", "F16", "BF16", "F64")
    path: Path  # the checkpoint dir (or the bare file)
    tokenizer_path: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # "optimizer_path", "metadata", "model_file"

    @property
    def directory(self) -> Path:
        return self.path if self.path.is_dir() else self.path.parent

    @property
    def n_params(self) -> int:
        return int(sum(t.size for t in self.tensors.values()))


# ------------------------------------------------------------------------ inference
def infer_config(tensors: dict[str, tuple]) -> MambaConfig:
    """Derive a MambaConfig from tensor name -> shape (HF names; embedding alias accepted)."""
    shapes = {_ALIASES.get(k, k): tuple(v) for k, v in tensors.items()}

    def need(name: str, ndim: int) -> tuple[int, ...]:
        if name not in shapes:
            raise MemengineError(f"cannot infer the model shape: tensor '{name}' is missing")
        s = shapes[name]
        if len(s) != ndim:
            raise MemengineError(f"cannot infer the model shape: tensor '{name}' has shape {list(s)}, expected {ndim} dims")
        return s

    V, E = need("backbone.embeddings.weight", 2)
    layer_ids = {int(m.group(1)) for k in shapes if (m := re.match(r"backbone\.layers\.(\d+)\.", k))}
    if not layer_ids:
        raise MemengineError("cannot infer the model shape: no 'backbone.layers.N.*' tensors")
    n_layers = max(layer_ids) + 1
    missing = sorted(set(range(n_layers)) - layer_ids)
    if missing:
        raise MemengineError(f"cannot infer the model shape: layer {missing[0]} has no tensors ('backbone.layers.{missing[0]}.*')")
    p = "backbone.layers.0.mixer."
    two_di, e2 = need(p + "in_proj.weight", 2)
    Di = two_di // 2
    if two_di % 2 or e2 != E or Di % E:
        raise MemengineError(
            f"cannot infer the model shape: in_proj.weight {[two_di, e2]} is not [2*expand*E, E] with E={E}")
    di2, N = need(p + "A_log", 2)
    di3, one, K = need(p + "conv1d.weight", 3)
    di4, R = need(p + "dt_proj.weight", 2)
    if not (di2 == di3 == di4 == Di) or one != 1:
        raise MemengineError("cannot infer the model shape: A_log / conv1d / dt_proj disagree on the inner size")
    cfg = MambaConfig(
        vocab_size=V, hidden_size=E, state_size=N, num_hidden_layers=n_layers, expand=Di // E,
        conv_kernel=K, time_step_rank=R, use_bias=(p + "in_proj.bias") in shapes,
        use_conv_bias=(p + "conv1d.bias") in shapes, tie_word_embeddings="lm_head.weight" not in shapes,
    )
    if cfg.dt_rank == -(-E // 16):
        cfg.time_step_rank = "auto"
    return cfg


# -------------------------------------------------------------------------- checks
def _canonicalize(tensors: dict[str, Any], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tensors.items():
        k2 = _ALIASES.get(k, k)
        if k2 in out:
            raise MemengineError(f"{where}: both 'backbone.embedding.weight' and 'backbone.embeddings.weight' present")
        out[k2] = v
    return out


def check_tensors(cfg: MambaConfig, shapes: dict[str, tuple], where: str) -> None:
    """Keys and shapes against expected_shapes(cfg): one-line error naming the first bad tensor."""
    exp = expected_shapes(cfg)
    for name, shape in exp.items():
        if name not in shapes:
            hint = ""
            if name.endswith(".bias") and (".in_proj." in name or ".out_proj." in name):
                hint = " (config has use_bias=true)"
            elif name.endswith("conv1d.bias"):
                hint = " (config has use_conv_bias=true)"
            elif name == "lm_head.weight":
                hint = " (config has tie_word_embeddings=false)"
            raise MemengineError(f"{where}: missing tensor '{name}' (expected shape {list(shape)}){hint}")
        if tuple(shapes[name]) != tuple(shape):
            raise MemengineError(
                f"{where}: tensor '{name}' has shape {list(shapes[name])}, expected {list(shape)} for this config")
    for name in shapes:
        if name not in exp:
            raise MemengineError(f"{where}: unexpected tensor '{name}' (shape {list(shapes[name])}) for this config")


def _check_finite(name: str, a: np.ndarray, where: str) -> None:
    if a.size and not np.isfinite(a).all():
        bad = ~np.isfinite(a)
        idx = np.unravel_index(int(np.flatnonzero(bad)[0]), a.shape) if a.ndim else ()
        kind = "NaN" if np.isnan(a).any() else "Inf"
        raise MemengineError(
            f"{where}: tensor '{name}' holds {int(bad.sum())} non-finite value(s) ({kind}, first at index {list(map(int, idx))})")


def _drop_tied_head(cfg: MambaConfig, tensors: dict[str, Any], where: str) -> None:
    if cfg.tie_word_embeddings and "lm_head.weight" in tensors and "backbone.embeddings.weight" in tensors:
        head, emb = tensors["lm_head.weight"], tensors["backbone.embeddings.weight"]
        if np.shape(head) == np.shape(emb) and np.array_equal(np.asarray(head), np.asarray(emb)):
            del tensors["lm_head.weight"]
        else:
            raise MemengineError(
                f"{where}: config ties lm_head to the embeddings but tensor 'lm_head.weight' differs from them; "
                "set tie_word_embeddings to false in config.json")


# --------------------------------------------------------------------------- loading
def _read_json_config(path: Path) -> MambaConfig:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MemengineError(f"{path}: not found") from None
    except UnicodeDecodeError as e:
        raise MemengineError(f"{path}: not UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise MemengineError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise MemengineError(f"{path}: cannot read ({e.strerror or e})") from None
    return MambaConfig.from_dict(d, source=str(path))


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Load a checkpoint directory or a bare .safetensors file (see module doc)."""
    p = Path(path)
    if not p.exists():
        raise MemengineError(f"checkpoint '{p}' not found")
    if p.is_dir():
        model_file = p / MODEL_FILE
        if not model_file.is_file():
            cands = sorted(p.glob("*.safetensors"))
            cands = [c for c in cands if c.name != OPTIMIZER_FILE]
            if (p / "model.safetensors.index.json").exists():
                raise MemengineError(f"{p}: sharded checkpoints (model.safetensors.index.json) are not supported; merge the shards into {MODEL_FILE}")
            if len(cands) != 1:
                raise MemengineError(f"{p}: no {MODEL_FILE} in the checkpoint directory")
            model_file = cands[0]
        cfg_file = p / CONFIG_FILE
        if not cfg_file.is_file():
            raise MemengineError(f"{p}: no {CONFIG_FILE} in the checkpoint directory")
        base = p
    else:
        model_file, base = p, p
        cfg_file = p.parent / CONFIG_FILE if p.name == MODEL_FILE and (p.parent / CONFIG_FILE).is_file() else None

    hdr = read_header(model_file)
    where = str(model_file)
    if cfg_file is not None:
        cfg = _read_json_config(cfg_file)
    elif CONFIG_METADATA_KEY in hdr.metadata:
        try:
            d = json.loads(hdr.metadata[CONFIG_METADATA_KEY])
        except json.JSONDecodeError as e:
            raise MemengineError(f"{where}: __metadata__ 'config' is not valid JSON ({e})") from None
        cfg = MambaConfig.from_dict(d, source=f"{where} __metadata__ config")
    else:
        cfg = infer_config({k: v.shape for k, v in hdr.tensors.items()})

    for name, info in hdr.tensors.items():
        if info.dtype not in ("F32", "F16", "BF16", "F64"):
            raise MemengineError(f"{where}: tensor '{name}' has dtype {info.dtype}; model weights must be F32, F16 or BF16")
    shapes = _canonicalize({k: v.shape for k, v in hdr.tensors.items()}, where)
    if cfg.tie_word_embeddings and "lm_head.weight" in shapes:
        shapes.pop("lm_head.weight")  # decided after decoding (identical -> dropped)
    check_tensors(cfg, shapes, where)

    raw, dtypes, metadata = read_safetensors(model_file)
    tensors = _canonicalize(raw, where)
    dtypes = _canonicalize(dtypes, where)
    _drop_tied_head(cfg, tensors, where)
    ordered = {name: tensors[name] for name in expected_shapes(cfg)}
    for name, a in ordered.items():
        _check_finite(name, a, where)

    d = base if base.is_dir() else base.parent
    tok = d / TOKENIZER_FILE
    extra: dict[str, Any] = {"metadata": metadata, "model_file": model_file}
    if (d / OPTIMIZER_FILE).is_file():
        extra["optimizer_path"] = d / OPTIMIZER_FILE
    return Checkpoint(
        config=cfg, tensors=ordered, dtypes={k: dtypes[k] for k in ordered}, path=p,
        tokenizer_path=tok if tok.is_file() else None, extra=extra,
    )


# --------------------------------------------------------------------------- saving
def _safe_file_name(name: str) -> str:
    if not name or "/" in name or "\\" in name or name in (".", "..") or name.startswith("."):
        raise MemengineError(f"extra file name {name!r} must be a plain file name")
    return name


def save_checkpoint(out_dir: str | Path, config: MambaConfig, tensors: dict[str, np.ndarray], *,
                    dtype: str = "F32", tokenizer_path: str | Path | None = None,
                    extra_files: dict[str, bytes | Path] | None = None,
                    metadata: dict[str, str] | None = None) -> Path:
    """Write model.safetensors (+ config.json, tokenizer.json, extra files) into `out_dir`.

    `tensors` are float32 arrays (canonical names; a tied lm_head equal to the embeddings is
    dropped). `dtype` is "F32", "F16" or "BF16" (f16/bf16 round to nearest even; a value
    beyond the range is an error naming the tensor). NaN/Inf weights are refused. Every file
    is written atomically. Returns the directory.
    """
    from .quantize import encode, normalize_dtype

    out = Path(out_dir)
    dt = normalize_dtype(dtype, flag="dtype")
    if out.exists() and not out.is_dir():
        raise MemengineError(f"output '{out}' exists and is not a directory")
    where = f"saving to {out}"
    tensors = _canonicalize(dict(tensors), where)
    _drop_tied_head(config, tensors, where)
    check_tensors(config, {k: np.shape(v) for k, v in tensors.items()}, where)
    config.validate()

    payload: dict[str, Any] = {}
    for name in expected_shapes(config):
        a = np.asarray(tensors[name])
        if a.dtype.kind != "f":
            raise MemengineError(f"{where}: tensor '{name}' has dtype {a.dtype}, expected float")
        a = a.astype(np.float32, copy=False)
        _check_finite(name, a, where)
        if dt == "F32":
            payload[name] = a
        elif dt == "F16":
            payload[name] = F16Bits(encode(a, "F16", name=name))
        else:
            payload[name] = BF16Bits(encode(a, "BF16", name=name))

    meta = {"format": "pt", CONFIG_METADATA_KEY: json.dumps(config.to_hf_dict(), sort_keys=True)}
    if metadata:
        meta.update({str(k): str(v) for k, v in metadata.items()})

    tok_src = Path(tokenizer_path) if tokenizer_path is not None else None
    if tok_src is not None and not tok_src.is_file():
        raise MemengineError(f"tokenizer file '{tok_src}' not found")
    files: dict[str, bytes | Path] = {}
    for name, content in (extra_files or {}).items():
        name = _safe_file_name(name)
        if name in (MODEL_FILE, CONFIG_FILE):
            raise MemengineError(f"extra file name {name!r} would overwrite the checkpoint itself")
        if isinstance(content, (bytes, bytearray)):
            files[name] = bytes(content)
        else:  # a path (str or Path) to copy
            src = Path(content)
            if not src.is_file():
                raise MemengineError(f"extra file '{src}' not found")
            files[name] = src

    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MemengineError(f"cannot create output directory '{out}' ({e.strerror or e})") from None
    write_safetensors(out / MODEL_FILE, payload, meta)
    try:
        config_json = dict(config.to_hf_dict())
        atomic_write_bytes(out / CONFIG_FILE, (json.dumps(config_json, indent=2, sort_keys=True) + "\n").encode())
        if tok_src is not None:
            dst = out / TOKENIZER_FILE
            if not (dst.exists() and dst.resolve() == tok_src.resolve()):
                atomic_write_bytes(dst, tok_src.read_bytes())
        for name, content in files.items():
            dst = out / name
            if isinstance(content, Path):
                if dst.exists() and dst.resolve() == content.resolve():
                    continue
                atomic_write_bytes(dst, _file_chunks(content))
            else:
                atomic_write_bytes(dst, content)
    except OSError as e:
        raise MemengineError(f"cannot write into '{out}' ({e.strerror or e})") from None
    return out


def _file_chunks(path: Path, size: int = 1 << 22):
    with open(path, "rb") as f:
        while chunk := f.read(size):
            yield chunk
