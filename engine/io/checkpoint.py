"""Checkpoints: a directory with model.safetensors + config.json (+ tokenizer.json), a shard
set (model.safetensors.index.json + the shards it lists, as transformers writes them), or a
bare .safetensors file (config from its `__metadata__["config"]`, else inferred from shapes).

Every tensor is decoded to float32 and checked against the architecture's tensor table (`Architecture.iter_shapes`): a missing,
unexpected or misshaped tensor, or a NaN/Inf weight, is a one-line `MemengineError` naming
the tensor. Writing is atomic per file (temp file in the target dir + os.replace).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from memengine.engine import models
from memengine.engine.errors import MemengineError
from memengine.engine.hostmem import check_fits
from memengine.engine.io.codec import encode, normalize_dtype
from memengine.engine.io.inputs import check_regular, loads_json, read_json
from memengine.engine.io.safetensors_io import (
    BF16Bits,
    F16Bits,
    SafetensorsHeader,
    read_header,
    read_safetensors,
    write_safetensors,
)
from memengine.engine.io.shards import (
    DEFAULT_MAX_SHARD_SIZE,
    INDEX_FILE,
    SHARD_NAME,
    parse_size,
    read_index,
    shard_file,
    split_shards,
)
from memengine.engine.io.staging import atomic_write_bytes

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")
TOKENIZER_FILE = "tokenizer.json"
OPTIMIZER_FILE = "optimizer.safetensors"
CONFIG_METADATA_KEY = "config"


@dataclass
class Checkpoint:
    config: object  # the architecture's config (engine.models.of(config) is its architecture)
    tensors: dict[str, np.ndarray]  # float32, canonical HF names, model order
    dtypes: dict[str, str]  # source dtype per tensor ("F32", "F16", "BF16", "F64")
    path: Path  # the checkpoint dir (or the bare file)
    tokenizer_path: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # "optimizer_path", "metadata", "model_file", "weight_files"
    warnings: list[str] = field(default_factory=list)  # assumptions the caller should show the user
    shapes: dict[str, tuple] = field(default_factory=dict)  # the tensors' shapes, model order

    @property
    def directory(self) -> Path:
        return self.path if self.path.is_dir() else self.path.parent

    @property
    def n_params(self) -> int:
        return int(sum(math.prod(s) for s in self.shapes.values()))


# ------------------------------------------------------------------------ inference
def infer_config(tensors: dict[str, tuple], model_type: str | None = None):
    """A config from tensor name -> shape alone (a bare file): the architecture of
    `model_type` (default mamba) reads the shapes."""
    return models.architecture(model_type).infer_config(tensors)


# -------------------------------------------------------------------------- checks
def _layer_pattern(arch):
    return re.compile(re.escape(arch.LAYER_PREFIX) + r"(\d{1,9})\.")  # a longer index is no layer of a loadable model


def _layer_ids(arch, names) -> set[int]:
    pat = _layer_pattern(arch)
    return {int(m.group(1)) for k in names if (m := pat.match(k))}


def _canonicalize(arch, tensors: dict[str, Any], where: str) -> dict[str, Any]:
    """Tensor names as the architecture names them (`Architecture.ALIASES`)."""
    out: dict[str, Any] = {}
    for k, v in tensors.items():
        k2 = arch.ALIASES.get(k, k)
        if k2 in out:
            other = next(a for a, b in arch.ALIASES.items() if b == k2)
            raise MemengineError(f"{where}: both '{other}' and '{k2}' present")
        out[k2] = v
    return out


def check_tensors(cfg, shapes: dict[str, tuple], where: str) -> None:
    """Keys and shapes against the architecture's tensor table for `cfg`: one-line error
    naming the first bad tensor.

    The expected tensors are walked one at a time, so a config that claims far more tensors
    than the file holds (10^9 layers) is refused at the first missing one."""
    arch = models.of(cfg)
    pat = _layer_pattern(arch)
    n_expected = 0
    for name, shape in arch.iter_shapes(cfg):
        n_expected += 1
        if name not in shapes:
            hint = ""
            m = pat.match(name)
            if m and int(m.group(1)) >= (held := len(_layer_ids(arch, shapes))):
                hint = (f" (the config has num_hidden_layers={cfg.num_hidden_layers:,} but the weights hold {held} "
                        "layer(s); fix num_hidden_layers in the config)")
            elif name == arch.HEAD:
                hint = " (config has tie_word_embeddings=false)"
            else:
                hint = arch.missing_hint(cfg, name)
            raise MemengineError(f"{where}: missing tensor '{name}' (expected shape {list(shape)}){hint}")
        if tuple(shapes[name]) != tuple(shape):
            refusal = arch.shape_refusal(cfg, name, tuple(shapes[name]))
            if refusal:
                raise MemengineError(f"{where}: {refusal}")
            raise MemengineError(
                f"{where}: tensor '{name}' has shape {list(shapes[name])}, expected {list(shape)} for this config")
    if len(shapes) != n_expected:  # every expected name is in shapes, so this dict is no larger than the file
        exp = arch.shapes(cfg)
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


def _drop_tied_head(cfg, tensors: dict[str, Any], where: str) -> None:
    arch = models.of(cfg)
    if cfg.tie_word_embeddings and arch.HEAD in tensors and arch.EMBEDDINGS in tensors:
        head, emb = tensors[arch.HEAD], tensors[arch.EMBEDDINGS]
        if np.shape(head) == np.shape(emb) and np.array_equal(np.asarray(head), np.asarray(emb)):
            del tensors[arch.HEAD]
        else:
            raise MemengineError(
                f"{where}: config ties lm_head to the embeddings but tensor '{arch.HEAD}' differs from them; "
                "set tie_word_embeddings to false in config.json")


# --------------------------------------------------------------------------- loading
def _read_json_config(path: Path, model_type: str | None) -> tuple[object, str | None]:
    """(config, the model_type it states or None); a config that states none is read as
    `model_type`'s (default mamba)."""
    d = read_json(path, "config file")
    cfg = models.config_from_dict(d, str(path), model_type)
    return cfg, d.get("model_type") if isinstance(d, dict) else None


