"""Mamba-2 + attention hybrids: `granitemoehybrid` without experts (transformers'
GraniteMoeHybridForCausalLM, the dense IBM Granite 4.0-H) and `bamba` (BambaForCausalLM).
Their Mamba layers are the Mamba-2 mixer (engine/models/ssd_mixer.py, shared with Mamba-2);
the others are causal self-attention with grouped KV heads (engine/kernels/attention.py) and
RoPE as configured (engine/kernels/rope.py); every layer then has a SwiGLU MLP
(engine/kernels/swiglu.py).  Granite's multipliers: embedding_multiplier (the shell scales
the embeddings), residual_multiplier (the block), attention_multiplier (the attention's
scale), logits_scaling (the shell divides the logits).

Here: the config (config.py), the tensor table (tensors.py), the initialisation (init.py),
the layer's forward and backward (block.py), the WSLA set and the memory plan's tables.
"""

from __future__ import annotations

import re

from memengine.engine import models
from memengine.engine.errors import MemengineError
from memengine.engine.kernels import attention, conv1d, ssd
from memengine.engine.models.base import Architecture
from memengine.engine.models.hybrid.config import ATTENTION, MAMBA, MODEL_TYPES, HybridConfig
from memengine.engine.models.hybrid.tensors import BAMBA, GRANITE, iter_expected_shapes
from memengine.engine.models.ssd_mixer import _buf16
from memengine.engine.models.ssd_mixer import plan_scratch as ssd_plan_scratch

_LAYER = re.compile(r"model\.layers\.(\d{1,9})\.")


