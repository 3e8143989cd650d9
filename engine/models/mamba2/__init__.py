"""Mamba-2 (`mamba2`, transformers' Mamba2ForCausalLM): the SSD layer with multi-head
scalar-decay states, B and C shared by the heads of a group, and a gated RMS norm per group.

Everything the engine needs of it is here: the config and tensor table (config.py), the
initialisation (init.py), the layer's forward and backward (block.py), the LoRA targets,
the WSLA set and the memory plan's tables.
"""

from __future__ import annotations

import re

from memengine.engine import models
from memengine.engine.errors import MemengineError
from memengine.engine.kernels import conv1d, ssd
from memengine.engine.models.base import Architecture
from memengine.engine.models.mamba2.config import MODEL_TYPES, Mamba2Config, iter_expected_shapes
from memengine.engine.models.ssd_mixer import plan_scratch as ssd_plan_scratch

_LAYER = re.compile(r"backbone\.layers\.(\d{1,9})\.")


class Mamba2(Architecture):
    name = "Mamba-2"
    model_types = MODEL_TYPES
    lora_targets = ("in_proj",)
    lora_refused = {
        "out_proj": "PEFT refuses LoRA on out_proj in Mamba-2 models (the fused kernels bypass the module)",
        "conv1d": "PEFT refuses LoRA on conv1d in Mamba-2 models (the fused kernels bypass the module)",
    }
    wsla_scope = "each layer's in_proj rows of B, C and dt, and dt_bias (the selection)"

    # -- config
    def config_from_dict(self, d: dict, source: str) -> Mamba2Config:
        return Mamba2Config.from_dict(d, source)

    def infer_config(self, shapes: dict) -> Mamba2Config:
        """A Mamba2Config from tensor shapes where they fix it: E, V, layers, K, H, Di and the
        biases; n_groups and state_size cannot be told apart from the shapes (only G*N is
        there), nor head_dim, so a bare file needs its config.json."""
        raise MemengineError("cannot infer a Mamba-2 model's shape from its tensors alone (n_groups, state_size "
                             "and head_dim are not in the shapes): put its config.json beside the weights")

    # -- tensors
    def iter_shapes(self, cfg):
        return iter_expected_shapes(cfg)

    def gpu_shape(self, name: str, shape: tuple) -> tuple:
        return tuple(shape[:1]) + tuple(shape[2:]) if name.endswith("conv1d.weight") else tuple(shape)

    def missing_hint(self, cfg, name: str) -> str:
        if name.endswith(".bias") and (".in_proj." in name or ".out_proj." in name):
            return " (config has use_bias=true)"
        if name.endswith("conv1d.bias"):
            return " (config has use_conv_bias=true)"
        if name.endswith("in_proj.weight"):
            return " (in_proj must have 2*Di + 2*n_groups*state_size + num_heads rows; a d_mlp part is not supported)"
        return ""

    def shape_refusal(self, cfg, name: str, shape: tuple) -> str:
        if name.endswith(".mixer.in_proj.weight") and len(shape) == 2 and shape[0] > cfg.in_proj_rows:
            return (f"tensor '{name}' has {shape[0]} rows, more than 2*Di + 2*n_groups*state_size + num_heads = "
                    f"{cfg.in_proj_rows}: Mamba-2 layers with an MLP part (d_mlp) are not supported")
        return ""

    def init_weights(self, cfg, seed: int) -> dict:
        from memengine.engine.models.mamba2.init import init_weights

        return init_weights(cfg, seed)

    def check_kernel_limits(self, cfg, source: str | None = None) -> None:
        if conv1d.MAX_K is not None and cfg.conv_kernel > conv1d.MAX_K:
            raise MemengineError(f"{source or 'the model config'}: conv_kernel {cfg.conv_kernel} is beyond what "
                                 f"memengine's causal conv1d kernel runs (at most {conv1d.MAX_K}); this model "
                                 "cannot be evaluated or trained here")

    def n_params(self, cfg) -> int:
        return cfg.n_params

    # -- training
    def wsla_names(self, cfg, names: list) -> list:
        return [n for n in names if n.endswith(".mixer.in_proj.weight") or n.endswith(".mixer.dt_bias")]

    def wsla_rows(self, cfg, name: str):
        if name.endswith(".mixer.in_proj.weight"):   # B, C and dt: rows 2Di .. W
            Di = cfg.intermediate_size
            return 2 * Di, cfg.in_proj_rows - 2 * Di
        return None

    def lora_dims(self, cfg, target: str) -> tuple[int, int]:
        return {"in_proj": (cfg.hidden_size, cfg.in_proj_rows)}[target]

    def block(self, cfg):
        from memengine.engine.models.mamba2.block import Mamba2Block

        return Mamba2Block(cfg)

    # -- the memory plan
    @staticmethod
    def _linears(cfg) -> list:
        return [(cfg.in_proj_rows, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size)]

    def products(self, cfg, M: int, grad: bool) -> set:
        out = {(M, o, i) for o, i in self._linears(cfg)}
        if grad:
            out |= {(M, i, o) for o, i in self._linears(cfg)} | {(o, i, M) for o, i in self._linears(cfg)}
        return out

    def plan_scratch(self, lim, cfg, B: int, L: int, kind: str, mixed: bool = False) -> int:
        return ssd_plan_scratch(lim, cfg, B, L, kind)

    def plan_units(self, cfg, B: int, L: int, grad: bool, sequence: str = "at --seq-len {}") -> list:
        H, P, N, G = cfg.num_heads, cfg.head_dim, cfg.state_size, cfg.n_groups
        out = [(f"one sequence of the SSD scan {sequence.format(L)}", max(ssd.sequence_windows(1, L, H, P, N, G)),
                True, "tensor"),
               (f"one sequence of the conv1d {sequence.format(L)} ({L} x {cfg.in_proj_rows} values)",
                4 * L * cfg.in_proj_rows, True, "tensor")]
        if grad:
            out.append((f"the SSD scan's scratch for one sequence {sequence.format(L)}",
                        max(ssd.sequence_scratch(1, L, H, P, N, G)), True, "adapter"))
        return out

    def gguf(self):
        from memengine.engine.models.mamba2 import gguf

        return gguf

    def describe(self, cfg) -> list:
        return [("layers", cfg.num_hidden_layers), ("hidden size (E)", cfg.hidden_size),
                ("inner size (Di)", cfg.intermediate_size),
                ("heads (H) x head_dim (P)", f"{cfg.num_heads} x {cfg.head_dim}"), ("groups (G)", cfg.n_groups),
                ("state size (N)", cfg.state_size), ("conv kernel (K)", cfg.conv_kernel),
                ("chunk size (Q)", cfg.chunk_size), ("vocabulary (V)", cfg.vocab_size),
                ("tied lm_head", cfg.tie_word_embeddings),
                ("biases", f"use_bias={cfg.use_bias} use_conv_bias={cfg.use_conv_bias}")]

    def summary(self, cfg) -> list:
        return [("layers", cfg.num_hidden_layers), ("hidden size", cfg.hidden_size),
                ("heads", f"{cfg.num_heads} x {cfg.head_dim}"), ("state size", cfg.state_size),
                ("vocabulary", cfg.vocab_size)]


ARCH = Mamba2()
models.register(ARCH)