def _present(path: Path, what: str) -> bool:
    """True for a regular file, False when nothing is there; anything else (a FIFO, a device,
    a directory) is refused rather than skipped or read."""
    if not os.path.lexists(path):
        return False
    check_regular(path, what)
    return True


def _sharded_headers(index: Path) -> list[SafetensorsHeader]:
    """Headers of every shard an index lists; every tensor must sit in exactly the shard the
    index names, and every shard's tensors must be listed."""
    wm = read_index(index)
    shards = list(dict.fromkeys(wm.values()))
    headers = []
    for shard in shards:
        f = shard_file(index, shard)
        if not _present(f, "shard"):
            raise MemengineError(f"{index}: shard '{shard}' is missing from {index.parent}")
        hdr = read_header(f)
        for name in hdr.tensors:
            if name not in wm:
                raise MemengineError(f"{f}: tensor '{name}' is not listed in {index.name}")
            if wm[name] != shard:
                raise MemengineError(f"{f}: tensor '{name}' is listed in {index.name} under shard '{wm[name]}'")
        headers.append(hdr)
    for name, shard in wm.items():
        hdr = headers[shards.index(shard)]
        if name not in hdr.tensors:
            raise MemengineError(f"{index}: tensor '{name}' is not in its shard '{shard}'")
    return headers


def _locate(p: Path) -> tuple[Path, Path | None, Path]:
    """(the weight file, or the index of a shard set; config.json or None; the checkpoint dir)."""
    if p.is_dir():
        cfg_file = p / CONFIG_FILE
        if _present(p / MODEL_FILE, "model file"):  # as transformers: a single file wins over an index
            weights = p / MODEL_FILE
        elif _present(p / INDEX_FILE, "shard index"):
            weights = p / INDEX_FILE
        else:
            cands = [c for c in sorted(p.glob("*.safetensors")) if c.name != OPTIMIZER_FILE]
            if len(cands) != 1:
                raise MemengineError(f"{p}: no {MODEL_FILE} (or {INDEX_FILE}) in the checkpoint directory")
            weights = cands[0]
        if not _present(cfg_file, "config file"):
            raise MemengineError(f"{p}: no {CONFIG_FILE} in the checkpoint directory")
        return weights, cfg_file, p
    d = p.parent
    cfg_file = d / CONFIG_FILE if _present(d / CONFIG_FILE, "config file") else None
    if p.name.endswith(".index.json"):
        return p, cfg_file, d
    if p.name != MODEL_FILE and _present(d / INDEX_FILE, "shard index"):
        try:
            listed = p.name in read_index(d / INDEX_FILE).values()
        except MemengineError:
            listed = False
        if listed:
            raise MemengineError(f"{p}: is one shard of the sharded checkpoint in {d} ({INDEX_FILE}); "
                                 f"give the directory instead")
    return p, (cfg_file if p.name == MODEL_FILE else None), d


