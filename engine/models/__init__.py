"""The architectures the engine runs, by `model_type` (config.json's key).

Built in: Mamba-1 and Falcon-Mamba (engine/models/mamba1), Mamba-2 (engine/models/mamba2), the
Mamba-2 + attention hybrids Granite 4.0-H (dense) and Bamba (engine/models/hybrid).  Another architecture is a
module that calls `register(MyArchitecture())` when imported (engine/models/base.py says
what it provides); the engine imports the modules named in MEMENGINE_MODELS (comma-separated
module names) and those of the `memengine.models` entry-point group the first time it looks
an architecture up, so a package or a test can add one without a line in the engine.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from memengine.engine.errors import MemengineError

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"  # named shapes (memengine.configs)

ENV_MODELS = "MEMENGINE_MODELS"
ENTRY_POINTS = "memengine.models"
# model_type -> the module that registers it (imported on first use)
BUILTIN = {"mamba": "memengine.engine.models.mamba1", "falcon_mamba": "memengine.engine.models.mamba1",
           "mamba2": "memengine.engine.models.mamba2",
           "granitemoehybrid": "memengine.engine.models.hybrid", "bamba": "memengine.engine.models.hybrid"}

_REGISTRY: dict = {}
_loaded = False


def register(arch) -> None:
    """Make `arch` (an engine.models.base.Architecture) the one for each of its model types."""
    for mt in arch.model_types:
        _REGISTRY[mt] = arch


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in sorted(set(BUILTIN.values())):
        importlib.import_module(module)
    for name in filter(None, (s.strip() for s in os.environ.get(ENV_MODELS, "").split(","))):
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise MemengineError(f"{ENV_MODELS}: cannot import the architecture module {name!r} ({e})") from None
    try:
        from importlib.metadata import entry_points

        for ep in entry_points(group=ENTRY_POINTS):
            ep.load()
    except Exception:  # pragma: no cover - a broken third-party entry point does not stop the engine
        pass


def model_types() -> tuple:
    """Every model_type an architecture is registered for."""
    _load()
    return tuple(_REGISTRY)


def architecture(model_type: str | None):
    """The architecture of a model_type (None: "mamba", what a config without the key means)."""
    _load()
    mt = "mamba" if model_type is None else model_type
    arch = _REGISTRY.get(mt)
    if arch is None:
        raise MemengineError(f"model type {mt!r} is not supported (supported: {', '.join(_REGISTRY)})")
    return arch


def of(cfg):
    """The architecture of a config."""
    return architecture(cfg.model_type)


def config_from_dict(d, source: str = "config", model_type: str | None = None):
    """A config from a config.json dict: the architecture its model_type (or `model_type`,
    when the dict states none) names parses it."""
    if not isinstance(d, dict):
        raise MemengineError(f"{source}: expected a JSON object, got {type(d).__name__}")
    mt = d.get("model_type", model_type)
    _load()
    if mt is not None and mt not in _REGISTRY:
        raise MemengineError(f"{source}: model_type {mt!r} is not supported (supported: "
                             f"{', '.join(map(repr, _REGISTRY))})")
    if mt is not None and "model_type" not in d:
        d = {**d, "model_type": mt}
    return architecture(mt).config_from_dict(d, source)


def available_configs() -> list[str]:
    """The named shapes `init` takes (configs/*.json, *.yaml)."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.json")) + sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))


def _read_config_file(path: Path) -> dict:
    from memengine.engine.io.inputs import read_config_data

    data = read_config_data(path, "config file")
    if not isinstance(data, dict):
        raise MemengineError(f"config file '{path}' must hold a JSON/YAML object")
    return data


def load_config(name_or_path: str | Path):
    """A named config from configs/ (tiny, small, mamba-130m, mamba-1.4b), a JSON/YAML file
    or a checkpoint directory: parsed by the architecture its model_type names."""
    s = str(name_or_path)
    p = Path(s)
    if p.exists():
        if p.is_dir():
            p = p / "config.json"
        return config_from_dict(_read_config_file(p), str(p))
    for ext in (".json", ".yaml", ".yml"):
        cand = CONFIGS_DIR / f"{s}{ext}"
        if "/" not in s and cand.is_file():
            return config_from_dict(_read_config_file(cand), str(cand))
    raise MemengineError(
        f"config '{s}' is neither a file nor a built-in config (built-in: {', '.join(available_configs())})")
