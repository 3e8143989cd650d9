"""LoRA adapters in PEFT's format, applied on the GPU without merging.

An adapter adds a low-rank product to some of each mixer's linear layers (PEFT's `Linear`):

    out = x W^T (+ b)  +  s * (drop(x) A^T) B^T          A [r, in], B [out, r]
    s = alpha / r   (alpha / sqrt(r) with use_rslora)      drop: dropout p, training only

on the targets in_proj and x_proj: the mixer's linear layers that transformers' Mamba calls
as modules.  PEFT refuses out_proj and conv1d for Mamba models, and transformers multiplies
by dt_proj.weight directly, so an adapter on dt_proj would have no effect there.

The base weights stay frozen: the backward computes activation gradients through the frozen
layers (the same kernels as full training, with the weight gradients skipped) and the
adapter's gradients from the same matmul kernels:

    t  = s * x A^T              (saved, [M, r])     dB += dout^T t
    dt = s * dout B                                  dA += dt^T x        dx += dt A

On disk an adapter is what `PeftModel.save_pretrained` writes:

    adapter_config.json         peft_type LORA, r, lora_alpha, lora_dropout, target_modules,
                                base_model_name_or_path, task_type CAUSAL_LM, bias none, ...
    adapter_model.safetensors   base_model.model.backbone.layers.{i}.mixer.{target}.lora_A.weight
                                [r, in] and .lora_B.weight [out, r]

Inside memengine the adapter's tensors (and their AdamW moments) are named without the
`base_model.model.` prefix.  Fresh adapters are initialised as PEFT does: lora_A
kaiming-uniform (a = sqrt 5, i.e. U(+-1/sqrt(in))) from the seed, lora_B zeros, so step 0
equals the base model.  `merge` folds an adapter into the base weights (W + s B A), as
PEFT's merge_and_unload.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
from memengine.engine.errors import MemengineError
from memengine.engine.models.store import FlatStore
from memengine.engine import models

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
# a layer's adapter matrix: <prefix>layers.<i>.<module path>.<target>.lora_<A|B>.weight, where
# the module path is the architecture's (`Architecture.lora_module`: Mamba "mixer", the
# hybrids' "mamba", "self_attn", "shared_mlp" / "feed_forward")
_NAME = re.compile(r"^(?:backbone|model)\.layers\.(\d+)\.(?:\w+\.)*?(\w+)\.lora_([AB])\.weight$")


def known_targets() -> tuple:
    """Every layer some registered architecture lets LoRA adapt, in the architectures' order."""
    out: list = []
    for mt in models.model_types():
        out += [t for t in models.architecture(mt).lora_targets if t not in out]
    return tuple(out)


def _refused(arch=None) -> dict:
    if arch is not None:
        return dict(arch.lora_refused)
    out: dict = {}
    for mt in models.model_types():
        out.update(models.architecture(mt).lora_refused)
    return {k: v for k, v in out.items() if k not in known_targets()}


def default_targets(arch) -> str:
    """--lora-targets when none is given: every layer the architecture lets LoRA adapt."""
    return ",".join(arch.lora_targets)


def parse_targets(value: str, arch=None) -> tuple:
    """'in_proj,x_proj' -> ('in_proj', 'x_proj') in canonical order; one line for a bad name.
    Against `arch`'s targets, or (before the model is known) any registered architecture's."""
    targets = tuple(arch.lora_targets) if arch is not None else known_targets()
    refused = _refused(arch)
    names = [t.strip() for t in str(value).split(",") if t.strip()]
    if not names:
        raise ValueError("names no layer (choose from " + ", ".join(targets) + ")")
    for t in names:
        if t in refused:
            raise ValueError(f"{t}: {refused[t]}; choose from {', '.join(targets)}")
        if t not in targets:
            raise ValueError(f"{t}: not a layer LoRA can adapt (choose from {', '.join(targets)})")
    return tuple(t for t in targets if t in names)


def dims(cfg, target: str) -> tuple[int, int]:
    """(in_features, out_features) of a target layer."""
    return models.of(cfg).lora_dims(cfg, target)


def tensor_name(layer: int, target: str, which: str, cfg=None) -> str:
    """An adapter matrix's name (memengine's: without PEFT's `base_model.model.`); the
    architecture of `cfg` places the target (default: Mamba's `backbone.layers.{i}.mixer.`)."""
    if cfg is None:
        return f"backbone.layers.{layer}.mixer.{target}.lora_{which}.weight"
    arch = models.of(cfg)
    return f"{arch.LAYER_PREFIX}{layer}.{arch.lora_module(cfg, layer, target)}.lora_{which}.weight"


