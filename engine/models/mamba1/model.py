"""Mamba-1 (S6) language model on the GPU: parameters, forward and backward.

Names are the checkpoint's (`in_proj`, `x_proj`, `dt_proj`, `A_log`, `D`); see the
glossary in DEVELOPERS.md for the letters.  The computation is exactly SPEC section 2
(transformers' MambaForCausalLM slow path):

    h = embeddings[ids]
    per layer:  u = rmsnorm(h); xz = in_proj(u); xc = silu(conv(x)); xdbl = x_proj(xc)
                delta = dt_proj.weight @ dt_low; y = scan(xc, delta, A_log, B, C, D, z)
                h = h + out_proj(y)
    logits = lm_head(rmsnorm(h))          loss = mean CE(logits, targets)

falcon_mamba (`FalconMambaForCausalLM`) differs in one place: dt_low, B and C (the three
column slices of xdbl) each pass a weightless RMS norm (eps `mixer_rms_eps`) before dt_proj
and the scan use them; the normalised copy is `xdbl_n` (for mamba the same buffer as xdbl).

All parameters live in flat f32 buffers (`FlatStore`: one, or several when the model is
larger than the adapter's largest buffer), all gradients in a store of the same layout (the
same dataclass of views, made on first use), so the gradients are cleared with one command
per buffer and the optimizer addresses both by name.

--precision mixed (`set_precision("mixed")`): every matmul whose shape suits the fast
kernel multiplies f16 operands with f32 accumulation (shaders/matmul_f16.wgsl).  The
operands are f16 copies: of the parameters (`P16`, segments of the same layout as `P`,
cast from the f32 master weights at the start of each forward, so after every optimizer
step), of the activations that feed a matmul (un, xc, xdbl_n, y, hf: cast after their
producer and kept for the weight gradients) and of each output gradient (cast into one
scratch buffer just before its two products).  Everything else stays f32: the embedding,
norms, conv, scan, cross-entropy, the gradients and their reductions, AdamW and its
moments.  The loss gradient is multiplied by `loss_scale` (GPU, set by the trainer's
LossScaler) so that small gradients survive f16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from memengine.engine.errors import MemengineError
from memengine.engine.kernels.conv1d import conv1d_backward, conv1d_forward
from memengine.engine.kernels.cross_entropy import cross_entropy
from memengine.engine.kernels.embedding import EmbeddingBackward, embedding_forward
from memengine.engine.kernels.matmul import cast_f16, linear_backward, linear_forward
from memengine.engine.kernels.reduce import sum_into
from memengine.engine.kernels.rmsnorm import rmsnorm_backward, rmsnorm_forward
from memengine.engine.kernels.scan import scan_state_shape, selective_scan_backward, selective_scan_forward
from memengine.engine.models.mamba1.config import MambaConfig, check_kernel_limits, expected_shapes
from memengine.engine.runtime import Recorder, Runtime, Tensor, fmt_bytes


@dataclass
class LayerParams:
    norm_weight: Tensor                 # [E]
    in_proj_weight: Tensor              # [2Di, E]   rows [x ; z]
    in_proj_bias: Tensor | None         # [2Di]      when use_bias
    conv1d_weight: Tensor               # [Di, K]    (checkpoint [Di, 1, K])
    conv1d_bias: Tensor | None          # [Di]       when use_conv_bias
    x_proj_weight: Tensor               # [R+2N, Di]
    dt_proj_weight: Tensor              # [Di, R]
    dt_proj_bias: Tensor                # [Di]
    A_log: Tensor                       # [Di, N]
    D: Tensor                           # [Di]
    out_proj_weight: Tensor             # [E, Di]
    out_proj_bias: Tensor | None        # [E]        when use_bias


@dataclass
class Params:
    embeddings: Tensor                  # [V, E]
    layers: list                        # [LayerParams] * n_layers
    norm_f: Tensor                      # [E]
    lm_head: Tensor | None              # [V, E] when untied (else the embeddings)


_LAYER_FIELDS = {
    "norm.weight": "norm_weight",
    "mixer.in_proj.weight": "in_proj_weight",
    "mixer.in_proj.bias": "in_proj_bias",
    "mixer.conv1d.weight": "conv1d_weight",
    "mixer.conv1d.bias": "conv1d_bias",
    "mixer.x_proj.weight": "x_proj_weight",
    "mixer.dt_proj.weight": "dt_proj_weight",
    "mixer.dt_proj.bias": "dt_proj_bias",
    "mixer.A_log": "A_log",
    "mixer.D": "D",
    "mixer.out_proj.weight": "out_proj_weight",
    "mixer.out_proj.bias": "out_proj_bias",
}


def store_layout(shapes: dict, align: int, max_bytes: int) -> tuple[dict, list]:
    """Where each tensor of a FlatStore goes: ({name: (segment, element offset)}, [segment
    sizes in elements]).  Views start on the storage-offset alignment (`align` elements);
    a new segment (buffer) starts when the next tensor would pass `max_bytes`.  A tensor
    larger than `max_bytes` is refused (one buffer must hold it)."""
    where: dict = {}
    sizes = [0]
    for name, shape in shapes.items():
        n = int(np.prod(shape)) if len(shape) else 1
        if 4 * n > max_bytes:
            raise MemengineError(
                f"tensor {name} needs {fmt_bytes(4 * n)} in one GPU buffer but the adapter's largest "
                f"buffer is {fmt_bytes(max_bytes)}")
        off = (sizes[-1] + align - 1) // align * align
        if 4 * (off + n) > max_bytes:
            sizes.append(0)
            off = 0
        where[name] = (len(sizes) - 1, off)
        sizes[-1] = off + n
    return where, [max(n, 1) for n in sizes]


class FlatStore:
    """Named views into flat f32 buffers (segments), each view aligned for binding.

    Usually one segment; a model larger than the adapter's largest buffer gets several
    (`store_layout`).  Parameters and gradients share the layout, so the optimizer and the
    gradient clear address both by name / segment."""

    def __init__(self, rt: Runtime, shapes: dict, label: str):
        self.rt = rt
        self.shapes = {n: tuple(s) for n, s in shapes.items()}
        self.where, sizes = store_layout(self.shapes, rt.storage_align // 4, rt.max_buffer)
        self.segments = [Tensor(rt.create_buffer(4 * n, f"{label}{i}"), (n,), "f32", 0, f"{label}{i}")
                         for i, n in enumerate(sizes)]
        self.views = {name: Tensor(self.segments[seg].buffer, shape, "f32", 4 * off, name)
                      for name, shape in self.shapes.items() for seg, off in [self.where[name]]}

    def clear(self, rec: Recorder) -> None:
        for t in self.segments:
            rec.clear(t)

    def drop(self) -> None:
        """The store is no longer used: its buffers leave the runtime's allocation count."""
        for t in self.segments:
            self.rt.forget(t.buffer)

    def write(self, tensors: dict) -> None:
        """Upload every tensor (host arrays by name), one segment at a time."""
        for i, seg in enumerate(self.segments):
            flat = np.zeros(seg.numel, np.float32)
            for name, (s, off) in self.where.items():
                if s == i:
                    a = np.asarray(tensors[name], dtype=np.float32).reshape(-1)
                    flat[off:off + a.size] = a
            self.rt.write(seg, flat)

    def read(self) -> dict:
        """Every tensor, read back (one readback per segment)."""
        out = {}
        for i, seg in enumerate(self.segments):
            flat = self.rt.read(seg)
            for name, (s, off) in self.where.items():
                if s == i:
                    shape = self.shapes[name]
                    n = int(np.prod(shape)) if len(shape) else 1
                    out[name] = flat[off:off + n].copy()
            del flat
        return out


