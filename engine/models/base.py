"""What an architecture is to the engine: `Architecture` (one family of checkpoints, e.g.
Mamba-1 with its Falcon-Mamba variant) and `Block` (its layers on the GPU).

The engine's shell (engine/models/lm.py: embedding, the layer loop, final RMS norm, LM head,
cross-entropy, precision copies, the LoRA adapter hook) and every command (init, info, eval,
train, adapt, generate, merge, quantize, the memory plan) reach a model family only through
these two classes, found by `model_type` in the registry (engine/models/__init__.py).  An
architecture defined outside the engine registers itself the same way (see
`models.register` and `MEMENGINE_MODELS`).

Tensor names are the checkpoint's.  The shell's own tensors (`EMBEDDINGS`, `FINAL_NORM`,
`HEAD`) are named by the architecture too.

A config (what `Architecture.config_from_dict` returns) is the architecture's own class;
the engine reads of it only `model_type`, `vocab_size`, `hidden_size`,
`num_hidden_layers`, `tie_word_embeddings`, `layer_norm_epsilon` (the final norm's) and
`eos_token_id`, and calls `validate(source)`, `to_hf_dict()` (config.json's content) and
`to_json()`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

from memengine.engine.errors import MemengineError


class Block:
    """One architecture's layers on the GPU (forward, backward, decode step), given the
    shell model it belongs to (`model.params.layers[i]`, `model.half`, `model.lora`).

    `LAYER_FIELDS` maps a layer tensor's name after the layer prefix to the attribute of the
    layer's parameter record (`Layer`), so that forward/backward address tensors by field."""

    LAYER_FIELDS: dict = {}

    def __init__(self, cfg):
        self.cfg = cfg

    # -- activations (the workspace and the memory plan read the same table)
    def workspace_table(self, B: int, L: int, grad: bool, mixed: bool) -> dict:
        """name -> (shape, dtype, per_layer) of the layers' buffers for one (B, L): per-layer
        buffers are kept for every layer when `grad` (else one set, shared), others are one
        buffer shared by all layers; per_layer may be a list of layer indices (a hybrid's
        buffers of one layer kind): then those layers' only, `ws.<name>[i]` None elsewhere.  `mixed`: the f16 copies the products read."""
        raise NotImplementedError

    def d16_elems(self, M: int) -> int:
        """The largest output gradient (elements) the layers cast to f16 (mixed precision)."""
        return 0

    def finish_workspace(self, ws) -> None:
        """Aliases among the workspace's buffers (a variant that needs no buffer of its own)."""

    # -- the layers
    def forward(self, rec, model, ws, i: int, *, train: bool) -> None:
        """Layer i: ws.h[i + 1] = ws.h[i] + mixer(norm(ws.h[i])), activations kept in `ws`."""
        raise NotImplementedError

    def backward(self, rec, model, ws, i: int, grad) -> None:
        """Layer i backward: ws.dh holds d loss / d h[i + 1] and becomes d loss / d h[i];
        `grad(name)` is the gradient view of tensor `name` when it trains, else None."""
        raise NotImplementedError

    # -- recurrent decoding (batch 1)
    def decode_state(self, rt):
        """(state, tensors): the step's buffers and every layer's recurrent state, in an
        object the two calls below receive, and the tensors made, for the decoder to give
        back to the runtime."""
        raise NotImplementedError

    def decode_prefill(self, rec, model, state, ws, i: int, L: int) -> None:
        """Layer i's recurrent state after a prompt of L tokens, from its activations in `ws`
        (called right after that layer's forward)."""
        raise NotImplementedError

    def decode_step(self, rec, model, state, i: int, h) -> None:
        """Layer i's step on the residual h [E] (in place), with its recurrent state."""
        raise NotImplementedError


