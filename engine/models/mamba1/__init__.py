"""Mamba-1 (`mamba`, MambaForCausalLM) and Falcon-Mamba (`falcon_mamba`,
FalconMambaForCausalLM): one architecture, the Falcon variant a flag of its config
(weightless RMS norms on dt_low, B and C; config.py, block.py).

Everything the engine needs of it is here: the config (config.py), the tensor table and
initialisation (config.py, init.py), the layer's forward, backward and decode step
(block.py), the LoRA targets, the WSLA set (every layer's x_proj: the selection) and the
memory plan's tables of its products, kernel scratch and units of work.
"""

from __future__ import annotations

import re

from memengine.engine import models
from memengine.engine.errors import MemengineError
from memengine.engine.kernels import conv1d, scan
from memengine.engine.models.base import Architecture
from memengine.engine.models.mamba1.config import MODEL_TYPES, MambaConfig, check_kernel_limits, iter_expected_shapes
from memengine.engine.runtime import BindingError, split

_LAYER = re.compile(r"backbone\.layers\.(\d{1,9})\.")  # a longer index is no layer of a loadable model


def _buf(nbytes: int) -> int:
    """Bytes `Runtime.empty` allocates for nbytes (16-byte multiples)."""
    return max(16, (int(nbytes) + 15) // 16 * 16)


class Mamba1(Architecture):
    name = "Mamba-1"
    model_types = MODEL_TYPES
    ALIASES = {"backbone.embedding.weight": "backbone.embeddings.weight"}
    lora_targets = ("in_proj", "x_proj")
    lora_refused = {
        "out_proj": "PEFT refuses LoRA on out_proj in Mamba models (the fused kernels bypass the module)",
        "conv1d": "PEFT refuses LoRA on conv1d in Mamba models (the fused kernels bypass the module)",
        "dt_proj": "transformers' Mamba multiplies by dt_proj.weight directly, so a PEFT adapter on it has no effect",
    }
    wsla_scope = "each layer's x_proj (the projection producing dt, B and C: the selection)"

    # -- config
    def config_from_dict(self, d: dict, source: str) -> MambaConfig:
        return MambaConfig.from_dict(d, source)

    def infer_config(self, shapes: dict) -> MambaConfig:
        """A MambaConfig from tensor name -> shape (HF names; the embedding alias accepted)."""
        shapes = {self.ALIASES.get(k, k): tuple(v) for k, v in shapes.items()}

        def need(name: str, ndim: int) -> tuple[int, ...]:
            if name not in shapes:
                raise MemengineError(f"cannot infer the model shape: tensor '{name}' is missing")
            s = shapes[name]
            if len(s) != ndim:
                raise MemengineError(
                    f"cannot infer the model shape: tensor '{name}' has shape {list(s)}, expected {ndim} dims")
            return s

        V, E = need("backbone.embeddings.weight", 2)
        layer_ids = {int(m.group(1)) for k in shapes if (m := _LAYER.match(k))}
        if not layer_ids:
            raise MemengineError("cannot infer the model shape: no 'backbone.layers.N.*' tensors")
        n_layers = max(layer_ids) + 1
        if len(layer_ids) != n_layers:  # the first gap is at most len(layer_ids)
            gap = next(i for i in range(len(layer_ids) + 1) if i not in layer_ids)
            raise MemengineError(f"cannot infer the model shape: layer {gap} has no tensors "
                                 f"('backbone.layers.{gap}.*') though layer {n_layers - 1} has")
        p = "backbone.layers.0.mixer."
        two_di, e2 = need(p + "in_proj.weight", 2)
        Di = two_di // 2
        if two_di % 2 or e2 != E or Di % E:
            raise MemengineError(
                f"cannot infer the model shape: in_proj.weight {[two_di, e2]} is not [2*expand*E, E] with E={E}")
        di2, N = need(p + "A_log", 2)
        di3, one, K = need(p + "conv1d.weight", 3)
        di4, R = need(p + "dt_proj.weight", 2)
        if not (di2 == di3 == di4 == Di) or one != 1:
            raise MemengineError("cannot infer the model shape: A_log / conv1d / dt_proj disagree on the inner size")
        cfg = MambaConfig(
            vocab_size=V, hidden_size=E, state_size=N, num_hidden_layers=n_layers, expand=Di // E,
            conv_kernel=K, time_step_rank=R, use_bias=(p + "in_proj.bias") in shapes,
            use_conv_bias=(p + "conv1d.bias") in shapes, tie_word_embeddings="lm_head.weight" not in shapes,
        )
        if cfg.dt_rank == -(-E // 16):
            cfg.time_step_rank = "auto"
        return cfg

    # -- tensors
    def iter_shapes(self, cfg):
        return iter_expected_shapes(cfg)

    def gpu_shape(self, name: str, shape: tuple) -> tuple:
        # conv1d weight is stored [Di, 1, K] in the checkpoint, [Di, K] on the GPU
        return tuple(shape[:1]) + tuple(shape[2:]) if name.endswith("conv1d.weight") else tuple(shape)

    def missing_hint(self, cfg, name: str) -> str:
        if name.endswith(".bias") and (".in_proj." in name or ".out_proj." in name):
            return " (config has use_bias=true)"
        if name.endswith("conv1d.bias"):
            return " (config has use_conv_bias=true)"
        return ""

    def init_weights(self, cfg, seed: int) -> dict:
        from memengine.engine.models.mamba1.init import init_weights

        return init_weights(cfg, seed)

    def check_kernel_limits(self, cfg, source: str | None = None) -> None:
        check_kernel_limits(cfg, source)

    def n_params(self, cfg) -> int:
        return cfg.n_params

    # -- training
    def wsla_names(self, cfg, names: list) -> list:
        return [n for n in names if ".mixer.x_proj." in n]

    def lora_dims(self, cfg, target: str) -> tuple[int, int]:
        E, Di, N, R = cfg.hidden_size, cfg.intermediate_size, cfg.state_size, cfg.dt_rank
        return {"in_proj": (E, 2 * Di), "x_proj": (Di, R + 2 * N)}[target]

    def block(self, cfg):
        from memengine.engine.models.mamba1.block import Mamba1Block

        return Mamba1Block(cfg)

    # -- the memory plan
    @staticmethod
    def _linears(cfg) -> list:
        """(out features, in features) of every linear layer of one Mamba layer."""
        E, Di, N, R = cfg.hidden_size, cfg.intermediate_size, cfg.state_size, cfg.dt_rank
        return [(2 * Di, E), (R + 2 * N, Di), (Di, R), (E, Di)]

    def products(self, cfg, M: int, grad: bool) -> set:
        out = {(M, o, i) for o, i in self._linears(cfg)}
        if grad:
            out |= {(M, i, o) for o, i in self._linears(cfg)} | {(o, i, M) for o, i in self._linears(cfg)}
        return out

    def plan_scratch(self, lim, cfg, B: int, L: int, kind: str, mixed: bool = False) -> int:
        Di, N, R, K = cfg.intermediate_size, cfg.state_size, cfg.dt_rank, cfg.conv_kernel
        grad = kind != "eval"
        total = 0
        db = scan.channels_per_workgroup(lim.lanes and lim.kernels.scan_lanes, N)
        try:
            seqs = split(lim, B, lambda nb: scan.sequence_windows(nb, L, Di, N, R),
                         scratch=lambda nb: scan.sequence_scratch(nb, L, Di, N, R, db, grad))
        except BindingError:
            seqs = [(0, 1)]
        for nb in sorted({nb for _, nb in seqs}):
            _, work = scan.sequence_scratch(nb, L, Di, N, R, db)
            total += _buf(work) if grad else 0
        total += _buf(scan.sequence_scratch(1, L, Di, N, R)[0])  # the forward's parameter copy, any B
        if kind == "train":  # the conv's weight gradients (adapt and LoRA compute none)
            nch = conv1d.partial_rows(B, L)
            total += _buf(4 * nch * Di * (K + 1)) + _buf(4 * Di * K) + _buf(4 * Di)
        elif grad:  # the conv1d backward's unused partials binding
            total += _buf(4 * Di)
        return total

    def plan_units(self, cfg, B: int, L: int, grad: bool, sequence: str = "at --seq-len {}") -> list:
        Di, N, R = cfg.intermediate_size, cfg.state_size, cfg.dt_rank
        return [(f"one sequence of the conv1d and selective scan {sequence.format(L)} ({L} x {2 * Di} values)",
                 max(scan.sequence_windows(1, L, Di, N, R)), True, "tensor"),
                (f"the selective scan's scratch for one sequence {sequence.format(L)}",
                 max(scan.sequence_scratch(1, L, Di, N, R, backward=grad)), True, "adapter")]

    def gguf(self):
        from memengine.engine.models.mamba1 import gguf

        return gguf

    def describe(self, cfg) -> list:
        return [("layers", cfg.num_hidden_layers), ("hidden size (E)", cfg.hidden_size),
                ("inner size (Di)", cfg.intermediate_size), ("state size (N)", cfg.state_size),
                ("conv kernel (K)", cfg.conv_kernel), ("dt rank (R)", cfg.dt_rank), ("vocabulary (V)", cfg.vocab_size),
                ("tied lm_head", cfg.tie_word_embeddings),
                ("biases", f"use_bias={cfg.use_bias} use_conv_bias={cfg.use_conv_bias}")]

    def summary(self, cfg) -> list:
        return [("layers", cfg.num_hidden_layers), ("hidden size", cfg.hidden_size), ("state size", cfg.state_size),
                ("vocabulary", cfg.vocab_size)]


ARCH = Mamba1()
models.register(ARCH)
