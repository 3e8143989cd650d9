"""Model shape and hyper-parameters of Mamba-2 (`mamba2`, transformers' `Mamba2ForCausalLM`).

`Mamba2Config.from_dict` reads a HF `config.json` (unknown keys are ignored, known ones are
type- and range-checked, one line per bad key); `to_hf_dict` writes one that
`transformers.Mamba2Config` loads.  `iter_expected_shapes` lists every tensor in
`Mamba2ForCausalLM.state_dict()` order.

Letters: E hidden, H heads (`num_heads`), P head_dim, Di = H*P = expand*E, G groups
(`n_groups`), N state, K conv kernel, Q chunk (`chunk_size`).  in_proj's rows are
`[z (Di) | xBC (Di + 2GN) | dt (H)]`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

from memengine.engine.errors import MemengineError

MODEL_TYPES = {"mamba2": "Mamba2ForCausalLM"}
MAX_VOCAB = 2**31 - 1  # token ids are i32 on the GPU and in the data pipeline


def _special_float(x):
    if isinstance(x, dict) and set(x) == {"__float__"} and x["__float__"] in ("Infinity", "-Infinity"):
        return math.inf if x["__float__"] == "Infinity" else -math.inf
    return x


@dataclass(eq=False)
class Mamba2Config:
    vocab_size: int = 32768
    hidden_size: int = 4096          # E
    state_size: int = 128            # N
    num_hidden_layers: int = 64
    expand: int = 2
    conv_kernel: int = 4             # K
    num_heads: int = 128             # H
    head_dim: int = 64               # P
    n_groups: int = 8                # G
    chunk_size: int = 256            # Q (transformers' chunked form; the result does not depend on it)
    use_bias: bool = False
    use_conv_bias: bool = True
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    initializer_range: float = 0.1
    rescale_prenorm_residual: bool = False
    time_step_rank: int | str = 256  # not used by the model (transformers keeps the key)
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4
    time_step_limit: list = field(default_factory=lambda: [0.0, math.inf])
    hidden_act: str = "silu"
    residual_in_fp32: bool = True
    pad_token_id: int | None = 1
    bos_token_id: int | None = 0
    eos_token_id: int | None = 2
    model_type: str = "mamba2"

    def __post_init__(self) -> None:
        self.validate()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mamba2Config):
            return NotImplemented
        return self.to_hf_dict() == other.to_hf_dict()

    __hash__ = None  # mutable

    # -- derived sizes ---------------------------------------------------------------
    @property
    def intermediate_size(self) -> int:
        """Di = expand * E = num_heads * head_dim."""
        return int(self.expand * self.hidden_size)

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: xBC = Di + 2GN."""
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @property
    def in_proj_rows(self) -> int:
        """z, xBC, dt: 2Di + 2GN + H."""
        return self.intermediate_size + self.conv_dim + self.num_heads

    @property
    def n_tensors(self) -> int:
        per_layer = 8 + bool(self.use_conv_bias) + 2 * bool(self.use_bias)
        return 2 + self.num_hidden_layers * per_layer + (not self.tie_word_embeddings)

    @property
    def n_params(self) -> int:
        V, E, K, H = self.vocab_size, self.hidden_size, self.conv_kernel, self.num_heads
        Di, C, W = self.intermediate_size, self.conv_dim, self.in_proj_rows
        layer = (E + W * E + C * K + 3 * H + Di + E * Di + C * bool(self.use_conv_bias)
                 + (W + E) * bool(self.use_bias))
        return V * E * (1 + (not self.tie_word_embeddings)) + E + self.num_hidden_layers * layer

    @property
    def largest_tensor(self) -> int:
        V, E = self.vocab_size, self.hidden_size
        return max(V * E, self.in_proj_rows * E, self.conv_dim * self.conv_kernel, E * self.intermediate_size)

    @property
    def dt_limit(self) -> tuple[float, float]:
        lo, hi = self.time_step_limit
        return float(lo), float(hi)

    # -- validation ------------------------------------------------------------------
    def validate(self, source: str = "config") -> None:
        def bad(key: str, why: str) -> MemengineError:
            return MemengineError(f"{source}: '{key}' {why} (got {getattr(self, key)!r})")

        for key in ("vocab_size", "hidden_size", "state_size", "num_hidden_layers", "conv_kernel",
                    "num_heads", "head_dim", "n_groups", "chunk_size"):
            v = getattr(self, key)
            if isinstance(v, float) and v.is_integer():
                v = int(v)
                setattr(self, key, v)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(key, "must be a positive integer")
        v = self.expand   # a number (1.5 in some checkpoints) whose product with hidden_size is whole
        if isinstance(v, float) and v.is_integer():
            self.expand = v = int(v)
        if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0
                or not float(v * self.hidden_size).is_integer()):
            raise bad("expand", "must be a positive number whose product with hidden_size is a whole number")
        if self.vocab_size > MAX_VOCAB:
            raise bad("vocab_size", f"must be at most {MAX_VOCAB:,} (token ids are 32-bit signed integers)")
        if self.num_heads * self.head_dim != self.intermediate_size:
            raise bad("num_heads", f"times head_dim ({self.head_dim}) must equal expand*hidden_size "
                                   f"({self.intermediate_size})")
        if self.num_heads % self.n_groups:
            raise bad("n_groups", f"must divide num_heads ({self.num_heads})")
        r = self.time_step_rank
        if isinstance(r, float) and r.is_integer():
            self.time_step_rank = r = int(r)
        if r != "auto" and (not isinstance(r, int) or isinstance(r, bool) or r < 1):
            raise bad("time_step_rank", 'must be "auto" or a positive integer')
        for key in ("use_bias", "use_conv_bias", "tie_word_embeddings", "rescale_prenorm_residual", "residual_in_fp32"):
            if not isinstance(getattr(self, key), bool):
                raise bad(key, "must be true or false")
        if self.model_type not in MODEL_TYPES:
            raise bad("model_type", f"is not supported here (supported: {', '.join(MODEL_TYPES)})")
        for key in ("layer_norm_epsilon", "initializer_range", "time_step_min", "time_step_max"):
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
        lim = self.time_step_limit
        if isinstance(lim, tuple):
            lim = list(lim)
        if isinstance(lim, list):   # transformers 5 may write a non-finite float as {"__float__": "Infinity"}
            lim = [_special_float(x) for x in lim]
        if (not isinstance(lim, list) or len(lim) != 2
                or any(isinstance(x, bool) or not isinstance(x, (int, float)) or math.isnan(x) for x in lim)
                or lim[0] < 0 or lim[0] > lim[1] or lim[0] == math.inf):
            raise bad("time_step_limit", "must be [low, high] with 0 <= low <= high (high may be Infinity)")
        self.time_step_limit = [float(lim[0]), float(lim[1])]
        if self.hidden_act != "silu":
            raise bad("hidden_act", 'must be "silu" (the only activation Mamba-2 uses)')
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            v = getattr(self, key)
            if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                continue
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise bad(key, "must be a non-negative integer or null")

    # -- (de)serialisation -----------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "Mamba2Config":
        if not isinstance(d, dict):
            raise MemengineError(f"{source}: expected a JSON object, got {type(d).__name__}")
        mt = d.get("model_type")
        if mt is not None and mt not in MODEL_TYPES:
            raise MemengineError(f"{source}: model_type {mt!r} is not Mamba-2 ('mamba2')")
        names = {f.name for f in fields(cls)}
        cfg = cls.__new__(cls)
        for f in fields(cls):
            default = f.default_factory() if f.name == "time_step_limit" else f.default
            setattr(cfg, f.name, d[f.name] if f.name in d and f.name in names else default)
        try:
            cfg.validate(source)
        except MemengineError:
            raise
        except Exception as e:  # pragma: no cover - defensive
            raise MemengineError(f"{source}: invalid config ({e})") from None
        inter = d.get("intermediate_size")
        if inter is not None and inter != cfg.intermediate_size:
            raise MemengineError(f"{source}: 'intermediate_size' {inter!r} does not equal expand*hidden_size = "
                                 f"{cfg.intermediate_size}")
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_hf_dict(self) -> dict[str, Any]:
        d = self.to_dict()
        d["time_step_limit"] = list(self.time_step_limit)
        d["use_cache"] = True
        d["architectures"] = [MODEL_TYPES[self.model_type]]
        return d

    def to_json(self) -> str:
        # json writes an infinite time_step_limit as the bare token Infinity, as transformers does
        return json.dumps(self.to_hf_dict(), indent=2, sort_keys=True) + "\n"