def load_checkpoint(path: str | Path, *, model_type: str | None = None, read_tensors: bool = True,
                    headers: list[SafetensorsHeader] | None = None) -> Checkpoint:
    """Load a checkpoint directory, a bare .safetensors file or a shard set (see module doc).

    `model_type` ("mamba" | "falcon_mamba") settles a checkpoint whose config does not state
    one (a bare file, an original mamba_ssm config.json); a config that states another is an
    error. When neither says, mamba is assumed and `Checkpoint.warnings` says so.
    `read_tensors=False` reads the config and the safetensors headers only (`tensors` stays
    empty; names, shapes and dtypes are checked as for a load): what `memengine info` shows,
    in a moment and without the host memory the weights would take.
    `headers` (with read_tensors=False): the weight files' headers as read elsewhere (a model
    id's, from the Hub, `resolve.remote_headers`); `path` is then the directory holding the
    rest of the checkpoint (config, tokenizer) and no weight file is looked for there.
    """
    p = Path(path)
    if model_type is not None:
        models.architecture(model_type)  # refused at once when no architecture has it
    if not p.exists():
        raise MemengineError(f"checkpoint '{p}' not found")
    weights, cfg_file, directory, headers = _weight_headers(p, headers, read_tensors)
    where = str(weights)
    cfg, warnings = _config(cfg_file, headers, where, model_type)
    for h in headers:
        for name, info in h.tensors.items():
            if info.dtype not in ("F32", "F16", "BF16", "F64"):
                raise MemengineError(
                    f"{h.path}: tensor '{name}' has dtype {info.dtype}; model weights must be F32, F16 or BF16")
    arch = models.of(cfg)
    shapes = _canonicalize(arch, {k: v.shape for h in headers for k, v in h.tensors.items()}, where)
    if cfg.tie_word_embeddings and arch.HEAD in shapes:
        shapes.pop(arch.HEAD)  # decided after decoding (identical -> dropped)
    check_tensors(cfg, shapes, where)
    tok = directory / TOKENIZER_FILE
    tok = tok if _present(tok, "tokenizer file") else None
    extra: dict[str, Any] = {"metadata": dict(headers[0].metadata), "model_file": weights,
                             "weight_files": [h.path for h in headers]}
    if _present(directory / OPTIMIZER_FILE, "optimizer state"):
        extra["optimizer_path"] = directory / OPTIMIZER_FILE
    ordered_shapes = {name: tuple(shapes[name]) for name in arch.shapes(cfg)}
    if not read_tensors:
        dtypes = _canonicalize(arch, {k: v.dtype for h in headers for k, v in h.tensors.items()}, where)
        return Checkpoint(config=cfg, tensors={}, dtypes={k: dtypes[k] for k in ordered_shapes}, path=p,
                          tokenizer_path=tok, extra=extra, warnings=warnings, shapes=ordered_shapes)
    ordered, dtypes = _decode(cfg, headers, where)
    return Checkpoint(config=cfg, tensors=ordered, dtypes=dtypes, path=p, tokenizer_path=tok, extra=extra,
                      warnings=warnings, shapes={k: tuple(a.shape) for k, a in ordered.items()})


def _weight_headers(p: Path, headers, read_tensors: bool) -> tuple:
    """(the weights' file, config.json or None, the checkpoint's directory, the weight
    files' headers): `headers` given (a model id's, read elsewhere) or read from `p`."""
    if headers is not None:
        assert not read_tensors and headers, "remote headers describe the weights; they hold none"
        weights = headers[0].path if len(headers) == 1 else p / INDEX_FILE
        cfg_file = p / CONFIG_FILE if _present(p / CONFIG_FILE, "config file") else None
        return weights, cfg_file, p, headers
    weights, cfg_file, directory = _locate(p)
    headers = _sharded_headers(weights) if weights.name.endswith(".index.json") else [read_header(weights)]
    return weights, cfg_file, directory, headers


