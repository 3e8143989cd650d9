"""Shard sets as transformers writes them: `model.safetensors.index.json` (`{"metadata":
{"total_parameters", "total_size"}, "weight_map": {tensor: shard}}`) beside the shards
`model-00001-of-0000N.safetensors`, split in model order when the weights exceed
`max_shard_size` (a tensor larger than the limit gets a shard of its own).

Light on purpose (no numpy): the command line imports the default and the size parser.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from memengine.engine.errors import MemengineError
from memengine.engine.io.inputs import read_json

INDEX_FILE = "model.safetensors.index.json"
SHARD_PATTERN = "model{suffix}.safetensors"  # huggingface_hub fills in -00001-of-00003
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# transformers' save_pretrained(max_shard_size=...) default (5.x); a test checks it against
# the installed transformers
DEFAULT_MAX_SHARD_SIZE = "50GB"
_SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}  # huggingface_hub's (decimal)


def parse_size(value: int | str, flag: str = "--max-shard-size") -> int:
    """Bytes from an int, a string of digits, or digits with a unit as transformers takes them
    ("5GB", "500MB", "1.5GB", "100KB"; units are powers of 10)."""
    if isinstance(value, bool):
        raise MemengineError(f"{flag} {value!r}: expected a size such as 5GB, 500MB or a number of bytes")
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]{2})?\s*", str(value))
        unit = m.group(2).upper() if m and m.group(2) else None
        if not m or (unit is not None and unit not in _SIZE_UNITS) or (unit is None and "." in m.group(1)):
            raise MemengineError(f"{flag} {value}: expected a size such as 5GB, 500MB or a number of bytes "
                                 "(units TB, GB, MB, KB)")
        n = int(float(m.group(1)) * _SIZE_UNITS[unit]) if unit else int(m.group(1))
    if n < 1:
        raise MemengineError(f"{flag} {value}: must be at least 1 byte")
    return n


def split_shards(payload: dict[str, Any], max_shard_size: int,
                 nbytes: Callable[[Any], int]) -> tuple[dict[str, list[str]], int]:
    """transformers' split (huggingface_hub's own function): shard file name -> tensor names
    (one entry, model.safetensors, when everything fits), and the total size in bytes."""
    from huggingface_hub import split_state_dict_into_shards_factory

    split = split_state_dict_into_shards_factory(payload, get_storage_size=lambda v: int(nbytes(v)),
                                                 filename_pattern=SHARD_PATTERN, max_shard_size=max_shard_size)
    return split.filename_to_tensors, int(split.metadata["total_size"])


def shard_file(index: Path, name: Any) -> Path:
    """A shard named in an index: a plain file name beside the index (no path escapes)."""
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name
            or "\0" in name or Path(name).is_absolute()):
        raise MemengineError(f"{index}: shard name {name!r} must be a plain file name beside the index")
    return index.parent / name


def read_index(index: Path) -> dict[str, str]:
    """weight_map of a model.safetensors.index.json, validated: tensor name -> shard file name."""
    d = read_json(index, "shard index")
    wm = d.get("weight_map") if isinstance(d, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise MemengineError(f"{index}: expected an object with a non-empty 'weight_map' (tensor name -> shard file)")
    if "metadata" in d and not isinstance(d["metadata"], dict):
        raise MemengineError(f"{index}: 'metadata' must be an object")
    for shard in wm.values():
        shard_file(index, shard)
    return dict(wm)