def base_weight(name: str) -> str:
    """The base layer's weight an adapter matrix adapts: ...<target>.lora_A.weight -> ...<target>.weight."""
    return re.sub(r"\.lora_[AB]\.weight$", ".weight", name)


def other_half(name: str) -> str:
    """lora_A's name <-> lora_B's."""
    return re.sub(r"\.lora_([AB])\.weight$", lambda m: ".lora_" + ("B" if m.group(1) == "A" else "A") + ".weight",
                  name)


# --------------------------------------------------------------------------- the config
@dataclass
class LoraSpec:
    """What adapter_config.json says (the parts memengine computes with)."""

    r: int
    alpha: float
    dropout: float = 0.0
    targets: tuple = field(default_factory=known_targets)  # every registered architecture's
    base: Optional[str] = None          # base_model_name_or_path
    use_rslora: bool = False
    revision: Optional[str] = None
    layers: Optional[tuple] = None      # layers_to_transform (None: every layer)

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def to_peft(self) -> dict:
        alpha = int(self.alpha) if float(self.alpha).is_integer() else float(self.alpha)
        return {
            "alpha_pattern": {}, "auto_mapping": None, "base_model_name_or_path": self.base, "bias": "none",
            "exclude_modules": None, "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "layer_replication": None, "layers_pattern": None,
            "layers_to_transform": None if self.layers is None else list(self.layers), "loftq_config": {},
            "lora_alpha": alpha, "lora_bias": False, "lora_dropout": float(self.dropout),
            "megatron_config": None, "megatron_core": "megatron.core", "modules_to_save": None,
            "peft_type": "LORA", "r": int(self.r), "rank_pattern": {}, "revision": self.revision,
            "target_modules": list(self.targets), "task_type": "CAUSAL_LM", "use_dora": False,
            "use_rslora": bool(self.use_rslora),
        }

    @classmethod
    def from_peft(cls, d: dict, where: str) -> "LoraSpec":
        def bad(why: str) -> MemengineError:
            return MemengineError(f"{where}: {why}")

        if not isinstance(d, dict):
            raise bad("not a JSON object")
        if d.get("peft_type") != "LORA":
            raise bad(f"peft_type is {d.get('peft_type')!r}; memengine applies LORA adapters only")
        unsupported = [("use_dora", True), ("fan_in_fan_out", True), ("lora_bias", True)]
        for key, val in unsupported:
            if d.get(key) == val:
                raise bad(f"{key} is {str(val).lower()}; memengine applies plain LoRA only")
        if d.get("bias", "none") != "none":
            raise bad(f"bias is {d.get('bias')!r}; memengine applies adapters with bias 'none' only")
        for key in ("rank_pattern", "alpha_pattern"):
            if d.get(key):
                raise bad(f"{key} is set; memengine applies one rank and alpha to every layer")
        for key in ("modules_to_save", "layer_replication", "trainable_token_indices"):
            if d.get(key):
                raise bad(f"{key} is set; memengine applies LoRA matrices only")
        r, alpha = d.get("r"), d.get("lora_alpha")
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise bad(f"r is {r!r}, expected a positive integer")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            raise bad(f"lora_alpha is {alpha!r}, expected a number")
        if not 0 < abs(alpha) <= 1e6:
            raise bad(f"lora_alpha is {alpha!r}, expected a magnitude in (0, 1e6] (alpha / r scales the update)")
        p = d.get("lora_dropout", 0.0) or 0.0
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
            raise bad(f"lora_dropout is {p!r}, expected a number in [0, 1)")
        base = d.get("base_model_name_or_path")
        layers = d.get("layers_to_transform")
        if isinstance(layers, int) and not isinstance(layers, bool):
            layers = [layers]
        if layers is not None and not (isinstance(layers, list) and all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)):
            raise bad(f"layers_to_transform is {layers!r}, expected layer numbers")
        return cls(r=r, alpha=float(alpha), dropout=float(p), targets=(), base=base if isinstance(base, str) else None,
                   use_rslora=bool(d.get("use_rslora", False)),
                   revision=d.get("revision") if isinstance(d.get("revision"), str) else None,
                   layers=None if layers is None else tuple(sorted(set(layers))))