def _config(cfg_file, headers, where: str, model_type: str | None) -> tuple:
    """(config, warnings): from config.json, else the weights' metadata, else the tensor
    shapes; the model type settled (`model_type` where none is stated)."""
    stated: str | None = None
    if cfg_file is not None:
        cfg, stated = _read_json_config(cfg_file, model_type)
        cfg_where = str(cfg_file)
    else:
        meta_hdr = next((h for h in headers if CONFIG_METADATA_KEY in h.metadata), None)
        if meta_hdr is not None:
            cfg_where = f"{meta_hdr.path} __metadata__ config"
            d = loads_json(meta_hdr.metadata[CONFIG_METADATA_KEY], f"{meta_hdr.path}: __metadata__ 'config'")
            cfg = models.config_from_dict(d, cfg_where, model_type)
            stated = d.get("model_type") if isinstance(d, dict) else None
        else:
            cfg_where = f"{where} (no config; shape inferred from the tensors)"
            cfg = infer_config({k: v.shape for h in headers for k, v in h.tensors.items()}, model_type)
    warnings: list[str] = []
    if stated is not None and model_type is not None and stated != model_type:
        raise MemengineError(f"model type {model_type!r} was asked for, but {cfg_where} says {stated!r}")
    if stated is None:
        cfg.model_type = model_type or "mamba"
        if model_type is None:
            warnings.append(
                f"{cfg_where} does not state the model type; assuming mamba (falcon_mamba has the same "
                "tensors: use --model-type falcon_mamba for one)")
    return cfg, warnings


def _decode(cfg, headers, where: str) -> tuple[dict, dict]:
    """Every tensor decoded to float32, in model order, checked finite; and its source dtype."""
    check_fits(host_bytes([t for h in headers for t in h.tensors.values()]),
               f"{where}: decoding the weights to float32 (memengine computes in float32)",
               "use a machine with more memory")
    arch = models.of(cfg)
    raw: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    for h in headers:
        t, dt, _ = read_safetensors(h.path)
        raw.update(t)
        dtypes.update(dt)
    tensors = _canonicalize(arch, raw, where)
    dtypes = _canonicalize(arch, dtypes, where)
    _drop_tied_head(cfg, tensors, where)
    ordered = {name: tensors[name] for name in arch.shapes(cfg)}
    for name, a in ordered.items():
        _check_finite(name, a, where)
    return ordered, {k: dtypes[k] for k in ordered}


def host_bytes(infos) -> int:
    """Host memory `load_checkpoint` needs at its peak for tensors `infos` (TensorInfo):
    every tensor decoded to float32, plus the raw bytes and a copy of the largest in flight."""
    from memengine.engine.io.safetensors_io import DTYPES

    numel = [math.prod(t.shape) for t in infos]
    largest = max((n * max(4, DTYPES[t.dtype][1]) for n, t in zip(numel, infos)), default=0)
    return 4 * sum(numel) + 2 * largest


def side_files(checkpoint_dir: Path | None, tokenizer_dir: Path | None) -> dict[str, Path]:
    """The files that travel with the weights into an output: generation_config.json from the
    checkpoint's directory, and the tokenizer's config files (tokenizer_config.json,
    special_tokens_map.json) from the directory of the tokenizer.json used (none for the
    byte-level tokenizer)."""
    out: dict[str, Path] = {}
    for d, names in ((checkpoint_dir, (GENERATION_CONFIG_FILE,)), (tokenizer_dir, TOKENIZER_SIDE_FILES)):
        for name in names if d is not None else ():
            if _present(Path(d) / name, "side file"):
                out[name] = Path(d) / name
    return out


# --------------------------------------------------------------------------- saving
def _safe_file_name(name: str) -> str:
    if not name or "/" in name or "\\" in name or name in (".", "..") or name.startswith("."):
        raise MemengineError(f"extra file name {name!r} must be a plain file name")
    return name


