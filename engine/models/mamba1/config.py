"""Model shape and hyper-parameters: the Hugging Face `MambaConfig` keys that matter.

`MambaConfig.from_dict` reads a HF `config.json` (unknown keys are ignored, known ones are
type- and range-checked); `to_hf_dict` writes one that `transformers.MambaConfig` loads.
`expected_shapes` lists every tensor of `MambaForCausalLM` (SPEC §3) in model order.

Two model types share these keys and tensor names: `mamba` and `falcon_mamba`
(`FalconMambaForCausalLM`: the same Mamba-1 block plus weightless RMS norms on dt_low, B and C
inside the mixer, epsilon `mixer_rms_eps`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

from memengine.engine.errors import MemengineError


# model_type -> the transformers class that loads it
MODEL_TYPES = {"mamba": "MambaForCausalLM", "falcon_mamba": "FalconMambaForCausalLM"}

MAX_VOCAB = 2**31 - 1  # token ids are i32 on the GPU and in the data pipeline

# Keys of the original `mamba_ssm` config.json (state-spaces/mamba-130m) -> HF names.
_LEGACY_KEYS = {"d_model": "hidden_size", "n_layer": "num_hidden_layers"}


@dataclass(eq=False)
class MambaConfig:
    vocab_size: int = 50280
    hidden_size: int = 768  # E
    state_size: int = 16  # N
    num_hidden_layers: int = 32
    expand: int = 2
    conv_kernel: int = 4  # K
    time_step_rank: int | str = "auto"  # R
    use_bias: bool = False
    use_conv_bias: bool = True
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = True
    initializer_range: float = 0.1
    rescale_prenorm_residual: bool = False
    time_step_scale: float = 1.0
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_init_scheme: str = "random"
    time_step_floor: float = 1e-4
    hidden_act: str = "silu"
    residual_in_fp32: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = 0
    eos_token_id: int | None = 0
    model_type: str = "mamba"  # or "falcon_mamba"
    mixer_rms_eps: float = 1e-6  # falcon_mamba only: eps of the dt/B/C norms

    def __post_init__(self) -> None:
        self.validate()

    def __eq__(self, other: object) -> bool:
        """Semantic equality: time_step_rank "auto" equals its resolved value."""
        if not isinstance(other, MambaConfig):
            return NotImplemented
        return self.to_hf_dict() == other.to_hf_dict()

    __hash__ = None  # mutable

    # -- derived sizes ---------------------------------------------------------------
    @property
    def intermediate_size(self) -> int:
        """Di = expand * E."""
        return int(self.expand * self.hidden_size)

    @property
    def is_falcon(self) -> bool:
        """falcon_mamba: dt_low, B and C pass a weightless RMS norm inside each mixer."""
        return self.model_type == "falcon_mamba"

    @property
    def dt_rank(self) -> int:
        """R; "auto" = ceil(E / 16)."""
        if self.time_step_rank == "auto":
            return math.ceil(self.hidden_size / 16)
        return int(self.time_step_rank)

    @property
    def n_tensors(self) -> int:
        """len(expected_shapes(self)), without building it."""
        per_layer = 9 + bool(self.use_conv_bias) + 2 * bool(self.use_bias)
        return 2 + self.num_hidden_layers * per_layer + (not self.tie_word_embeddings)

    @property
    def n_params(self) -> int:
        """Parameters of the model (the elements of every tensor), without building the shapes."""
        V, E, N, K = self.vocab_size, self.hidden_size, self.state_size, self.conv_kernel
        Di, R = self.intermediate_size, self.dt_rank
        layer = (E + 2 * Di * E + Di * K + (R + 2 * N) * Di + Di * R + Di + Di * N + Di + E * Di
                 + Di * bool(self.use_conv_bias) + (2 * Di + E) * bool(self.use_bias))
        return V * E * (1 + (not self.tie_word_embeddings)) + E + self.num_hidden_layers * layer

    @property
    def largest_tensor(self) -> int:
        """Elements of the largest tensor."""
        V, E, N, K = self.vocab_size, self.hidden_size, self.state_size, self.conv_kernel
        Di, R = self.intermediate_size, self.dt_rank
        return max(V * E, 2 * Di * E, (R + 2 * N) * Di, Di * N, Di * K, Di * R)

    # -- validation ------------------------------------------------------------------
    def validate(self, source: str = "config") -> None:
        def bad(key: str, why: str) -> MemengineError:
            return MemengineError(f"{source}: '{key}' {why} (got {getattr(self, key)!r})")

        for key in ("vocab_size", "hidden_size", "state_size", "num_hidden_layers", "expand", "conv_kernel"):
            v = getattr(self, key)
            if isinstance(v, float) and v.is_integer():
                v = int(v)
                setattr(self, key, v)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(key, "must be a positive integer")
        r = self.time_step_rank
        if isinstance(r, float) and r.is_integer():
            self.time_step_rank = r = int(r)
        if r != "auto" and (not isinstance(r, int) or isinstance(r, bool) or r < 1):
            raise bad("time_step_rank", 'must be "auto" or a positive integer')
        if r != "auto" and r > self.hidden_size:
            raise bad("time_step_rank", f"must not exceed hidden_size ({self.hidden_size}): the dt projection is "
                                        'low-rank ("auto" = ceil(hidden_size / 16))')
        if self.vocab_size > MAX_VOCAB:
            raise bad("vocab_size", f"must be at most {MAX_VOCAB:,} (token ids are 32-bit signed integers)")
        for key in ("use_bias", "use_conv_bias", "tie_word_embeddings", "rescale_prenorm_residual", "residual_in_fp32"):
            if not isinstance(getattr(self, key), bool):
                raise bad(key, "must be true or false")
        if self.model_type not in MODEL_TYPES:
            raise bad("model_type", f"is not supported (supported: {', '.join(MODEL_TYPES)})")
        for key in ("layer_norm_epsilon", "mixer_rms_eps", "initializer_range", "time_step_scale", "time_step_min", "time_step_max"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise bad(key, "must be a positive number")
            setattr(self, key, float(v))
        v = self.time_step_floor
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise bad("time_step_floor", "must be a non-negative number")
        self.time_step_floor = float(v)
        if self.time_step_min > self.time_step_max:
            raise bad("time_step_min", f"must not exceed time_step_max ({self.time_step_max})")
        if self.time_step_init_scheme not in ("random", "constant"):
            raise bad("time_step_init_scheme", 'must be "random" or "constant"')
        if self.hidden_act != "silu":
            raise bad("hidden_act", 'must be "silu" (the only activation Mamba-1 uses)')
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            v = getattr(self, key)
            if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                continue
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise bad(key, "must be a non-negative integer or null")

    # -- (de)serialisation -----------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "MambaConfig":
        """Build from a HF config.json dict (or an original mamba_ssm one); unknown keys ignored."""
        if not isinstance(d, dict):
            raise MemengineError(f"{source}: expected a JSON object, got {type(d).__name__}")
        d = dict(d)
        mt = d.get("model_type")
        if mt is not None and mt not in MODEL_TYPES:
            raise MemengineError(
                f"{source}: model_type {mt!r} is not supported (Mamba-1 only: {', '.join(map(repr, MODEL_TYPES))})")
        for old, new in _LEGACY_KEYS.items():
            if old in d and new not in d:
                d[new] = d[old]
        if "d_model" in d and "pad_vocab_size_multiple" in d and "vocab_size" in d:
            # mamba_ssm pads the vocabulary to a multiple (50277 -> 50280)
            m = d["pad_vocab_size_multiple"]
            if isinstance(m, int) and m > 0 and isinstance(d["vocab_size"], int) and d["vocab_size"] % m:
                d["vocab_size"] += m - d["vocab_size"] % m
        if isinstance(d.get("ssm_cfg"), dict):
            ssm = d["ssm_cfg"]
            for old, new in (("d_state", "state_size"), ("d_conv", "conv_kernel"), ("expand", "expand"),
                             ("dt_rank", "time_step_rank"), ("conv_bias", "use_conv_bias"), ("bias", "use_bias")):
                if old in ssm and new not in d:
                    d[new] = ssm[old]
        if "rms_norm" in d and d["rms_norm"] is False:
            raise MemengineError(f"{source}: rms_norm=false (LayerNorm) models are not supported")
        if "tie_embeddings" in d and "tie_word_embeddings" not in d:
            d["tie_word_embeddings"] = d["tie_embeddings"]
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        try:
            cfg = cls.__new__(cls)
            for f in fields(cls):
                setattr(cfg, f.name, kwargs.get(f.name, f.default))
            cfg.validate(source)
        except MemengineError:
            raise
        except Exception as e:  # pragma: no cover - defensive
            raise MemengineError(f"{source}: invalid config ({e})") from None
        inter = d.get("intermediate_size")
        if inter is not None and inter != cfg.intermediate_size:
            raise MemengineError(
                f"{source}: 'intermediate_size' {inter!r} does not equal expand*hidden_size = {cfg.intermediate_size}"
            )
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json content transformers loads (`MambaConfig` or `FalconMambaConfig`)."""
        d = self.to_dict()
        if not self.is_falcon:
            d.pop("mixer_rms_eps")
        d["time_step_rank"] = self.dt_rank
        d["intermediate_size"] = self.intermediate_size
        d["use_cache"] = True
        d["architectures"] = [MODEL_TYPES[self.model_type]]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_hf_dict(), indent=2, sort_keys=True) + "\n"


