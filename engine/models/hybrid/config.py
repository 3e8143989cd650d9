"""Model shape and hyper-parameters of the Mamba-2 + attention hybrids: transformers'
`GraniteMoeHybridForCausalLM` without experts (`granitemoehybrid`, the dense Granite 4.0-H)
and `BambaForCausalLM` (`bamba`).

`HybridConfig.from_dict` reads a HF `config.json`: the keys the model depends on are type- and
range-checked, one line per bad key; a config this engine does not compute as transformers
does (experts, a z-loss, attention dropout, a RoPE type other than the default) is refused in
one line naming its key.  `to_hf_dict` writes the dict it was read from back (unknown keys
kept), so transformers loads what we save as it loaded what we read.

Letters: E hidden, Hq attention heads, Hkv key/value heads, D = E / Hq (head_dim), R rotary
dims (D * partial_rotary_factor, even), I the MLP's intermediate size; the Mamba layers: H
mamba heads, P mamba head_dim (H*P = Di = mamba_expand*E), G groups, N state, K conv kernel.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace
from typing import Any

from memengine.engine.errors import MemengineError

MODEL_TYPES = {"granitemoehybrid": "GraniteMoeHybridForCausalLM", "bamba": "BambaForCausalLM"}
MAX_VOCAB = 2**31 - 1
MAMBA, ATTENTION = "mamba", "attention"
_KINDS = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION}

# key -> (default granitemoehybrid, default bamba): transformers' defaults
_DEFAULTS = {
    "vocab_size": (32000, 128000), "hidden_size": (4096, 4096), "num_hidden_layers": (32, 32),
    "num_attention_heads": (32, 32), "num_key_value_heads": (None, 8), "hidden_act": ("silu", "silu"),
    "rms_norm_eps": (1e-6, 1e-5), "tie_word_embeddings": (False, False), "attention_bias": (False, False),
    "attention_dropout": (0.0, 0.0), "initializer_range": (0.02, 0.02), "max_position_embeddings": (2048, 262144),
    "mamba_n_heads": (128, 128), "mamba_n_groups": (1, 1), "mamba_d_state": (256, 256), "mamba_d_head": ("auto", "auto"),
    "mamba_d_conv": (4, 4), "mamba_expand": (2, 2), "mamba_chunk_size": (256, 256), "mamba_conv_bias": (True, True),
    "mamba_proj_bias": (False, False), "bos_token_id": (1, 1), "eos_token_id": (2, 2), "pad_token_id": (None, 0),
}


def _float(x):
    if isinstance(x, dict) and set(x) == {"__float__"} and x["__float__"] in ("Infinity", "-Infinity"):
        return math.inf if x["__float__"] == "Infinity" else -math.inf
    return x


class HybridConfig:
    """The parsed config.  Attributes the engine reads: model_type, vocab_size, hidden_size,
    num_hidden_layers, tie_word_embeddings, layer_norm_epsilon, eos_token_id; the layers'
    shape below; `mamba` (the Mamba layers' shape as engine/models/ssd_mixer.py reads it)."""

    def __init__(self, raw: dict, source: str = "config"):
        self.raw = dict(raw)
        self.source = source
        self.validate(source)

    # -- parsing ---------------------------------------------------------------------
    def _get(self, key: str):
        if key in self.raw:
            return self.raw[key]
        d = _DEFAULTS.get(key)
        return None if d is None else d[self.model_type == "bamba"]

    def validate(self, source: str = "config") -> None:
        d, mt = self.raw, self.raw.get("model_type")
        if mt not in MODEL_TYPES:
            raise MemengineError(f"{source}: model_type {mt!r} is not a hybrid handled here "
                                 f"({', '.join(MODEL_TYPES)})")
        self.model_type = mt
        granite = mt == "granitemoehybrid"

        def bad(key: str, why: str, value=None) -> MemengineError:
            return MemengineError(f"{source}: '{key}' {why} (got {self._get(key) if value is None else value!r})")

        def pos_int(key: str) -> int:
            v = self._get(key)
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(key, "must be a positive integer")
            return v

        def flag(key: str) -> bool:
            v = self._get(key)
            if not isinstance(v, bool):
                raise bad(key, "must be true or false")
            return v

        def number(key: str, default: float, positive: bool = True) -> float:
            v = d.get(key, default)
            v = default if v is None else v
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
                raise bad(key, "must be a positive number" if positive else "must be a finite number", v)
            return float(v)

        # what is refused (one line naming the key)
        if granite:
            ne = d.get("num_local_experts", 8)
            if ne not in (0, None):
                raise MemengineError(f"{source}: mixture-of-experts Granite models are not supported yet "
                                     f"('num_local_experts' {ne!r}, 'num_experts_per_tok' "
                                     f"{d.get('num_experts_per_tok', 2)!r}); only the dense Granite 4.0-H "
                                     "(num_local_experts 0) runs here")
        else:
            z = d.get("z_loss_coefficient", 0.0)
            if z not in (0, 0.0, None):
                raise bad("z_loss_coefficient", "must be 0 (memengine's loss has no z-loss term)", z)
        drop = d.get("attention_dropout", 0.0)
        if drop not in (0, 0.0, None):
            raise bad("attention_dropout", "must be 0 (memengine's attention kernel has no dropout)", drop)
        if self._get("hidden_act") != "silu":
            raise bad("hidden_act", 'must be "silu" (the only activation these hybrids use)')

        self.vocab_size = pos_int("vocab_size")
        if self.vocab_size > MAX_VOCAB:
            raise bad("vocab_size", f"must be at most {MAX_VOCAB:,} (token ids are 32-bit signed integers)")
        self.hidden_size = E = pos_int("hidden_size")
        self.num_hidden_layers = nl = pos_int("num_hidden_layers")
        self.num_attention_heads = Hq = pos_int("num_attention_heads")
        if "num_key_value_heads" in d and d["num_key_value_heads"] is None:
            self.num_key_value_heads = Hq          # transformers: None means one per attention head
        elif "num_key_value_heads" not in d:
            self.num_key_value_heads = Hq if granite else 8
        else:
            self.num_key_value_heads = pos_int("num_key_value_heads")
        Hkv = self.num_key_value_heads
        if E % Hq:
            raise bad("num_attention_heads", f"must divide hidden_size ({E})")
        hd = d.get("head_dim")
        if hd is not None and hd != E // Hq:
            raise bad("head_dim", f"must be hidden_size / num_attention_heads = {E // Hq} (as transformers computes "
                                  "it for these models)", hd)
        self.head_dim = E // Hq
        if Hq % Hkv:
            raise bad("num_key_value_heads", f"must divide num_attention_heads ({Hq})")
        self.tie_word_embeddings = flag("tie_word_embeddings")
        self.attention_bias = flag("attention_bias")
        self.mlp_bias = False if granite else (d.get("mlp_bias", False) is True)
        if not granite and not isinstance(d.get("mlp_bias", False), bool):
            raise bad("mlp_bias", "must be true or false", d.get("mlp_bias"))
        self.layer_norm_epsilon = self.rms_norm_eps = number("rms_norm_eps", 1e-6 if granite else 1e-5)
        self.initializer_range = number("initializer_range", 0.02)
        self.max_position_embeddings = pos_int("max_position_embeddings")
        self.intermediate_size = (pos_int("shared_intermediate_size") if granite and "shared_intermediate_size" in d
                                  else 1024 if granite
                                  else pos_int("intermediate_size") if "intermediate_size" in d else 14336)

        # multipliers (Granite)
        self.embedding_multiplier = number("embedding_multiplier", 1.0) if granite else 1.0
        self.residual_multiplier = number("residual_multiplier", 1.0) if granite else 1.0
        self.logits_scaling = number("logits_scaling", 1.0) if granite else 1.0
        self.attention_scale = (number("attention_multiplier", 1.0) if granite
                                else 1.0 / math.sqrt(self.head_dim))

        # positions
        rp = d.get("rope_parameters") or {}
        if not isinstance(rp, dict):
            raise bad("rope_parameters", "must be an object", rp)
        rtype = rp.get("rope_type", (d.get("rope_scaling") or {}).get("rope_type", "default")
                       if isinstance(d.get("rope_scaling"), dict) else "default")
        if granite:
            pet = d.get("position_embedding_type")
            if pet not in (None, "nope", "rope"):
                raise bad("position_embedding_type", 'must be "rope", or "nope" or null (no positional encoding)',
                          pet)
            self.rope = pet == "rope"
            factor = 1.0
        else:
            self.rope = True
            factor = 0.5   # transformers' Bamba hard-codes it
        if self.rope:
            if rtype != "default":
                raise MemengineError(f"{source}: 'rope_parameters' rope_type {rtype!r} is not supported "
                                     "(only the default RoPE)")
            theta = rp.get("rope_theta", d.get("rope_theta", 10000.0))
            if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
                raise bad("rope_theta", "must be a positive number", theta)
            self.rope_theta = float(theta)
            self.rotary_dims = int(self.head_dim * factor)
            if self.rotary_dims % 2 or self.rotary_dims < 2:
                raise bad("num_attention_heads", f"gives head_dim {self.head_dim}, whose rotary part "
                                                 f"({self.rotary_dims}) must be a positive even number")
        else:
            self.rope_theta, self.rotary_dims = 0.0, 0

        # layer kinds
        if granite:
            lt = d.get("layer_types", d.get("layers_block_type"))
            if lt is None:
                lt = ["mamba"] * nl
            if not isinstance(lt, list) or len(lt) != nl or any(x not in _KINDS for x in lt):
                raise bad("layer_types", f"must list {nl} layer kinds, each \"mamba\" or \"attention\"", lt)
            self.layer_kinds = [_KINDS[x] for x in lt]
        else:
            ai = d.get("attn_layer_indices") or []
            if (not isinstance(ai, list) or any(not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < nl
                                                for x in ai)):
                raise bad("attn_layer_indices", f"must be a list of layer indices below {nl}", ai)
            self.layer_kinds = [ATTENTION if i in ai else MAMBA for i in range(nl)]

        # the Mamba layers
        self.mamba_n_heads = H = pos_int("mamba_n_heads")
        self.mamba_n_groups = G = pos_int("mamba_n_groups")
        self.mamba_d_state = N = pos_int("mamba_d_state")
        self.mamba_d_conv = K = pos_int("mamba_d_conv")
        self.mamba_chunk_size = pos_int("mamba_chunk_size")
        ex = self._get("mamba_expand")
        if isinstance(ex, bool) or not isinstance(ex, (int, float)) or ex <= 0 or not float(ex * E).is_integer():
            raise bad("mamba_expand", "must be a positive number whose product with hidden_size is whole")
        self.mamba_expand = ex
        Di = int(ex * E)
        P = self._get("mamba_d_head")
        if P == "auto":
            P = Di // H
        if isinstance(P, bool) or not isinstance(P, int) or P < 1 or P * H != Di:
            raise bad("mamba_d_head", f"times mamba_n_heads ({H}) must equal mamba_expand*hidden_size ({Di})", P)
        self.mamba_d_head = P
        if H % G:
            raise bad("mamba_n_groups", f"must divide mamba_n_heads ({H})")
        self.mamba_conv_bias = flag("mamba_conv_bias")
        self.mamba_proj_bias = flag("mamba_proj_bias")
        lim = d.get("time_step_limit", [0.0, math.inf])
        lim = [0.0, math.inf] if lim is None else lim
        lim = [_float(x) for x in lim] if isinstance(lim, (list, tuple)) else lim
        if (not isinstance(lim, list) or len(lim) != 2 or any(isinstance(x, bool) or not isinstance(x, (int, float))
                                                              or math.isnan(x) for x in lim)
                or lim[0] < 0 or lim[0] > lim[1]):
            raise bad("time_step_limit", "must be [low, high] with 0 <= low <= high", lim)
        self.time_step_limit = [float(lim[0]), float(lim[1])]
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            v = self._get(key)
            if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                continue
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise bad(key, "must be a non-negative integer or null")
        self.eos_token_id = self._get("eos_token_id")
        self.bos_token_id = self._get("bos_token_id")
        self.pad_token_id = self._get("pad_token_id")
        C = Di + 2 * G * N
        self.mamba = SimpleNamespace(
            hidden_size=E, intermediate_size=Di, state_size=N, conv_kernel=K, num_heads=H, head_dim=P, n_groups=G,
            conv_dim=C, in_proj_rows=Di + C + H, dt_limit=tuple(self.time_step_limit), layer_norm_epsilon=self.rms_norm_eps,
            num_hidden_layers=nl, use_bias=self.mamba_proj_bias, use_conv_bias=self.mamba_conv_bias)

    # -- derived -----------------------------------------------------------------------
    @property
    def attention_layers(self) -> list:
        return [i for i, k in enumerate(self.layer_kinds) if k == ATTENTION]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, HybridConfig):
            return NotImplemented
        return self.to_hf_dict() == other.to_hf_dict()

    __hash__ = None

    # -- (de)serialisation -------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "HybridConfig":
        if not isinstance(d, dict):
            raise MemengineError(f"{source}: expected a JSON object, got {type(d).__name__}")
        try:
            return cls(d, source)
        except MemengineError:
            raise
        except Exception as e:  # pragma: no cover - defensive
            raise MemengineError(f"{source}: invalid config ({e})") from None

    def to_dict(self) -> dict:
        return dict(self.raw)

    def to_hf_dict(self) -> dict:
        d = dict(self.raw)
        d["model_type"] = self.model_type
        d["architectures"] = [MODEL_TYPES[self.model_type]]
        d.setdefault("tie_word_embeddings", self.tie_word_embeddings)
        if self.model_type == "granitemoehybrid":
            d.setdefault("num_local_experts", 0)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_hf_dict(), indent=2, sort_keys=True) + "\n"