class _Hybrid(Architecture):
    LAYER_PREFIX = "model.layers."
    EMBEDDINGS = "model.embed_tokens.weight"
    lora_refused = {"conv1d": "transformers reads the Mamba layers' conv1d weight directly (causal_conv1d_fn), "
                              "so a LoRA adapter on it would have no effect there"}
    MLP_TARGETS: tuple = ()
    wsla_scope = ("each Mamba layer's in_proj rows of B, C and dt, and dt_bias (the selection); attention and "
                  "MLP layers are frozen")

    def config_from_dict(self, d: dict, source: str) -> HybridConfig:
        mt = d.get("model_type")
        if mt not in self.model_types:
            raise MemengineError(f"{source}: model_type {mt!r} is not {self.name} ({', '.join(self.model_types)})")
        return HybridConfig.from_dict(d, source)

    def infer_config(self, shapes: dict):
        raise MemengineError(f"cannot infer a {self.name} model's shape from its tensors alone (the layer kinds, "
                             "head counts and Mamba shape are not all in the shapes): put its config.json beside "
                             "the weights")

    def iter_shapes(self, cfg):
        return iter_expected_shapes(cfg)

    def gpu_shape(self, name: str, shape: tuple) -> tuple:
        return tuple(shape[:1]) + tuple(shape[2:]) if name.endswith("conv1d.weight") else tuple(shape)

    def missing_hint(self, cfg, name: str) -> str:
        m = _LAYER.match(name)
        if m and (".mamba." in name or ".self_attn." in name):
            i = int(m.group(1))
            kind = cfg.layer_kinds[i] if i < len(cfg.layer_kinds) else "?"
            key = "layer_types" if cfg.model_type == "granitemoehybrid" else "attn_layer_indices"
            return f" (the config's '{key}' makes layer {i} a {kind} layer)"
        if name.endswith(".bias"):
            return " (the config asks for biases: attention_bias / mlp_bias / mamba_proj_bias / mamba_conv_bias)"
        return ""

    def init_weights(self, cfg, seed: int) -> dict:
        from memengine.engine.models.hybrid.init import init_weights

        return init_weights(cfg, seed)

    def check_kernel_limits(self, cfg, source: str | None = None) -> None:
        where = source or "the model config"
        if conv1d.MAX_K is not None and cfg.mamba_d_conv > conv1d.MAX_K:
            raise MemengineError(f"{where}: mamba_d_conv {cfg.mamba_d_conv} is beyond what memengine's causal "
                                 f"conv1d kernel runs (at most {conv1d.MAX_K})")
        if cfg.attention_layers:
            attention.check_shape(cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, where)


    # -- the shell's multipliers
    def embedding_scale(self, cfg) -> float:
        return cfg.embedding_multiplier

    def logits_scale(self, cfg) -> float:
        return 1.0 / cfg.logits_scaling

    # -- training
    def wsla_names(self, cfg, names: list) -> list:
        return [n for n in names if n.endswith(".mamba.in_proj.weight") or n.endswith(".mamba.dt_bias")]

    def wsla_rows(self, cfg, name: str):
        if name.endswith(".mamba.in_proj.weight"):   # B, C and dt: rows 2Di .. W
            Di = cfg.mamba.intermediate_size
            return 2 * Di, cfg.mamba.in_proj_rows - 2 * Di
        return None

    # -- LoRA: the Mamba layers' in_proj and out_proj, attention's q, k, v, o, the MLP's layers
    @property
    def lora_targets(self) -> tuple:
        return ("in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj") + self.MLP_TARGETS

    def lora_module(self, cfg, layer: int, target: str):
        kind = cfg.layer_kinds[layer] if 0 <= layer < len(cfg.layer_kinds) else None
        if target in ("in_proj", "out_proj"):
            return f"mamba.{target}" if kind == MAMBA else None
        if target in ("q_proj", "k_proj", "v_proj", "o_proj"):
            return f"self_attn.{target}" if kind == ATTENTION else None
        return f"{self.MLP_MODULE}.{target}" if kind is not None else None

    def lora_dims(self, cfg, target: str) -> tuple[int, int]:
        E, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        return {"in_proj": (E, cfg.mamba.in_proj_rows), "out_proj": (cfg.mamba.intermediate_size, E),
                "q_proj": (E, Hq * D), "k_proj": (E, Hkv * D), "v_proj": (E, Hkv * D), "o_proj": (Hq * D, E),
                "input_linear": (E, 2 * I), "output_linear": (I, E),
                "gate_proj": (E, I), "up_proj": (E, I), "down_proj": (I, E)}[target]

    def block(self, cfg):
        from memengine.engine.models.hybrid.block import HybridBlock

        return HybridBlock(cfg)

    # -- the memory plan
    def _linears(self, cfg) -> list:
        E, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        out = [(2 * I, E), (I, E), (E, I)]
        if cfg.attention_layers:
            out += [(cfg.num_attention_heads * D, E), (cfg.num_key_value_heads * D, E), (E, cfg.num_attention_heads * D)]
        if len(cfg.attention_layers) < cfg.num_hidden_layers:
            out += [(cfg.mamba.in_proj_rows, E), (E, cfg.mamba.intermediate_size)]
        return out

    def products(self, cfg, M: int, grad: bool) -> set:
        lin = self._linears(cfg)
        out = {(M, o, i) for o, i in lin}
        if grad:
            out |= {(M, i, o) for o, i in lin} | {(o, i, M) for o, i in lin}
        return out

    def plan_scratch(self, lim, cfg, B: int, L: int, kind: str, mixed: bool = False) -> int:
        total = 0
        if len(cfg.attention_layers) < cfg.num_hidden_layers:
            total += ssd_plan_scratch(lim, cfg.mamba, B, L, kind)
        # the f32 attention kernels take no scratch; on subgroup matrices (--precision mixed)
        # the backward's dk and dv shares of each query head of a kv head, summed after
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        if (mixed and kind != "eval" and cfg.attention_layers and rep > 1
                and attention.takes_subgroup_matrices(lim, cfg.head_dim)):
            total += 2 * _buf16(4 * rep * B * L * cfg.num_key_value_heads * cfg.head_dim)
        return total

    def plan_units(self, cfg, B: int, L: int, grad: bool, sequence: str = "at --seq-len {}") -> list:
        out = []
        c = cfg.mamba
        if len(cfg.attention_layers) < cfg.num_hidden_layers:
            H, P, N, G = c.num_heads, c.head_dim, c.state_size, c.n_groups
            out += [(f"one sequence of the SSD scan {sequence.format(L)}",
                     max(ssd.sequence_windows(1, L, H, P, N, G)), True, "tensor"),
                    (f"one sequence of the conv1d {sequence.format(L)} ({L} x {c.in_proj_rows} values)",
                     4 * L * c.in_proj_rows, True, "tensor")]
            if grad:
                out.append((f"the SSD scan's scratch for one sequence {sequence.format(L)}",
                            max(ssd.sequence_scratch(1, L, H, P, N, G)), True, "adapter"))
        if cfg.attention_layers:   # the attention kernels bind the batch's q (and o) whole
            n = B * L * cfg.num_attention_heads * cfg.head_dim
            out.append((f"the attention's queries of the batch {sequence.format(L)} ({B * L} x "
                        f"{cfg.num_attention_heads * cfg.head_dim} values)", 4 * n, True, "tensor"))
        return out

    def describe(self, cfg) -> list:
        kinds = cfg.layer_kinds
        att = [i for i, k in enumerate(kinds) if k == ATTENTION]
        rope = (f"RoPE theta {cfg.rope_theta:g} on {cfg.rotary_dims} of {cfg.head_dim} dims" if cfg.rope
                else "none")
        rows = [("layers", f"{cfg.num_hidden_layers} ({len(kinds) - len(att)} Mamba-2, {len(att)} attention"
                           + (f" at {', '.join(map(str, att))}" if att else "") + ")"),
                ("hidden size (E)", cfg.hidden_size), ("MLP size (I)", cfg.intermediate_size),
                ("attention heads (q / kv) x head_dim", f"{cfg.num_attention_heads} / {cfg.num_key_value_heads} x "
                                                          f"{cfg.head_dim}"),
                ("positions", rope),
                ("Mamba heads (H) x head_dim (P)", f"{cfg.mamba_n_heads} x {cfg.mamba_d_head}"),
                ("groups (G)", cfg.mamba_n_groups), ("state size (N)", cfg.mamba_d_state),
                ("conv kernel (K)", cfg.mamba_d_conv), ("vocabulary (V)", cfg.vocab_size),
                ("tied lm_head", cfg.tie_word_embeddings)]
        if cfg.model_type == "granitemoehybrid":
            rows.append(("multipliers", f"embedding {cfg.embedding_multiplier:g}, residual "
                                        f"{cfg.residual_multiplier:g}, attention {cfg.attention_scale:g}, "
                                        f"logits / {cfg.logits_scaling:g}"))
        return rows

    def summary(self, cfg) -> list:
        return [("layers", f"{cfg.num_hidden_layers} ({len(cfg.attention_layers)} attention)"),
                ("hidden size", cfg.hidden_size), ("heads", f"{cfg.num_attention_heads} / {cfg.num_key_value_heads}"),
                ("vocabulary", cfg.vocab_size)]


class GraniteHybrid(_Hybrid):
    name = "Granite 4.0-H (dense)"
    model_types = {"granitemoehybrid": MODEL_TYPES["granitemoehybrid"]}
    FINAL_NORM = GRANITE["final_norm"]
    MLP_MODULE, MLP_TARGETS = "shared_mlp", ("input_linear", "output_linear")


class Bamba(_Hybrid):
    name = "Bamba"
    model_types = {"bamba": MODEL_TYPES["bamba"]}
    FINAL_NORM = BAMBA["final_norm"]
    MLP_MODULE, MLP_TARGETS = "feed_forward", ("gate_proj", "up_proj", "down_proj")


GRANITE_ARCH, BAMBA_ARCH = GraniteHybrid(), Bamba()
models.register(GRANITE_ARCH)
models.register(BAMBA_ARCH)