def expected_shapes(cfg: MambaConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name -> shape, in MambaForCausalLM.state_dict() order."""
    return dict(iter_expected_shapes(cfg))


def iter_expected_shapes(cfg: MambaConfig):
    """(name, shape) of every tensor, in order, one at a time: a check can stop at the first
    bad one without building all of them (a config may claim 10^9 layers)."""
    V, E, N, K = cfg.vocab_size, cfg.hidden_size, cfg.state_size, cfg.conv_kernel
    Di, R = cfg.intermediate_size, cfg.dt_rank
    yield "backbone.embeddings.weight", (V, E)
    for i in range(cfg.num_hidden_layers):
        p = f"backbone.layers.{i}."
        yield p + "norm.weight", (E,)
        m = p + "mixer."
        yield m + "A_log", (Di, N)
        yield m + "D", (Di,)
        yield m + "conv1d.weight", (Di, 1, K)
        if cfg.use_conv_bias:
            yield m + "conv1d.bias", (Di,)
        yield m + "in_proj.weight", (2 * Di, E)
        if cfg.use_bias:
            yield m + "in_proj.bias", (2 * Di,)
        yield m + "x_proj.weight", (R + 2 * N, Di)
        yield m + "dt_proj.weight", (Di, R)
        yield m + "dt_proj.bias", (Di,)
        yield m + "out_proj.weight", (E, Di)
        if cfg.use_bias:
            yield m + "out_proj.bias", (E,)
    yield "backbone.norm_f.weight", (E,)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", (V, E)


def check_kernel_limits(cfg: MambaConfig, source: str | None = None) -> None:
    """Refuse a shape the GPU kernels cannot run (before any upload). The limits are the ops'
    own: `MAX_N` of the selective scan, `MAX_K` of the conv1d (None: no limit)."""
    from memengine.engine.kernels import conv1d, scan

    for key, value, limit, op in (("state_size", cfg.state_size, scan.MAX_N, "selective scan"),
                                  ("conv_kernel", cfg.conv_kernel, conv1d.MAX_K, "causal conv1d")):
        if limit is not None and value > limit:
            raise MemengineError(f"{source or 'the model config'}: {key} {value} is beyond what "
                                 f"memengine's {op} kernel runs (at most {limit}); this model cannot be evaluated "
                                 "or trained here")