def shapes(cfg, spec: LoraSpec, layers: Optional[list] = None) -> dict:
    """name -> shape of every adapter tensor, layer by layer, A before B."""
    out = {}
    arch = models.of(cfg)
    for i in (range(cfg.num_hidden_layers) if layers is None else layers):
        for t in spec.targets:
            if t not in arch.lora_targets or arch.lora_module(cfg, i, t) is None:
                # another architecture's target, or a layer without that module (a hybrid's other kind)
                continue
            fan_in, fan_out = dims(cfg, t)
            out[tensor_name(i, t, "A", cfg)] = (spec.r, fan_in)
            out[tensor_name(i, t, "B", cfg)] = (fan_out, spec.r)
    return out


def init_tensors(cfg, spec: LoraSpec, seed: int) -> dict:
    """A fresh adapter as PEFT initialises one: lora_A U(+-1/sqrt(in)) (kaiming-uniform with
    a = sqrt 5) from `seed`, lora_B zeros."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in shapes(cfg, spec).items():
        if name.endswith("lora_A.weight"):
            bound = 1.0 / math.sqrt(shape[1])
            out[name] = rng.uniform(-bound, bound, size=shape).astype(np.float32)
        else:
            out[name] = np.zeros(shape, np.float32)
    return out


# --------------------------------------------------------------------------- files
def is_adapter(path) -> bool:
    """A directory holding adapter_config.json (a path, or a CheckpointRef's spec)."""
    if path is None:
        return False
    p = Path(str(path))
    return p.is_dir() and (p / ADAPTER_CONFIG).is_file()


@dataclass
class Adapter:
    """An adapter read from disk (tensors float32, memengine names)."""

    spec: LoraSpec
    tensors: dict
    path: Path

    @property
    def layers(self) -> list:
        return sorted({int(_NAME.match(n).group(1)) for n in self.tensors})


def read_adapter(path) -> Adapter:
    """adapter_config.json + adapter_model.safetensors of `path`; any problem is one line."""
    from memengine.engine.io.inputs import read_json
    from memengine.engine.io.safetensors_io import read_safetensors

    p = Path(path)
    cfg_file, weights = p / ADAPTER_CONFIG, p / ADAPTER_WEIGHTS
    if not cfg_file.is_file():
        raise MemengineError(f"{p}: no {ADAPTER_CONFIG} (not a PEFT adapter)")
    spec = LoraSpec.from_peft(read_json(cfg_file, "adapter config"), str(cfg_file))
    if not weights.is_file():
        if (p / "adapter_model.bin").is_file():
            raise MemengineError(f"{p}: the adapter is adapter_model.bin (pickle); memengine reads "
                                 f"{ADAPTER_WEIGHTS} only")
        raise MemengineError(f"{p}: no {ADAPTER_WEIGHTS}")
    raw, _, _ = read_safetensors(weights)
    targets_known, refused = known_targets(), _refused()
    tensors, targets = {}, set()
    for key, a in raw.items():
        name = key[len(PREFIX):] if key.startswith(PREFIX) else key
        m = _NAME.match(name)
        if m is not None and m.group(2) in refused:
            raise MemengineError(f"{weights}: tensor '{key}': {refused[m.group(2)]} (memengine applies LoRA "
                                 f"on {', '.join(targets_known)})")
        if m is None or m.group(2) not in targets_known:
            raise MemengineError(f"{weights}: tensor '{key}' is not a LoRA matrix of "
                                 f"{', '.join(targets_known)} (base_model.model.backbone.layers.N.mixer.<layer>."
                                 "lora_A.weight / lora_B.weight, or the hybrids' model.layers.N.<module>.<layer>...)")
        if a.dtype.kind != "f" or a.ndim != 2:
            raise MemengineError(f"{weights}: tensor '{key}' is not a floating matrix")
        if not np.isfinite(a).all():
            raise MemengineError(f"{weights}: tensor '{key}' holds NaN/Inf")
        tensors[name] = np.ascontiguousarray(a, np.float32)
        targets.add(m.group(2))
    if not tensors:
        raise MemengineError(f"{weights}: no LoRA tensors")
    spec.targets = tuple(t for t in targets_known if t in targets)
    return Adapter(spec, tensors, p)


def describe(path) -> dict:
    """What `memengine info` shows of an adapter directory."""
    ad = read_adapter(path)
    s = ad.spec
    return {"path": str(path), "peft_type": "LORA", "r": s.r, "lora_alpha": s.alpha, "scaling": s.scaling,
            "lora_dropout": s.dropout, "use_rslora": s.use_rslora, "target_modules": list(s.targets),
            "layers": len(ad.layers), "tensors": len(ad.tensors),
            "parameters": int(sum(a.size for a in ad.tensors.values())), "base_model_name_or_path": s.base}


def check_against(adapter: Adapter, cfg, where: str) -> None:
    """Every tensor fits the base model's shapes; A and B come in pairs of rank r."""
    r = adapter.spec.r
    for name, a in adapter.tensors.items():
        m = _NAME.match(name)
        i, t, which = int(m.group(1)), m.group(2), m.group(3)
        if i >= cfg.num_hidden_layers:
            raise MemengineError(f"{where}: tensor '{PREFIX + name}' is for layer {i}; the base model has "
                                 f"{cfg.num_hidden_layers} (the adapter belongs to another model)")
        arch = models.of(cfg)
        if t not in arch.lora_targets:
            why = arch.lora_refused.get(t, f"not a layer LoRA can adapt in {cfg.model_type} models")
            raise MemengineError(f"{where}: tensor '{PREFIX + name}': {why} (choose from "
                                 f"{', '.join(arch.lora_targets)})")
        module = arch.lora_module(cfg, i, t)
        if module is None or name != tensor_name(i, t, which, cfg):
            raise MemengineError(f"{where}: tensor '{PREFIX + name}' names no layer of this base model (layer {i} "
                                 f"has {'no ' + t if module is None else tensor_name(i, t, which, cfg)}; the adapter "
                                 "belongs to another model)")
        fan_in, fan_out = dims(cfg, t)
        want = (r, fan_in) if which == "A" else (fan_out, r)
        if tuple(a.shape) != want:
            raise MemengineError(f"{where}: tensor '{PREFIX + name}' has shape {list(a.shape)}, expected "
                                 f"{list(want)} for r={r} on this base model (the adapter belongs to another model)")
        other = other_half(name)
        if other not in adapter.tensors:
            raise MemengineError(f"{where}: tensor '{PREFIX + name}' has no '{PREFIX + other}'")


def write_adapter(directory, spec: LoraSpec, tensors: dict) -> None:
    """adapter_config.json and adapter_model.safetensors (PEFT's names) into `directory`."""
    from memengine.engine.io.safetensors_io import atomic_write_bytes, write_safetensors

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    payload = {PREFIX + n: np.ascontiguousarray(a, np.float32) for n, a in tensors.items()}
    write_safetensors(d / ADAPTER_WEIGHTS, payload, {"format": "pt"})
    present = {_NAME.match(n).group(2) for n in tensors if _NAME.match(n)}
    if present:   # target_modules: the layers adapted (a spec's default names every architecture's)
        spec = LoraSpec(**{**spec.__dict__, "targets": tuple(t for t in spec.targets if t in present)})
    atomic_write_bytes(d / ADAPTER_CONFIG, (json.dumps(spec.to_peft(), indent=2, sort_keys=True) + "\n").encode())


# --------------------------------------------------------------------------- the base
def base_spec(adapter_dir: Path, spec: LoraSpec, override: Optional[str] = None) -> str:
    """What to load as the adapter's base: --base, else base_model_name_or_path when it is a
    local path (from here) or looks like a model id, else the base path a memengine run kept
    relative to the adapter (trainer_state.json)."""
    if override is not None:
        return str(override)
    kept = _kept_base(adapter_dir)
    given = spec.base
    if given and Path(given).exists():
        return given
    if kept is not None and Path(kept).exists():
        return kept
    if given:
        return given
    raise MemengineError(f"{adapter_dir}: {ADAPTER_CONFIG} names no base model (base_model_name_or_path); "
                         "give one with --base")


def _kept_base(adapter_dir: Path) -> Optional[str]:
    from memengine.engine.io.inputs import read_json

    f = Path(adapter_dir) / "trainer_state.json"
    if not f.is_file():
        return None
    try:
        rel = read_json(f, "trainer state")["extra"]["lora"]["base_relative"]
    except (KeyError, TypeError):
        return None
    return str((Path(adapter_dir) / rel)) if isinstance(rel, str) else None


@dataclass
class Opened:
    """A CKPT opened for a run: the base checkpoint, and the adapter when CKPT was one."""

    ckpt: object                     # checkpoint.Checkpoint of the base
    ref: object                      # resolve.CheckpointRef of the base
    adapter: Optional[Adapter] = None
    warnings: list = field(default_factory=list)


def open_source(spec, *, revision=None, model_type=None, base=None,
                warn: Optional[Callable[[str], None]] = None, on_task: Optional[Callable] = None) -> Opened:
    """CKPT as a run reads it: a checkpoint, or an adapter directory (its base, from --base
    or the adapter's config, loaded and checked against it); the read is a task for
    `on_task` (engine/listener.py)."""
    from memengine.engine.app.setup import open_checkpoint
    from memengine.engine.io.resolve import resolve_checkpoint

    if base is not None and not is_adapter(spec):
        raise MemengineError(f"--base {base}: {spec} is not a LoRA adapter directory (no {ADAPTER_CONFIG}); "
                             "--base names the model an adapter applies to")
    if is_adapter(spec):
        spec = str(spec)
        ad = read_adapter(spec)
        ref = resolve_checkpoint(base_spec(Path(spec), ad.spec, base), revision if base else ad.spec.revision,
                                 model_type)
        ckpt = open_checkpoint(ref, warn, on_task=on_task)
        check_against(ad, ckpt.config, str(Path(spec) / ADAPTER_WEIGHTS))
        return Opened(ckpt, ref, ad)
    ref = resolve_checkpoint(spec, revision, model_type)
    return Opened(open_checkpoint(ref, warn, on_task=on_task), ref)


def adapter_tokenizer(adapter: Optional[Adapter], override: Optional[str]) -> Optional[str]:
    """The tokenizer an adapter run uses: --tokenizer, else the one saved with the adapter."""
    if override is not None or adapter is None:
        return override
    tok = adapter.path / "tokenizer.json"
    return str(tok) if tok.is_file() else None


# --------------------------------------------------------------------------- runs
@dataclass
class RunLora:
    """The adapter of a train/adapt run: trained (a LoRA run) or applied frozen (adapt)."""

    spec: LoraSpec
    tensors: dict
    train: bool
    source: Optional[Adapter] = None    # the adapter the run started from

    def options(self) -> dict:
        """The effective --lora-* values of a LoRA run (what its record and a resume carry:
        the rank, alpha and targets of an adapter it continues, the defaults filled in)."""
        if not self.train:
            return {}
        s = self.spec
        return {"lora_rank": s.r, "lora_alpha": s.alpha, "lora_dropout": s.dropout,
                "lora_targets": ",".join(s.targets)}


def check_rank(r: int, cfg, targets) -> None:
    """A rank above every adapted layer's own (min(in, out): the most an update B A of that
    layer can have) is refused before anything is allocated: it adds parameters and memory,
    nothing the layer can use."""
    arch = models.of(cfg)
    full = {t: min(arch.lora_dims(cfg, t)) for t in targets}
    most = max(full.values())
    if r > most:
        which = ", ".join(f"{t} {v}" for t, v in full.items())
        raise MemengineError(f"--lora-rank {r}: above the rank of every adapted layer (min(in, out): {which}); "
                             f"a rank of at most {most} is full rank here")


def _targets_for(value: str, cfg) -> tuple:
    """--lora-targets against the model's own architecture (the flag's first check knows every
    architecture's targets): one line naming the flag."""
    try:
        return parse_targets(value, models.of(cfg))
    except ValueError as e:
        raise MemengineError(f"--lora-targets {value}: {e} in {cfg.model_type} models") from None


def for_run(o, adapter: Optional[Adapter], cfg, base_name: str) -> Optional[RunLora]:
    """What adapter a run uses: `adapter` is CKPT's (or the resumed step's) when it was one.
    A LoRA run's effective rank, alpha, dropout and targets are the result's `options()`
    (the run record and a resume carry them); `o` is left as it is."""
    lora_from = None
    if getattr(o, "lora_from", None) is not None:
        if adapter is not None:
            raise MemengineError(f"--lora-from {o.lora_from}: CKPT is an adapter already; give the base as CKPT, "
                                 "or the adapter alone")
        if not is_adapter(o.lora_from):
            raise MemengineError(f"--lora-from {o.lora_from}: not a PEFT adapter directory (no {ADAPTER_CONFIG})")
        lora_from = read_adapter(o.lora_from)
        check_against(lora_from, cfg, f"--lora-from {o.lora_from}")
    src = adapter or lora_from
    if o.WSLA:
        return RunLora(src.spec, src.tensors, False, src) if src is not None else None
    if src is None and o.lora_rank is None:
        return None
    if not models.of(cfg).lora_targets:
        raise MemengineError(f"--lora-rank: LoRA adapters are not yet supported for {cfg.model_type} models "
                             "(train all weights, or adapt)")
    if src is not None:
        spec = LoraSpec(**{**src.spec.__dict__})
        targets = _targets_for(o.lora_targets, cfg) if o.lora_targets is not None else None
        for name, mine, theirs in (("lora_rank", o.lora_rank, spec.r), ("lora_alpha", o.lora_alpha, spec.alpha),
                                   ("lora_targets", targets, spec.targets)):
            if mine is not None and mine != theirs:
                shown = ",".join(theirs) if isinstance(theirs, tuple) else f"{theirs:g}"
                raise MemengineError(f"--{name.replace('_', '-')} {getattr(o, name)}: the adapter {src.path} has {shown}; "
                                     "a run that continues an adapter keeps its shape and scaling")
        if o.lora_dropout is not None:
            spec.dropout = float(o.lora_dropout)
        tensors = src.tensors
    else:
        targets = _targets_for(o.lora_targets or default_targets(models.of(cfg)), cfg)
        check_rank(int(o.lora_rank), cfg, targets)
        spec = LoraSpec(r=int(o.lora_rank), alpha=float(o.lora_alpha if o.lora_alpha is not None else o.lora_rank),
                        dropout=float(o.lora_dropout or 0.0), targets=targets)
        tensors = init_tensors(cfg, spec, o.seed)
    spec.base = base_name
    return RunLora(spec, tensors, True, src)


def write_run_adapter(directory, run: RunLora, tensors: dict, tokenizer: Optional[Path]) -> None:
    """A LoRA run's adapter files, with the tokenizer it used (and that tokenizer's config
    files) beside them, as PEFT users save one."""
    from memengine.engine.io.checkpoint import side_files
    from memengine.engine.io.safetensors_io import atomic_write_bytes

    write_adapter(directory, run.spec, tensors)
    if tokenizer is not None:
        atomic_write_bytes(Path(directory) / "tokenizer.json", Path(tokenizer).read_bytes())
        for name, src in side_files(None, Path(tokenizer).parent).items():
            atomic_write_bytes(Path(directory) / name, Path(src).read_bytes())


def plan_sizes(cfg, spec: LoraSpec, tensors: dict, *, train: bool) -> tuple[tuple, tuple]:
    """(element counts of the adapter's tensors, widths of the [M, width] buffers it
    allocates), for the memory plan (engine/plan.py): s x A^T per adapted layer and the dt
    scratch; with dropout while training, the dropped inputs and a gradient scratch per
    input width."""
    pairs = sorted({(int(_NAME.match(n).group(1)), _NAME.match(n).group(2)) for n in tensors})
    sizes = tuple(int(np.asarray(tensors[n]).size) for n in tensors)
    rows = [spec.r] * (len(pairs) + 1)
    if train and spec.dropout > 0:
        fan = [dims(cfg, t)[0] for _, t in pairs]
        rows += fan + sorted(set(fan))
    return sizes, tuple(rows)


# --------------------------------------------------------------------------- merge
def merged_tensors(base: dict, adapter: Adapter) -> dict:
    """The base tensors with W + s * B @ A folded into every adapted layer (float32, as PEFT's
    merge_and_unload on a float32 model)."""
    out = dict(base)
    s = np.float32(adapter.spec.scaling)
    for name in adapter.tensors:
        m = _NAME.match(name)
        if m.group(3) != "A":
            continue
        A, B = adapter.tensors[name], adapter.tensors[other_half(name)]
        w = base_weight(name)
        out[w] = (np.asarray(base[w], np.float32) + (B @ A) * s).astype(np.float32)
    return out


def base_dtype(ckpt) -> str:
    """The dtype a merged checkpoint is written in: the base's (the most common one)."""
    counts: dict = {}
    for dt in ckpt.dtypes.values():
        dt = "F32" if dt == "F64" else dt
        counts[dt] = counts.get(dt, 0) + 1
    return max(counts, key=counts.get) if counts else "F32"


@dataclass
class MergeReport:
    adapter: str
    base: str
    output: Path
    dtype: str
    merged: list                     # the weight names that changed
    r: int
    scaling: float


def merge(adapter_path, output, *, base: Optional[str] = None, revision: Optional[str] = None,
          model_type: Optional[str] = None, max_shard_size: str = "50GB", force: bool = False,
          warn: Optional[Callable[[str], None]] = None) -> MergeReport:
    """`memengine merge`: the base with the adapter folded in, written to `output` as a full
    checkpoint in the base's dtype (shards, tokenizer and side files as every output)."""
    from memengine.engine.app.records import version
    from memengine.engine.app.setup import open_tokenizer, tokenizer_file
    from memengine.engine.io import staging
    from memengine.engine.io.checkpoint import save_checkpoint, side_files

    if not is_adapter(adapter_path):
        raise MemengineError(f"{adapter_path}: not a PEFT adapter directory (no {ADAPTER_CONFIG})")
    op = open_source(adapter_path, revision=revision, model_type=model_type, base=base, warn=warn)
    staging.check_output(Path(output), force, inputs=(op.ref.path, Path(adapter_path)))
    tensors = merged_tensors(op.ckpt.tensors, op.adapter)
    tok = open_tokenizer(op.ckpt, adapter_tokenizer(op.adapter, None))
    tok_file = tokenizer_file(tok)
    dtype = base_dtype(op.ckpt)
    with staging.staged_output(Path(output), force) as tmp:
        save_checkpoint(tmp, op.ckpt.config, tensors, dtype=dtype, tokenizer_path=tok_file,
                        extra_files=side_files(op.ckpt.directory, tok_file.parent if tok_file else None),
                        metadata={"producer": f"memengine {version()}", "merged_adapter": Path(adapter_path).name},
                        max_shard_size=max_shard_size)
    changed = sorted({base_weight(n) for n in op.adapter.tensors})
    return MergeReport(str(adapter_path), op.ref.public_name, Path(output), dtype, changed, op.adapter.spec.r,
                       op.adapter.spec.scaling)


# --------------------------------------------------------------------------- on the GPU
class LoraWorkspace:
    """The adapter's activations for one (B, L): s * x A^T per adapted layer (and the
    dropped-out input when dropout is on)."""

    def __init__(self, lora: "LoraAdapter", M: int):
        rt = lora.rt
        self.t = {k: rt.empty((M, lora.spec.r), name=f"lora.t{k[0]}.{k[1]}") for k in lora.pairs}
        self.xd = ({k: rt.empty((M, lora.fan_in[k[1]]), name=f"lora.xd{k[0]}.{k[1]}") for k in lora.pairs}
                   if lora.spec.dropout > 0 else {})


class LoraAdapter:
    """An adapter's matrices (and, when trained, their gradients) on the GPU, applied by the
    model's forward and backward (LanguageModel.lora)."""

    def __init__(self, rt, cfg, spec: LoraSpec, tensors: dict, *, seed: int = 0, train: bool = False):
        self.rt, self.cfg, self.spec = rt, cfg, spec
        self.targets = tuple(models.of(cfg).lora_targets)
        self.shapes = {n: tuple(np.shape(a)) for n, a in tensors.items()}
        order = {n: k for k, n in enumerate(shapes(cfg, spec))}
        self.names = sorted(self.shapes, key=lambda n: order.get(n, len(order)))
        self.shapes = {n: self.shapes[n] for n in self.names}
        self.gpu_shapes = self.shapes
        self.pairs = sorted({(int(_NAME.match(n).group(1)), _NAME.match(n).group(2)) for n in self.names},
                            key=lambda k: (k[0], self.targets.index(k[1])))
        self._pair_set = set(self.pairs)
        self._names = {((int(_NAME.match(n).group(1)), _NAME.match(n).group(2)), _NAME.match(n).group(3)): n
                       for n in self.names}
        self.fan_in = {t: dims(cfg, t)[0] for t in self.targets}
        self.P = FlatStore(rt, self.shapes, "lora.params")
        self.G = FlatStore(rt, self.shapes, "lora.grads") if train else None
        self.train = train
        self.seed = int(seed)
        self.rng = rt.upload(np.array([self.seed & 0xFFFFFFFF, 0], np.uint32), name="lora.rng")
        self._ws: dict = {}
        self.load(tensors)

    @property
    def dropout_on(self) -> bool:
        return self.train and self.spec.dropout > 0

    def load(self, tensors: dict) -> None:
        self.P.write({n: tensors[n] for n in self.names})

    def state_dict(self) -> dict:
        return {n: a.reshape(self.shapes[n]) for n, a in self.P.read().items()}

    def grad_dict(self) -> dict:
        return {n: a.reshape(self.shapes[n]) for n, a in self.G.read().items()}

    def set_counter(self, counter: int) -> None:
        """The dropout mask's counter (one per micro-batch): written before its submission."""
        if self.dropout_on:
            self.rt.write(self.rng, np.array([self.seed & 0xFFFFFFFF, counter & 0xFFFFFFFF], np.uint32))

    def workspace(self, ws) -> LoraWorkspace:
        lw = self._ws.get(ws.M)
        if lw is None:
            lw = self._ws[ws.M] = LoraWorkspace(self, ws.M)
        return lw

    def _name(self, key, which: str) -> str:
        return self._names[(key, which)]

    def _salt(self, key) -> int:
        return key[0] * len(self.targets) + self.targets.index(key[1]) + 1

    def forward(self, rec, ws, layer: int, target: str, x, out, *, train: bool, ldx=None, x_col: int = 0,
                ldo=None, out_col: int = 0) -> None:
        """out[M, out] += s * (drop(x) A^T) B^T for this layer's adapted `target` (if any)."""
        from memengine.engine.kernels.lora import dropout, scale_
        from memengine.engine.kernels.matmul import linear_forward

        key = (layer, target)
        if key not in self._pair_set:
            return
        K, N = dims(self.cfg, target)
        r, M = self.spec.r, ws.M
        A, B = self.P.views[self._name(key, "A")], self.P.views[self._name(key, "B")]
        lw = self.workspace(ws)
        t = lw.t[key]
        if train and self.dropout_on:
            dropout(rec, lw.xd[key], x, self.rng, rows=M, cols=K, p=self.spec.dropout, salt=self._salt(key),
                    ld_x=ldx, x_col=x_col)
            x, ldx, x_col = lw.xd[key], None, 0
        linear_forward(rec, t, x, A, None, M=M, N=r, K=K, ldx=ldx, x_col=x_col)
        if self.spec.scaling != 1.0:
            scale_(rec, t, self.spec.scaling)
        linear_forward(rec, out, t, B, None, M=M, N=N, K=r, acc=True, ldo=ldo, out_col=out_col)

    def step(self, rec, layer: int, target: str, x, out) -> None:
        """Decoding, one token: out[out] += s * B (A x) for this layer's adapted `target`."""
        from memengine.engine.kernels.decode import matvec
        from memengine.engine.kernels.lora import scale_

        key = (layer, target)
        if key not in self._pair_set:
            return
        K, N = dims(self.cfg, target)
        r = self.spec.r
        t = self.rt.scratch(("lora.step", r), (r,))
        matvec(rec, t, self.P.views[self._name(key, "A")], x, rows=r, K=K)
        if self.spec.scaling != 1.0:
            scale_(rec, t, self.spec.scaling)
        matvec(rec, out, self.P.views[self._name(key, "B")], t, rows=N, K=r, acc=True)

    def backward(self, rec, ws, layer: int, target: str, dout, x, dx, *, ldx=None, x_col: int = 0,
                 lddx=None, dx_col: int = 0, lddo=None, dout_col: int = 0) -> None:
        """dx += the adapter's part of d(out)/dx; with training, dA and dB too (ACC)."""
        from memengine.engine.kernels.lora import dropout, scale_
        from memengine.engine.kernels.matmul import linear_backward

        key = (layer, target)
        if key not in self._pair_set:
            return
        K, N = dims(self.cfg, target)
        r, M = self.spec.r, ws.M
        nA, nB = self._name(key, "A"), self._name(key, "B")
        A, B = self.P.views[nA], self.P.views[nB]
        dA = self.G.views[nA] if self.train else None
        dB = self.G.views[nB] if self.train else None
        lw = self.workspace(ws)
        dt = self.rt.scratch(("lora.dt", M, r), (M, r))
        linear_backward(rec, dt, dB, None, dout, lw.t[key], B, M=M, N=N, K=r, lddo=lddo, dout_col=dout_col)
        if self.spec.scaling != 1.0:
            scale_(rec, dt, self.spec.scaling)
        if self.dropout_on:
            dxd = self.rt.scratch(("lora.dxd", M, K), (M, K))
            linear_backward(rec, dxd, dA, None, dt, lw.xd[key], A, M=M, N=r, K=K)
            dropout(rec, dx, dxd, self.rng, rows=M, cols=K, p=self.spec.dropout, salt=self._salt(key),
                    ld_out=lddx, out_col=dx_col, acc=True)
        else:
            linear_backward(rec, dx, dA, None, dt, x, A, M=M, N=r, K=K, ldx=ldx, x_col=x_col, lddx=lddx,
                            dx_col=dx_col, dx_acc=True)