def save_checkpoint(out_dir: str | Path, config, tensors: dict[str, np.ndarray], *,
                    dtype: str = "F32", tokenizer_path: str | Path | None = None,
                    extra_files: dict[str, bytes | Path] | None = None,
                    metadata: dict[str, str] | None = None,
                    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Write the weights (+ config.json, tokenizer.json, extra files) into `out_dir`.

    `tensors` are float32 arrays (canonical names; a tied lm_head equal to the embeddings is
    dropped). `dtype` is "F32", "F16" or "BF16" (f16/bf16 round to nearest even; a value
    beyond the range is an error naming the tensor). NaN/Inf weights are refused. Weights
    larger than `max_shard_size` (bytes, or "5GB"-style as transformers takes it) are written
    as transformers shards them: model-00001-of-0000N.safetensors + model.safetensors.index.json;
    else one model.safetensors. Every file is written atomically (the index last), and weight
    files of an earlier save that the new one does not use are removed. Returns the directory.
    """
    out = Path(out_dir)
    dt = normalize_dtype(dtype, flag="dtype")
    limit = parse_size(max_shard_size)
    if out.exists() and not out.is_dir():
        raise MemengineError(f"output '{out}' exists and is not a directory")
    where = f"saving to {out}"
    tensors = _canonicalize(models.of(config), dict(tensors), where)
    _drop_tied_head(config, tensors, where)
    check_tensors(config, {k: np.shape(v) for k, v in tensors.items()}, where)
    config.validate()
    payload = _encoded(config, tensors, dt, where)
    meta = {"format": "pt", CONFIG_METADATA_KEY: json.dumps(config.to_hf_dict(), sort_keys=True)}
    if metadata:
        meta.update({str(k): str(v) for k, v in metadata.items()})
    tok_src = Path(tokenizer_path) if tokenizer_path is not None else None
    if tok_src is not None and not tok_src.is_file():
        raise MemengineError(f"tokenizer file '{tok_src}' not found")
    files = _extra_files(extra_files)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MemengineError(f"cannot create output directory '{out}' ({e.strerror or e})") from None
    stale = _write_weights(out, payload, meta, limit, tensors)
    try:
        for f in stale:
            if f.is_file():
                f.unlink()
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


def _encoded(config, tensors: dict, dt: str, where: str) -> dict:
    """Every tensor in model order as written: float32, or f16/bf16 bits."""
    payload: dict[str, Any] = {}
    for name in models.of(config).shapes(config):
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
    return payload


def _extra_files(extra_files: dict | None) -> dict:
    """Side files by name: bytes, or a path to copy (names that are the checkpoint's own refused)."""
    files: dict[str, bytes | Path] = {}
    for name, content in (extra_files or {}).items():
        name = _safe_file_name(name)
        if name in (MODEL_FILE, CONFIG_FILE, INDEX_FILE) or SHARD_NAME.fullmatch(name):
            raise MemengineError(f"extra file name {name!r} would overwrite the checkpoint itself")
        if isinstance(content, (bytes, bytearray)):
            files[name] = bytes(content)
        else:  # a path (str or Path) to copy
            src = Path(content)
            if not src.is_file():
                raise MemengineError(f"extra file '{src}' not found")
            files[name] = src
    return files


def _write_weights(out: Path, payload: dict, meta: dict, limit: int, tensors: dict) -> list:
    """One model.safetensors, or the shards and their index (written last); returns the
    weight files of an earlier save that this one does not use."""
    shards, total_size = split_shards(payload, limit, lambda v: getattr(v, "bits", v).nbytes)
    if len(shards) == 1:
        write_safetensors(out / MODEL_FILE, payload, meta)
        return [out / INDEX_FILE, *(f for f in out.iterdir() if SHARD_NAME.fullmatch(f.name))]
    for fname, names in shards.items():
        write_safetensors(out / fname, {n: payload[n] for n in names}, meta)
    index = {"metadata": {"total_parameters": int(sum(np.asarray(tensors[n]).size for n in payload)),
                          "total_size": total_size},
             "weight_map": {n: fname for fname, names in shards.items() for n in names}}
    atomic_write_bytes(out / INDEX_FILE, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
    return [out / MODEL_FILE, *(f for f in out.iterdir() if SHARD_NAME.fullmatch(f.name) and f.name not in shards)]


def _file_chunks(path: Path, size: int = 1 << 22):
    with open(path, "rb") as f:
        while chunk := f.read(size):
            yield chunk