def iter_expected_shapes(cfg: Mamba2Config):
    """(name, shape) of every tensor, in Mamba2ForCausalLM.state_dict() order, one at a time."""
    V, E, K, H = cfg.vocab_size, cfg.hidden_size, cfg.conv_kernel, cfg.num_heads
    Di, C, W = cfg.intermediate_size, cfg.conv_dim, cfg.in_proj_rows
    yield "backbone.embeddings.weight", (V, E)
    for i in range(cfg.num_hidden_layers):
        p = f"backbone.layers.{i}."
        yield p + "norm.weight", (E,)
        m = p + "mixer."
        yield m + "dt_bias", (H,)
        yield m + "A_log", (H,)
        yield m + "D", (H,)
        yield m + "conv1d.weight", (C, 1, K)
        if cfg.use_conv_bias:
            yield m + "conv1d.bias", (C,)
        yield m + "in_proj.weight", (W, E)
        if cfg.use_bias:
            yield m + "in_proj.bias", (W,)
        yield m + "norm.weight", (Di,)
        yield m + "out_proj.weight", (E, Di)
        if cfg.use_bias:
            yield m + "out_proj.bias", (E,)
    yield "backbone.norm_f.weight", (E,)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", (V, E)


def expected_shapes(cfg: Mamba2Config) -> dict:
    return dict(iter_expected_shapes(cfg))