def _structured(cfg: MambaConfig, views: dict) -> Params:
    layers = []
    for i in range(cfg.num_hidden_layers):
        kw = {f: None for f in _LAYER_FIELDS.values()}
        for suffix, field in _LAYER_FIELDS.items():
            kw[field] = views.get(f"backbone.layers.{i}.{suffix}")
        layers.append(LayerParams(**kw))
    return Params(embeddings=views.get("backbone.embeddings.weight"), layers=layers,
                  norm_f=views.get("backbone.norm_f.weight"), lm_head=views.get("lm_head.weight"))


def logits_chunk_rows(max_binding: int, M: int, V: int) -> int:
    """Rows of logits produced at once: one chunk fits one storage binding (and 256 MiB)."""
    rows = max(1, min(max_binding, 256 * 2**20) // (4 * V))
    if rows < M:  # whole 128-row tiles keep every chunk on the fast matmul path
        rows = rows // 128 * 128 if rows >= 128 else max(1, rows // 4 * 4)
    return min(M, rows)


# Activations of one (B, L): name -> (features per row or a shape function, dtype, per layer).
# Per-layer tensors have one copy per layer when kept for a backward, else one shared by
# all layers (evaluation); h has layers + 1 (else 2, alternating).
def workspace_shapes(cfg: MambaConfig, B: int, L: int, grad: bool, max_binding: int,
                     mixed: bool = False) -> dict:
    """name -> (shape, dtype, copies) of every buffer a Workspace allocates (the memory plan
    sums the same table).  `mixed`: the f16 copies of --precision mixed too."""
    E, Di, N, R, V = cfg.hidden_size, cfg.intermediate_size, cfg.state_size, cfg.dt_rank, cfg.vocab_size
    M, nl = B * L, cfg.num_hidden_layers
    per = nl if grad else 1
    t = {
        "ids": ((M,), "i32", 1), "targets": ((M,), "i32", 1), "loss_scale": ((1,), "f32", 1),
        "loss_rows": ((M,), "f32", 1),
        "h": ((M, E), "f32", nl + 1 if grad else 2),
        "un": ((M, E), "f32", per), "rstd": ((M,), "f32", per), "xz": ((M, 2 * Di), "f32", per),
        "pre": ((M, Di), "f32", per), "xc": ((M, Di), "f32", per), "xdbl": ((M, R + 2 * N), "f32", per),
        "delta": ((M, Di), "f32", per), "y": ((M, Di), "f32", per),
        "states": (scan_state_shape(B, L, Di, N), "f32", per),
        "rstd_f": ((M,), "f32", 1), "hf": ((M, E), "f32", 1),
        "logits": ((logits_chunk_rows(max_binding, M, V), V), "f32", 1),
    }
    if cfg.is_falcon:  # the normalised dt_low/B/C and the three norms' rstd
        t.update({"xdbl_n": ((M, R + 2 * N), "f32", per), "mixer_rstd": ((3 * M,), "f32", per)})
    if grad:  # backward scratch shared by all layers, the embedding's scatter plan
        t.update({"dh": ((M, E), "f32", 1), "dhf": ((M, E), "f32", 1),
                  "du": ((M, Di), "f32", 1), "ddelta": ((M, Di), "f32", 1),
                  "dxdbl": ((M, R + 2 * N), "f32", 1), "dxz": ((M, 2 * Di), "f32", 1),
                  "dun": ((M, E), "f32", 1), "ones": ((M,), "f32", 1),
                  "embedding_csr": ((EmbeddingBackward.csr_size(M),), "i32", 1)})
        if cfg.is_falcon:
            t["dxdbl_raw"] = ((M, R + 2 * N), "f32", 1)
    if mixed:  # f16 copies of the matmul inputs; one f16 scratch for an output gradient
        t.update({"un16": ((M, E), "f16", per), "xc16": ((M, Di), "f16", per),
                  "xdbl16": ((M, R + 2 * N), "f16", per), "y16": ((M, Di), "f16", per),
                  "hf16": ((M, E), "f16", 1)})
        if grad:
            chunk = t["logits"][0][0]
            t["d16"] = ((max(M * 2 * Di, M * (R + 2 * N), M * E, chunk * V),), "f16", 1)
    return t


class Workspace:
    """Activations for one (B, L): allocated once.  With grad, every layer's are kept for
    the backward; without (evaluation), the layers share one set."""

    PER_LAYER = ("un", "rstd", "xz", "pre", "xc", "xdbl", "delta", "y", "states")

    def __init__(self, model: "MambaModel", B: int, L: int, grad: bool = True):
        rt, c = model.rt, model.cfg
        M, nl = B * L, c.num_hidden_layers
        self.B, self.L, self.M, self.grad = B, L, M, grad
        self.mixed = model.mixed
        shapes = workspace_shapes(c, B, L, grad, rt.max_binding, self.mixed)
        made = {name: [rt.empty(shape, dtype, name=f"{name}{i}") for i in range(copies)]
                for name, (shape, dtype, copies) in shapes.items() if name != "embedding_csr"}
        self.ids, self.targets, self.scale, self.loss_rows = (
            made[k][0] for k in ("ids", "targets", "loss_scale", "loss_rows"))
        self.h = [made["h"][i % len(made["h"])] for i in range(nl + 1)]
        for name in self.PER_LAYER + (("xdbl_n", "mixer_rstd") if c.is_falcon else ()):
            setattr(self, name, [made[name][i % len(made[name])] for i in range(nl)])
        if not c.is_falcon:  # falcon_mamba's normalised dt_low/B/C; mamba uses xdbl itself
            self.xdbl_n, self.mixer_rstd = self.xdbl, None
        self.rstd_f, self.hf, self.logits = made["rstd_f"][0], made["hf"][0], made["logits"][0]
        self.chunk = int(shapes["logits"][0][0])
        if grad:
            for name in ("dh", "dhf", "du", "ddelta", "dxdbl", "dxz", "dun", "ones"):
                setattr(self, name, made[name][0])
            self.dxdbl_raw = made["dxdbl_raw"][0] if c.is_falcon else self.dxdbl
            rt.write(self.ones, np.ones(M, np.float32))
            self.emb_back = EmbeddingBackward(rt, M)
        if self.mixed:
            for name in ("un16", "xc16", "xdbl16", "y16"):
                setattr(self, name, [made[name][i % len(made[name])] for i in range(nl)])
            self.hf16 = made["hf16"][0]
            self.d16 = made["d16"][0] if grad else None


class MambaModel:
    """A Mamba-1 causal LM whose parameters live on the GPU."""

    def __init__(self, rt: Runtime, config: MambaConfig, tensors: dict):
        check_kernel_limits(config)
        self.rt = rt
        self.cfg = config
        self.shapes = dict(expected_shapes(config))
        if "backbone.embedding.weight" in tensors and "backbone.embeddings.weight" not in tensors:
            tensors = dict(tensors)
            tensors["backbone.embeddings.weight"] = tensors.pop("backbone.embedding.weight")
        self.names = list(self.shapes)
        # conv1d weight is stored [Di, 1, K] in the checkpoint, [Di, K] on the GPU
        self.gpu_shapes = {n: (tuple(s[:1]) + tuple(s[2:]) if n.endswith("conv1d.weight") else tuple(s))
                           for n, s in self.shapes.items()}
        self.P = FlatStore(rt, self.gpu_shapes, "params")
        self.params = _structured(config, self.P.views)
        self._G: FlatStore | None = None
        self._grads: Params | None = None
        self.lora = None  # an engine.lora.LoraAdapter applied in the forward and backward
        self._ws: dict = {}
        self.mixed = False
        self.P16 = None          # f16 copies of the parameter segments (mixed)
        self.params16 = None
        self.loss_scale = None   # [1] GPU tensor multiplied into the loss gradient (mixed)
        self.load_state_dict(tensors)
        self._acc = rt.empty((4,), name="accumulators")
        R, N = config.dt_rank, config.state_size
        self._mixer_ones = rt.upload(np.ones(max(R, N), np.float32), name="mixer_norm_ones") if config.is_falcon else None

    def grad_store(self, names) -> FlatStore | None:
        """The gradient store of the base's tensors among `names` (None when there are
        none: a LoRA run never makes one). Made on first use for those tensors only (an
        x_proj-only run holds x_proj's gradients, not a second copy of every weight); a
        later call for tensors it lacks makes it again over both (nothing is kept: a step
        clears its gradients first). Over every tensor it has the parameters' layout."""
        want = {n for n in names if n in self.shapes}
        if not want:
            return None
        if self._G is None or not want <= set(self._G.views):
            have = set(self._G.views) if self._G is not None else set()
            if self._G is not None:
                self._G.drop()
            self._G = None
            self._G = FlatStore(self.rt, {n: self.gpu_shapes[n] for n in self.names if n in want | have}, "grads")
            self._grads = _structured(self.cfg, self._G.views)
        return self._G

    @property
    def G(self) -> FlatStore:
        """The gradient store over every tensor (evaluation never makes one)."""
        return self.grad_store(self.names)

    @property
    def grads(self) -> Params:
        """The gradient views of the store as it is (fields it lacks are None)."""
        if self._grads is None:
            self.G  # noqa: B018 (made on first use)
        return self._grads

    def set_precision(self, precision: str) -> None:
        """'fp32' or 'mixed' (f16 matmul operands, f32 accumulation; needs shader-f16)."""
        if precision not in ("fp32", "mixed"):
            raise MemengineError(f"unknown precision {precision!r} (fp32 or mixed)")
        mixed = precision == "mixed"
        if mixed and not self.rt.has_f16:
            raise MemengineError(f"--precision mixed needs the shader-f16 feature, which the adapter "
                                 f"{self.rt.describe()} lacks; use --precision fp32")
        if mixed == self.mixed:
            return
        self.mixed = mixed
        self._ws.clear()
        if mixed:
            P = self.P
            self.P16 = [Tensor(self.rt.create_buffer(2 * ((seg.numel + 3) // 4 * 4), f"params16_{i}"),
                               (seg.numel,), "f16", 0, f"params16_{i}") for i, seg in enumerate(P.segments)]
            self.params16 = _structured(self.cfg, {
                n: Tensor(self.P16[si].buffer, shape, "f16", 2 * off, n)
                for n, shape in P.shapes.items() for si, off in [P.where[n]]})
            self.loss_scale = self.rt.upload(np.ones(1, np.float32), name="loss_scale.one")
        else:
            self.P16 = self.params16 = self.loss_scale = None

    @classmethod
    def from_checkpoint(cls, rt: Runtime, ckpt) -> "MambaModel":
        return cls(rt, ckpt.config, ckpt.tensors)

    # ------------------------------------------------------------------ weights
    def load_state_dict(self, tensors: dict) -> None:
        for name, shape in self.shapes.items():
            if name not in tensors:
                raise MemengineError(f"missing tensor {name}")
            a = np.asarray(tensors[name])
            if tuple(a.shape) != tuple(shape):
                raise MemengineError(f"tensor {name} has shape {tuple(a.shape)}, expected {tuple(shape)}")
        self.P.write(tensors)

    def _shaped(self, flat: dict) -> dict:
        return {name: flat[name].reshape(shape) for name, shape in self.shapes.items()}

    def state_dict(self) -> dict:
        return self._shaped(self.P.read())

    def grad_dict(self) -> dict:
        """The gradients the store holds (every tensor once a step over all has run)."""
        flat = self._G.read() if self._G is not None else self.G.read()
        return {name: flat[name].reshape(self.shapes[name]) for name in self.shapes if name in flat}

    def trainable_names(self, wsla: bool = False) -> list:
        """A trained adapter's matrices when one is attached; else x_proj (WSLA) or all."""
        if self.lora is not None and self.lora.train:
            return list(self.lora.names)
        if not wsla:
            return list(self.names)
        return [n for n in self.names if ".mixer.x_proj." in n]

    # ------------------------------------------------------------------ workspace
    def workspace(self, B: int, L: int, grad: bool = True) -> Workspace:
        """The activations for (B, L), made once; grad=False (evaluation only) keeps one
        layer's at a time, and a workspace made for training serves evaluation too."""
        ws = self._ws.get((B, L, True)) or self._ws.get((B, L, grad))
        if ws is None:
            ws = Workspace(self, B, L, grad)
            self._ws[(B, L, grad)] = ws
        return ws

    def write_batch(self, ws: Workspace, ids: np.ndarray, targets: np.ndarray | None = None,
                    denominator: int | None = None) -> int:
        """Upload a batch (ids [B, L], targets [B, L] with -1 = ignore). Returns #targets.
        The loss is the mean over `denominator` targets (default: this batch's), so the
        micro-batches of one accumulated step each scale by the whole step's count."""
        ids = np.ascontiguousarray(ids, np.int32).reshape(-1)
        V = self.cfg.vocab_size
        if ids.size and (ids.min() < 0 or ids.max() >= V):
            bad = int(ids[(ids < 0) | (ids >= V)][0])
            raise MemengineError(f"token id {bad} is outside the model's vocabulary (size {V})")
        self.rt.write(ws.ids, ids)
        n = 0
        if targets is not None:
            t = np.ascontiguousarray(targets, np.int32).reshape(-1)
            if t.size and t.max() >= V:
                raise MemengineError(f"target token id {int(t.max())} is outside the model's vocabulary (size {V})")
            n = int((t >= 0).sum())
            self.rt.write(ws.targets, t)
            self.rt.write(ws.scale, np.array([1.0 / max(n if denominator is None else denominator, 1)], np.float32))
        return n

    # ------------------------------------------------------------------ forward
    def record_forward(self, rec: Recorder, ws: Workspace, after_layer=None, *, train: bool = False) -> None:
        """Residual stream through every layer and the final norm (activations kept).
        `after_layer(rec, i)` is called once layer i's activations are recorded, before the
        next layer's (the decoder takes each layer's recurrent state from them there).
        `train`: a training step's forward (the adapter's dropout applies)."""
        c, p = self.cfg, self.params
        lora = self.lora
        E, Di, N, R, K = c.hidden_size, c.intermediate_size, c.state_size, c.dt_rank, c.conv_kernel
        M, B, L = ws.M, ws.B, ws.L
        mixed = ws.mixed
        p16 = self.params16.layers if mixed else [None] * len(p.layers)
        if mixed:  # the f16 weights from the f32 master weights (after every optimizer step)
            for seg, seg16 in zip(self.P.segments, self.P16):
                cast_f16(rec, seg16, seg)

        def f16(dst, src):
            if mixed:
                cast_f16(rec, dst, src)
            return dst if mixed else None

        embedding_forward(rec, ws.h[0], ws.ids, p.embeddings)
        for i, (lp, lp16) in enumerate(zip(p.layers, p16)):
            h, hn = ws.h[i], ws.h[i + 1]
            w16 = (lambda name: getattr(lp16, name) if mixed else None)
            # the norm also writes h_next = h, which out_proj then adds into (the residual)
            rmsnorm_forward(rec, ws.un[i], ws.rstd[i], h, lp.norm_weight, c.layer_norm_epsilon, copy=hn)
            linear_forward(rec, ws.xz[i], ws.un[i], lp.in_proj_weight, lp.in_proj_bias, M=M, N=2 * Di, K=E,
                           x16=f16(ws.un16[i] if mixed else None, ws.un[i]), w16=w16("in_proj_weight"))
            if lora is not None:
                lora.forward(rec, ws, i, "in_proj", ws.un[i], ws.xz[i], train=train)
            conv1d_forward(rec, ws.xc[i], ws.pre[i], ws.xz[i], lp.conv1d_weight, lp.conv1d_bias,
                           B=B, L=L, Di=Di, K=K)
            linear_forward(rec, ws.xdbl[i], ws.xc[i], lp.x_proj_weight, None, M=M, N=R + 2 * N, K=Di,
                           x16=f16(ws.xc16[i] if mixed else None, ws.xc[i]), w16=w16("x_proj_weight"))
            if lora is not None:
                lora.forward(rec, ws, i, "x_proj", ws.xc[i], ws.xdbl[i], train=train)
            if c.is_falcon:
                for col, w, rstd in self._mixer_norms(ws, i):
                    rmsnorm_forward(rec, ws.xdbl_n[i], rstd, ws.xdbl[i], self._mixer_ones.view((w,)),
                                    c.mixer_rms_eps, col=col, ld=R + 2 * N)
            linear_forward(rec, ws.delta[i], ws.xdbl_n[i], lp.dt_proj_weight, None, M=M, N=Di, K=R,
                           ldx=R + 2 * N, x16=f16(ws.xdbl16[i] if mixed else None, ws.xdbl_n[i]),
                           w16=w16("dt_proj_weight"))
            selective_scan_forward(rec, ws.y[i], ws.states[i], ws.xc[i], ws.delta[i], lp.dt_proj_bias,
                                   lp.A_log, lp.D, ws.xdbl_n[i], ws.xz[i], B=B, L=L, Di=Di, N=N, R=R)
            # residual add fused into out_proj: h_next (= h, from the norm) += y @ out_proj^T (+ b)
            linear_forward(rec, hn, ws.y[i], lp.out_proj_weight, lp.out_proj_bias, M=M, N=E, K=Di, acc=True,
                           x16=f16(ws.y16[i] if mixed else None, ws.y[i]), w16=w16("out_proj_weight"))
            if after_layer is not None:
                after_layer(rec, i)
            rec.boundary()  # a submission per layer while steps are slow (an interrupt acts within one)
        rmsnorm_forward(rec, ws.hf, ws.rstd_f, ws.h[-1], p.norm_f, c.layer_norm_epsilon)
        f16(ws.hf16 if mixed else None, ws.hf)

    def _mixer_norms(self, ws: Workspace, i: int) -> list:
        """falcon_mamba's weightless norms of layer i: (first column, width, rstd view) for
        dt_low, B and C."""
        R, N, M = self.cfg.dt_rank, self.cfg.state_size, ws.M
        rs = ws.mixer_rstd[i]
        return [(0, R, rs.view((M,), 0)), (R, N, rs.view((M,), M)), (R + N, N, rs.view((M,), 2 * M))]

    def _head(self) -> Tensor:
        return self.params.lm_head if self.params.lm_head is not None else self.params.embeddings

    def _head16(self) -> Tensor | None:
        if self.params16 is None:
            return None
        return self.params16.lm_head if self.params16.lm_head is not None else self.params16.embeddings

    def _dhead(self) -> Tensor:
        return self.grads.lm_head if self.grads.lm_head is not None else self.grads.embeddings

    def record_loss(self, rec: Recorder, ws: Workspace, *, want_grad: bool, train_head: bool = True,
                    hits: Tensor | None = None) -> None:
        """LM head + cross-entropy in row chunks; with want_grad also dhf and d(lm_head).
        `hits` [2M] (evaluation): top-1 hits in [0, M), top-5 hits in [M, 2M)."""
        E, V, M = self.cfg.hidden_size, self.cfg.vocab_size, ws.M
        W, dW = self._head(), (self._dhead() if want_grad and train_head else None)
        W16 = self._head16() if ws.mixed else None
        for r0 in range(0, M, ws.chunk):
            mc = min(ws.chunk, M - r0)
            logits = ws.logits.view((mc, V))
            hf = ws.hf.view((mc, E), r0 * E)
            hf16 = ws.hf16.view((mc, E), r0 * E) if ws.mixed else None
            linear_forward(rec, logits, hf, W, None, M=mc, N=V, K=E, x16=hf16, w16=W16)
            h = None if hits is None else (hits.view((mc,), r0), hits.view((mc,), M + r0))
            cross_entropy(rec, ws.loss_rows.view((mc,), r0), logits, ws.targets.view((mc,), r0),
                          ws.scale, want_grad=want_grad, hits=h, loss_scale=self.loss_scale if ws.mixed else None)
            if want_grad:
                linear_backward(rec, ws.dhf.view((mc, E), r0 * E), dW if train_head else None, None,
                                logits, hf, W, M=mc, N=V, K=E, x16=hf16, w16=W16,
                                dout16=ws.d16 if ws.mixed else None)
            rec.boundary()

    def record_backward(self, rec: Recorder, ws: Workspace, trainable: set) -> None:
        """Gradients of the mean loss for every trainable parameter: the weight gradients of
        frozen ones are not computed (only the activation gradients that flow through them);
        the adapter's, when one is attached and its names are in `trainable`."""
        c, p = self.cfg, self.params
        E, Di, N, R, K = c.hidden_size, c.intermediate_size, c.state_size, c.dt_rank, c.conv_kernel
        M, B, L = ws.M, ws.B, ws.L
        mixed = ws.mixed
        lora = self.lora
        self.grad_store(trainable)   # (no-op when the step has made it)

        def g(name: str, field: str, i: int | None = None):
            """The gradient view of `name` when it is trained, else None (the gradient store
            is made on first use: a LoRA run never makes it)."""
            if name not in trainable:
                return None
            return getattr(self.grads if i is None else self.grads.layers[i], field)

        rec.clear(ws.dh)
        rmsnorm_backward(rec, ws.dh, g("backbone.norm_f.weight", "norm_f"), ws.dhf, ws.h[-1], p.norm_f, ws.rstd_f)
        for i in reversed(range(c.num_hidden_layers)):
            lp = p.layers[i]
            lp16 = self.params16.layers[i] if mixed else None
            mx = (lambda act, w: dict(x16=act[i], w16=getattr(lp16, w), dout16=ws.d16) if mixed else {})
            pre = f"backbone.layers.{i}."
            mz = pre + "mixer."
            # dy (the gated scan output's gradient) goes into du: the scan reads it there
            linear_backward(rec, ws.du, g(mz + "out_proj.weight", "out_proj_weight", i),
                            g(mz + "out_proj.bias", "out_proj_bias", i),
                            ws.dh, ws.y[i], lp.out_proj_weight, ws.ones, M=M, N=E, K=Di,
                            **mx(ws.y16 if mixed else None, "out_proj_weight"))
            selective_scan_backward(rec, ws.du, ws.ddelta, g(mz + "dt_proj.bias", "dt_proj_bias", i),
                                    g(mz + "A_log", "A_log", i), g(mz + "D", "D", i), ws.dxdbl, ws.dxz,
                                    ws.du, ws.states[i], ws.xc[i], ws.delta[i], lp.dt_proj_bias, lp.A_log,
                                    lp.D, ws.xdbl_n[i], ws.xz[i], B=B, L=L, Di=Di, N=N, R=R)
            linear_backward(rec, ws.dxdbl, g(mz + "dt_proj.weight", "dt_proj_weight", i),
                            None, ws.ddelta, ws.xdbl_n[i], lp.dt_proj_weight, M=M, N=Di, K=R,
                            ldx=R + 2 * N, lddx=R + 2 * N, **mx(ws.xdbl16 if mixed else None, "dt_proj_weight"))
            if c.is_falcon:  # back through the dt/B/C norms: dxdbl (normalised) -> dxdbl_raw
                rec.clear(ws.dxdbl_raw)
                for col, w, rstd in self._mixer_norms(ws, i):
                    rmsnorm_backward(rec, ws.dxdbl_raw, None, ws.dxdbl, ws.xdbl[i], self._mixer_ones.view((w,)),
                                     rstd, col=col, ld=R + 2 * N)
            linear_backward(rec, ws.du, g(mz + "x_proj.weight", "x_proj_weight", i),
                            None, ws.dxdbl_raw, ws.xc[i], lp.x_proj_weight, M=M, N=R + 2 * N, K=Di, dx_acc=True,
                            **mx(ws.xc16 if mixed else None, "x_proj_weight"))
            if lora is not None:
                lora.backward(rec, ws, i, "x_proj", ws.dxdbl_raw, ws.xc[i], ws.du)
            conv1d_backward(rec, ws.dxz, g(mz + "conv1d.weight", "conv1d_weight", i),
                            g(mz + "conv1d.bias", "conv1d_bias", i), ws.du, ws.pre[i], ws.xz[i],
                            lp.conv1d_weight, B=B, L=L, Di=Di, K=K)
            linear_backward(rec, ws.dun, g(mz + "in_proj.weight", "in_proj_weight", i),
                            g(mz + "in_proj.bias", "in_proj_bias", i),
                            ws.dxz, ws.un[i], lp.in_proj_weight, ws.ones, M=M, N=2 * Di, K=E,
                            **mx(ws.un16 if mixed else None, "in_proj_weight"))
            if lora is not None:
                lora.backward(rec, ws, i, "in_proj", ws.dxz, ws.un[i], ws.dun)
            rmsnorm_backward(rec, ws.dh, g(pre + "norm.weight", "norm_weight", i), ws.dun, ws.h[i], lp.norm_weight,
                             ws.rstd[i])
            rec.boundary()
        if "backbone.embeddings.weight" in trainable:
            ws.emb_back.record(rec, self.grads.embeddings, ws.dh)

    # ------------------------------------------------------------------ conveniences
    def logits(self, ids: np.ndarray) -> np.ndarray:
        """Logits [B, L, V] for ids [B, L] (read back chunk by chunk)."""
        ids = np.atleast_2d(np.asarray(ids))
        B, L = ids.shape
        ws = self.workspace(B, L)
        self.write_batch(ws, ids)
        rec = self.rt.recorder()
        self.record_forward(rec, ws)
        rec.submit()
        E, V, M = self.cfg.hidden_size, self.cfg.vocab_size, ws.M
        out = np.empty((M, V), np.float32)
        for r0 in range(0, M, ws.chunk):
            mc = min(ws.chunk, M - r0)
            logits = ws.logits.view((mc, V))
            rec = self.rt.recorder()
            linear_forward(rec, logits, ws.hf.view((mc, E), r0 * E), self._head(), None, M=mc, N=V, K=E,
                           x16=ws.hf16.view((mc, E), r0 * E) if ws.mixed else None, w16=self._head16())
            rec.submit()
            out[r0:r0 + mc] = self.rt.read(logits)
        return out.reshape(B, L, V)

    def record_gradients(self, rec: Recorder, ws: Workspace, ids: np.ndarray, trainable: set,
                         loss_acc: Tensor, clear: bool = True) -> None:
        """One step's forward and backward for the batch already written to `ws`:
        gradients of the mean loss in `self.grads` (cleared first unless `clear` is False:
        then added to what is there, for gradient accumulation), the mean loss added into
        loss_acc[0].  `ids` (host) plan the embedding's scatter-add."""
        if "backbone.embeddings.weight" in trainable:
            ws.emb_back.prepare(ids)
        if clear:
            for store in self._grad_stores(trainable):
                store.clear(rec)
        self.record_forward(rec, ws, train=True)
        self.record_loss(rec, ws, want_grad=True, train_head=self._head_name() in trainable)
        sum_into(rec, loss_acc, ws.loss_rows, scale_tensor=ws.scale)
        self.record_backward(rec, ws, trainable)

    def loss_and_grads(self, ids: np.ndarray, targets: np.ndarray, trainable=None) -> float:
        """One forward+backward (no update); gradients left in `self.grads`. For tests."""
        ids = np.atleast_2d(ids)
        ws = self.workspace(*ids.shape)
        self.write_batch(ws, ids, targets)
        rec = self.rt.recorder()
        rec.clear(self._acc)
        self.record_gradients(rec, ws, ids, set(self.names if trainable is None else trainable),
                              self._acc.view((1,)))
        rec.submit()
        return float(self.rt.read(self._acc)[0])

    def _grad_stores(self, trainable: set) -> list:
        """The gradient buffers a step over `trainable` writes (the base's, the adapter's)."""
        out = []
        if any(n in self.shapes for n in trainable):
            out.append(self.grad_store(trainable))
        if self.lora is not None and self.lora.G is not None and any(n in self.lora.shapes for n in trainable):
            out.append(self.lora.G)
        return out

    def whole_stores(self, trainable: set) -> list:
        """(parameter store, gradient store) pairs of a step over `trainable` whose every
        view trains (the base's in full training, the adapter's with LoRA): the optimizer
        and the gradient norm take them as whole segments, one dispatch each instead of one
        per tensor (the alignment padding between views holds zeros and keeps them)."""
        out = []
        if set(self.P.views) <= trainable:
            out.append((self.P, self.grad_store(trainable)))
        if self.lora is not None and self.lora.G is not None and set(self.lora.P.views) <= trainable:
            out.append((self.lora.P, self.lora.G))
        return out

    def norm_views(self, trainable: set) -> list:
        """The tensors whose squares the gradient norm sums for a step over `trainable`:
        the segments of the whole stores, the trained views of any other store."""
        whole = self.whole_stores(trainable)
        out = [t for _, G in whole for t in G.segments]
        for store in self._grad_stores(trainable):
            if not any(store is G for _, G in whole):
                out += [store.views[n] for n in sorted(set(store.views) & trainable)]
        return out

    def trainable_views(self, names: list) -> tuple[dict, dict]:
        """(parameter views, gradient views) of `names`: the base's, or the adapter's."""
        params, grads = {}, {}
        G = self.grad_store(names)   # None when every name is the adapter's
        for n in names:
            if n in self.P.views:
                params[n], grads[n] = self.P.views[n], G.views[n]
            else:
                params[n], grads[n] = self.lora.P.views[n], self.lora.G.views[n]
        return params, grads

    def _head_name(self) -> str:
        return "lm_head.weight" if self.params.lm_head is not None else "backbone.embeddings.weight"


def perplexity(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:
        return float("inf")
