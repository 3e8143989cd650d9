"""A minimal architecture defined outside the engine: a causal-convolution language model.

It proves the architecture seam (engine/models/base.py): nothing of it is in engine/, it
registers itself through the public registry (`engine.models.register`; the CLI finds the
module through MEMENGINE_MODELS), and init, train, eval and generate run it through the
engine's own shell and kernels.  Per layer, on the residual h [M, E] (D = inner size):

    u = rmsnorm(h);  x = u @ in_proj^T  [M, D];  c = silu(causal_conv_K(x))
    h = h + c @ out_proj^T

The recurrence is the convolution's window: the decode step keeps each layer's last K-1
inputs (the conv state).  `numpy_logits` is the same model in numpy (float64), the oracle
of test_architecture_seam.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from types import SimpleNamespace

import numpy as np
from memengine.engine import models
from memengine.engine.errors import MemengineError
from memengine.engine.kernels import conv1d
from memengine.engine.kernels.conv1d import conv1d_backward, conv1d_forward
from memengine.engine.kernels.decode import conv_prefill, conv_step, matvec
from memengine.engine.kernels.matmul import linear_backward, linear_forward
from memengine.engine.kernels.rmsnorm import rmsnorm_backward, rmsnorm_forward
from memengine.engine.models.base import Architecture, Block

MODEL_TYPE = "toy_conv"


@dataclass(eq=False)
class ToyConfig:
    vocab_size: int = 300
    hidden_size: int = 32          # E
    inner_size: int = 48           # D
    conv_kernel: int = 4           # K
    num_hidden_layers: int = 2
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = True
    initializer_range: float = 0.2
    eos_token_id: int | None = None
    model_type: str = MODEL_TYPE

    @classmethod
    def from_dict(cls, d: dict, source: str) -> "ToyConfig":
        names = {f.name for f in fields(cls)}
        cfg = cls(**{k: v for k, v in d.items() if k in names})
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config") -> None:
        for key in ("vocab_size", "hidden_size", "inner_size", "conv_kernel", "num_hidden_layers"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise MemengineError(f"{source}: '{key}' must be a positive integer (got {v!r})")

    def to_hf_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_json(self) -> str:
        import json

        return json.dumps(self.to_hf_dict(), indent=2, sort_keys=True) + "\n"


class ToyBlock(Block):
    LAYER_FIELDS = {"norm.weight": "norm", "in_proj.weight": "w_in", "conv.weight": "w_conv",
                    "out_proj.weight": "w_out"}

    def __init__(self, cfg):
        super().__init__(cfg)
        self.E, self.D, self.K = cfg.hidden_size, cfg.inner_size, cfg.conv_kernel

    def workspace_table(self, B, L, grad, mixed):
        M, E, D = B * L, self.E, self.D
        t = {"un": ((M, E), "f32", True), "rstd": ((M,), "f32", True),
             # in_proj writes x into the first D columns of xz, the conv kernels' [x ; z] layout
             "xz": ((M, 2 * D), "f32", True), "pre": ((M, D), "f32", True), "xc": ((M, D), "f32", True)}
        if grad:
            t.update({"dxc": ((M, D), "f32", False), "dxz": ((M, 2 * D), "f32", False), "dun": ((M, E), "f32", False)})
        return t

    def forward(self, rec, model, ws, i, *, train):
        E, D, K, M, B, L = self.E, self.D, self.K, ws.M, ws.B, ws.L
        lp = model.params.layers[i]
        rmsnorm_forward(rec, ws.un[i], ws.rstd[i], ws.h[i], lp.norm, self.cfg.layer_norm_epsilon, copy=ws.h[i + 1])
        linear_forward(rec, ws.xz[i], ws.un[i], lp.w_in, None, M=M, N=D, K=E, ldo=2 * D)
        conv1d_forward(rec, ws.xc[i], ws.pre[i], ws.xz[i], lp.w_conv, None, B=B, L=L, Di=D, K=K)
        linear_forward(rec, ws.h[i + 1], ws.xc[i], lp.w_out, None, M=M, N=E, K=D, acc=True)

    def backward(self, rec, model, ws, i, grad):
        E, D, K, M, B, L = self.E, self.D, self.K, ws.M, ws.B, ws.L
        lp = model.params.layers[i]
        pre = f"{model.arch.LAYER_PREFIX}{i}."
        linear_backward(rec, ws.dxc, grad(pre + "out_proj.weight"), None, ws.dh, ws.xc[i], lp.w_out, M=M, N=E, K=D)
        conv1d_backward(rec, ws.dxz, grad(pre + "conv.weight"), None, ws.dxc, ws.pre[i], ws.xz[i], lp.w_conv,
                        B=B, L=L, Di=D, K=K)
        linear_backward(rec, ws.dun, grad(pre + "in_proj.weight"), None, ws.dxz, ws.un[i], lp.w_in, M=M, N=D, K=E,
                        lddo=2 * D)
        rmsnorm_backward(rec, ws.dh, grad(pre + "norm.weight"), ws.dun, ws.h[i], lp.norm, ws.rstd[i])

    def decode_state(self, rt):
        E, D, K = self.E, self.D, self.K
        st = SimpleNamespace(un=rt.empty((E,)), rstd=rt.empty((1,)), xz=rt.zeros((2 * D,)), xc=rt.empty((D,)))
        st.conv = [rt.empty((max(K - 1, 1), D)) for _ in range(self.cfg.num_hidden_layers)]
        return st, [st.un, st.rstd, st.xz, st.xc] + st.conv

    def decode_prefill(self, rec, model, st, ws, i, L):
        conv_prefill(rec, st.conv[i], ws.xz[i], L=L, Di=self.D, K=self.K)

    def decode_step(self, rec, model, st, i, h):
        E, D, K = self.E, self.D, self.K
        lp = model.params.layers[i]
        rmsnorm_forward(rec, st.un, st.rstd, h, lp.norm, self.cfg.layer_norm_epsilon)
        matvec(rec, st.xz.view((D,)), lp.w_in, st.un, rows=D, K=E)
        conv_step(rec, st.xc, st.conv[i], st.xz, lp.w_conv, None, Di=D, K=K)
        matvec(rec, h, lp.w_out, st.xc, rows=E, K=D, acc=True)


class ToyConv(Architecture):
    name = "toy causal-conv LM"
    model_types = {MODEL_TYPE: None}
    EMBEDDINGS, FINAL_NORM, HEAD, LAYER_PREFIX = "model.embed.weight", "model.norm.weight", "lm_head.weight", "model.layers."
    wsla_scope = "each layer's in_proj"

    def config_from_dict(self, d, source):
        return ToyConfig.from_dict(d, source)

    def iter_shapes(self, cfg):
        V, E, D, K = cfg.vocab_size, cfg.hidden_size, cfg.inner_size, cfg.conv_kernel
        yield self.EMBEDDINGS, (V, E)
        for i in range(cfg.num_hidden_layers):
            p = f"{self.LAYER_PREFIX}{i}."
            yield p + "norm.weight", (E,)
            yield p + "in_proj.weight", (D, E)
            yield p + "conv.weight", (D, 1, K)
            yield p + "out_proj.weight", (E, D)
        yield self.FINAL_NORM, (E,)
        if not cfg.tie_word_embeddings:
            yield self.HEAD, (V, E)

    def gpu_shape(self, name, shape):
        return (shape[0], shape[2]) if name.endswith("conv.weight") else tuple(shape)

    def init_weights(self, cfg, seed):
        rng = np.random.default_rng(seed)
        out = {}
        for name, shape in self.iter_shapes(cfg):
            if name.endswith("norm.weight"):
                out[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            elif name.endswith("conv.weight"):
                b = 1 / math.sqrt(cfg.conv_kernel)
                out[name] = rng.uniform(-b, b, shape).astype(np.float32)
            else:
                out[name] = (cfg.initializer_range * rng.standard_normal(shape)).astype(np.float32)
        return out

    def wsla_names(self, cfg, names):
        return [n for n in names if n.endswith(".in_proj.weight")]

    def block(self, cfg):
        return ToyBlock(cfg)

    def products(self, cfg, M, grad):
        E, D = cfg.hidden_size, cfg.inner_size
        out = {(M, D, E), (M, E, D)}
        return out | ({(M, E, D), (M, D, E), (E, D, M), (D, E, M)} if grad else set())

    def plan_scratch(self, lim, cfg, B, L, kind, mixed=False):
        D, K = cfg.inner_size, cfg.conv_kernel
        if kind == "train":
            return 4 * conv1d.partial_rows(B, L) * D * (K + 1) + 4 * D * K + 8 * D
        return 4 * D if kind != "eval" else 0

    def plan_units(self, cfg, B, L, grad, sequence="at --seq-len {}"):
        return [(f"one sequence of the conv {sequence.format(L)}", 4 * L * 2 * cfg.inner_size, True, "tensor")]


def numpy_logits(cfg: ToyConfig, w: dict, ids: np.ndarray) -> np.ndarray:
    """The model in float64 numpy: logits [L, V] of one sequence."""
    a = ToyConv()
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    h = w[a.EMBEDDINGS][ids]
    K = cfg.conv_kernel

    def norm(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.layer_norm_epsilon) * g

    for i in range(cfg.num_hidden_layers):
        p = f"{a.LAYER_PREFIX}{i}."
        x = norm(h, w[p + "norm.weight"]) @ w[p + "in_proj.weight"].T
        cw = w[p + "conv.weight"][:, 0, :]
        xp = np.concatenate([np.zeros((K - 1, x.shape[1])), x])
        c = sum(xp[k:k + len(x)] * cw[:, k] for k in range(K))
        c = c / (1 + np.exp(-c))
        h = h + c @ w[p + "out_proj.weight"].T
    head = w.get(a.HEAD, w[a.EMBEDDINGS])
    return norm(h, w[a.FINAL_NORM]) @ head.T


models.register(ToyConv())