@dataclass
class Layer:
    """A layer's parameter views by field (fields the checkpoint lacks are None)."""

    fields: dict

    def __getattr__(self, name: str):
        try:
            return self.__dict__["fields"][name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass
class Params:
    embeddings: Any                     # [V, E]
    layers: list                        # [Layer] * n_layers
    norm_f: Any                         # [E]
    lm_head: Any                        # [V, E] when untied (else the embeddings)


class Architecture:
    """One family of checkpoints.  Subclasses set the class attributes and implement the
    methods that raise NotImplementedError; the defaults suit a pre-norm LM whose layer
    tensors are named `{LAYER_PREFIX}{i}.{suffix}`."""

    name: str = ""                       # shown by `info`
    model_types: dict = {}               # config.json model_type -> transformers class
    EMBEDDINGS = "backbone.embeddings.weight"
    FINAL_NORM = "backbone.norm_f.weight"
    HEAD = "lm_head.weight"
    LAYER_PREFIX = "backbone.layers."
    ALIASES: dict = {}                   # other names of a tensor in some checkpoints -> ours
    lora_targets: tuple = ()             # the layers a LoRA adapter may adapt, in order
    lora_refused: dict = {}              # layer -> why a LoRA adapter may not adapt it
    wsla_scope: str = ""                 # what `adapt` trains, in words (info, adapt --help)
    precisions: tuple = ("fp32", "mixed")  # the --precision values its block runs

    # -- config
    def config_from_dict(self, d: dict, source: str):
        raise NotImplementedError

    def infer_config(self, shapes: dict):
        """A config from tensor name -> shape alone (a bare safetensors file)."""
        raise NotImplementedError

    def named_configs(self) -> dict:
        """Built-in shapes this architecture offers to `init` by name: {} (configs/ holds files)."""
        return {}

    # -- tensors
    def iter_shapes(self, cfg) -> Iterator[tuple[str, tuple]]:
        """(name, shape) of every tensor in checkpoint order, one at a time (a config may
        claim 10^9 layers: a check stops at the first bad one)."""
        raise NotImplementedError

    def shapes(self, cfg) -> dict:
        return dict(self.iter_shapes(cfg))

    def gpu_shape(self, name: str, shape: tuple) -> tuple:
        """The shape a tensor has on the GPU (a checkpoint may hold singleton dims)."""
        return tuple(shape)

    def missing_hint(self, cfg, name: str) -> str:
        """Why a tensor the config implies may be missing (a config key to look at), or ''."""
        return ""

    def shape_refusal(self, cfg, name: str, shape: tuple) -> str:
        """Why a tensor of this shape (not the config's) is a model variant not supported
        here, in one line, or '' (then the shape mismatch itself is reported)."""
        return ""

    def init_weights(self, cfg, seed: int) -> dict:
        raise NotImplementedError

    def check_kernel_limits(self, cfg, source: str | None = None) -> None:
        """Refuse a shape the GPU kernels cannot run, before any upload."""

    # -- the shell's multipliers (Granite's; 1 for the others)
    def embedding_scale(self, cfg) -> float:
        """h[0] = embedding_scale * embeddings[ids]."""
        return 1.0

    def logits_scale(self, cfg) -> float:
        """logits = logits_scale * lm_head(norm_f(h)) (Granite: 1 / logits_scaling)."""
        return 1.0

    # -- training
    def wsla_names(self, cfg, names: list) -> list:
        """The tensors `adapt` (WSLA) trains, among `names`."""
        raise NotImplementedError

    def wsla_rows(self, cfg, name: str):
        """(first row, rows) of tensor `name` that `adapt` trains when only a row range of it
        does (the others then stay bit-identical), else None (the whole tensor)."""
        return None

    def lora_dims(self, cfg, target: str) -> tuple[int, int]:
        """(in_features, out_features) of a LoRA target layer."""
        raise NotImplementedError

    def lora_module(self, cfg, layer: int, target: str):
        """Where layer `layer` holds the LoRA target `target`, after the layer prefix (the
        adapter's tensor names: `{LAYER_PREFIX}{layer}.{module}.lora_A.weight`), or None
        when that layer has no such module (a hybrid's layers of the other kind)."""
        return f"mixer.{target}"

    def block(self, cfg) -> Block:
        raise NotImplementedError

    # -- the memory plan (engine/app/plan.py sums these with the shell's own)
    def products(self, cfg, M: int, grad: bool) -> set:
        """(M, N, K) of every matrix product a step of M rows makes in the layers."""
        return set()

    def plan_scratch(self, lim, cfg, B: int, L: int, kind: str, mixed: bool = False) -> int:
        """Bytes of the layers' kernel scratch for a `kind` run (eval, train, adapt, lora);
        `mixed`: under --precision mixed."""
        return 0

    def plan_units(self, cfg, B: int, L: int, grad: bool, sequence: str = "at --seq-len {}") -> list:
        """(what, bytes, grows with B x L, "tensor" | "adapter") of the layers' units of work
        that must each fit one storage binding (the model's limit, or the adapter's own);
        `sequence` names a sequence's length (`sequence.format(L)`) as the caller's user knows it."""
        return []

    # -- export
    def gguf(self):
        """The architecture's GGUF mapping for llama.cpp (a module or object with `ARCH`,
        `check_runnable(cfg)`, `gguf_tensors(cfg, tensors)`, `add_metadata(writer, cfg)`,
        `describe(cfg)`; engine/io/gguf.py writes the file, its F32 rule and the tied head)."""
        raise MemengineError(f"export: llama.cpp has no mapping of the {self.name or 'this'} architecture here")

    # -- shared arithmetic
    def n_params(self, cfg) -> int:
        return sum(math.prod(s) for _, s in self.iter_shapes(cfg))

    def describe(self, cfg) -> list:
        """(label, value) rows of the shape, as `info` shows them."""
        return [("layers", cfg.num_hidden_layers), ("hidden size (E)", cfg.hidden_size),
                ("vocabulary (V)", cfg.vocab_size), ("tied lm_head", cfg.tie_word_embeddings)]

    def summary(self, cfg) -> list:
        """(label, value) rows of the shape, as `init` shows them."""
        return [("layers", cfg.num_hidden_layers), ("hidden size", cfg.hidden_size), ("vocabulary", cfg.vocab_size)]


def refuse(source: str, key: str, value, why: str) -> MemengineError:
    return MemengineError(f"{source}: '{key}' {why} (got {value!r})")
