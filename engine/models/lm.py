"""The shell every architecture shares: a causal LM on the GPU.

    h = embeddings[ids]
    per layer:  the architecture's Block (engine/models/base.py) takes h to h_next
    logits = lm_head(rmsnorm(h))          loss = mean CE(logits, targets)

All parameters live in flat f32 buffers (`FlatStore`), all gradients in a store of the same
layout (made on first use, for the trained tensors only), so the gradients are cleared with
one command per buffer and the optimizer addresses both by name.

Precision is a strategy, not branches: `model.half` is `FULL` under fp32 (every f16 operand
is None) or a `Half` under --precision mixed, which keeps f16 copies of the parameters
(`P16`, cast from the f32 master weights at the start of each forward, so after every
optimizer step), of the activations that feed a product (cast after their producer and kept
for the weight gradients: the workspace's `<name>16` buffers) and of each output gradient
(cast into one scratch buffer just before its two products).  Everything else stays f32:
the embedding, norms, conv, scan, cross-entropy, the gradients and their reductions, AdamW
and its moments.  The loss gradient is multiplied by `loss_scale` (set by the trainer's
LossScaler) so that small gradients survive f16.

Each activation and output gradient has a per-tensor scale (`Half.scales`, an F16Scales
table of engine/kernels/matmul.py; slots "layers.<i>.<name16>", "layers.<i>.<field>.dout",
"hf16", "head.dout"): its cast multiplies it by 2^e and records its amax, the products
undo the scales in their epilogue, and the trainer rescales every slot at the end of each
step from that step's amax (2^12 <= scaled amax < 2^13), so an activation of any f32
magnitude goes through the products.  The weights keep the unit scale.
"""

from __future__ import annotations

import math

import numpy as np

from memengine.engine import models
from memengine.engine.errors import MemengineError
from memengine.engine.kernels.cross_entropy import cross_entropy
from memengine.engine.kernels.embedding import EmbeddingBackward, embedding_forward
from memengine.engine.kernels.lora import scale_
from memengine.engine.kernels.matmul import F16Scales, cast_f16, linear_backward, linear_forward, with_scale
from memengine.engine.kernels.reduce import sum_into
from memengine.engine.kernels.rmsnorm import rmsnorm_backward, rmsnorm_forward
from memengine.engine.models.base import Layer, Params
from memengine.engine.models.store import FlatStore
from memengine.engine.runtime import Recorder, Runtime, Tensor


def logits_chunk_rows(max_binding: int, M: int, V: int) -> int:
    """Rows of logits produced at once: one chunk fits one storage binding (and 256 MiB)."""
    rows = max(1, min(max_binding, 256 * 2**20) // (4 * V))
    if rows < M:  # whole 128-row tiles keep every chunk on the fast matmul path
        rows = rows // 128 * 128 if rows >= 128 else max(1, rows // 4 * 4)
    return min(M, rows)


def workspace_shapes(cfg, B: int, L: int, grad: bool, max_binding: int, mixed: bool = False,
                     block=None) -> dict:
    """name -> (shape, dtype, copies) of every buffer a Workspace allocates (the memory plan
    sums the same table): the shell's and the architecture's layers'.  Per-layer buffers
    have one copy per layer when kept for a backward, else one shared by all layers
    (evaluation); h has layers + 1 (else 2, alternating).  `mixed`: the f16 copies of
    --precision mixed too."""
    block = block if block is not None else models.of(cfg).block(cfg)
    E, V = cfg.hidden_size, cfg.vocab_size
    M, nl = B * L, cfg.num_hidden_layers
    per = nl if grad else 1
    chunk = logits_chunk_rows(max_binding, M, V)
    t = {"ids": ((M,), "i32", 1), "targets": ((M,), "i32", 1), "loss_scale": ((1,), "f32", 1),
         "loss_rows": ((M,), "f32", 1), "h": ((M, E), "f32", nl + 1 if grad else 2)}
    t.update({name: (shape, dtype, (min(per, len(per_layer)) if isinstance(per_layer, (list, tuple)) else per)
                     if per_layer else 1)
              for name, (shape, dtype, per_layer) in block.workspace_table(B, L, grad, mixed).items()})
    t.update({"rstd_f": ((M,), "f32", 1), "hf": ((M, E), "f32", 1), "logits": ((chunk, V), "f32", 1)})
    if grad:  # the final norm's and the head's gradients, the embedding's scatter plan
        t.update({"dh": ((M, E), "f32", 1), "dhf": ((M, E), "f32", 1), "ones": ((M,), "f32", 1),
                  "embedding_csr": ((EmbeddingBackward.csr_size(M),), "i32", 1)})
    if mixed:  # the head's f16 operand; one f16 scratch for an output gradient
        t["hf16"] = ((M, E), "f16", 1)
        if grad:
            t["d16"] = ((max(block.d16_elems(M), M * E, chunk * V),), "f16", 1)
    return t


class Workspace:
    """Activations for one (B, L): allocated once.  With grad, every layer's are kept for
    the backward; without (evaluation), the layers share one set.  A per-layer buffer is a
    list indexed by layer (`ws.xz[i]`), a shared one a tensor."""

    def __init__(self, model: "LanguageModel", B: int, L: int, grad: bool = True):
        rt, c = model.rt, model.cfg
        M, nl = B * L, c.num_hidden_layers
        self.B, self.L, self.M, self.grad = B, L, M, grad
        self.mixed = model.half.mixed
        shapes = workspace_shapes(c, B, L, grad, rt.max_binding, self.mixed, model.block)
        made = {name: [rt.empty(shape, dtype, name=f"{name}{i}") for i in range(copies)]
                for name, (shape, dtype, copies) in shapes.items() if name != "embedding_csr"}
        per_layer = {n: p for n, (_, _, p) in model.block.workspace_table(B, L, grad, self.mixed).items() if p}
        for name, bufs in made.items():
            if name == "h":
                self.h = [bufs[i % len(bufs)] for i in range(nl + 1)]
            elif name in per_layer and isinstance(per_layer[name], (list, tuple)):   # those layers' only
                layers = list(per_layer[name])
                setattr(self, name, [(bufs[layers.index(i) % len(bufs)] if i in layers else None)
                                     for i in range(nl)])
            elif name in per_layer:
                setattr(self, name, [bufs[i % len(bufs)] for i in range(nl)])
            else:
                setattr(self, name, bufs[0])
        self.scale = self.loss_scale
        self.chunk = int(shapes["logits"][0][0])
        self.d16 = getattr(self, "d16", None)
        if grad:
            rt.write(self.ones, np.ones(M, np.float32))
            self.emb_back = EmbeddingBackward(rt, M)
        model.block.finish_workspace(self)


class Full:
    """fp32: every product reads f32 operands (no f16 copies)."""

    mixed = False
    loss_scale = None

    def cast_weights(self, rec) -> None:
        pass

    def act(self, rec, ws, name16: str, i, src):
        """The f16 copy of activation `src` (cast into ws.<name16>[i]), or None."""
        return None

    def weight(self, i: int, field: str):
        """The f16 view of layer i's parameter `field`, or None."""
        return None

    def operands(self, ws, name16: str, i: int, field: str) -> dict:
        """A backward product's f16 operands (activation, weight, output gradient's scratch)."""
        return {}

    def view(self, ws, name16: str, shape, offset: int):
        return None

    def head(self):
        return None

    def dout_scale(self, name: str):
        """The scale slot of output gradient `name` ("head"), or None."""
        return None


FULL = Full()


def f16_slot_names(cfg, block) -> list:
    """Every f16 activation and output gradient of a model under --precision mixed, in a fixed
    order (a saved table's slots are these)."""
    acts = [n for n, (_, dtype, per_layer) in block.workspace_table(1, 1, True, True).items()
            if dtype == "f16" and per_layer]
    fields = sorted(set(block.LAYER_FIELDS.values()))
    names = []
    for i in range(cfg.num_hidden_layers):
        names += [f"layers.{i}.{a}" for a in acts] + [f"layers.{i}.{f}.dout" for f in fields]
    return names + ["hf16", "head.dout"]


class Half(Full):
    """--precision mixed: f16 copies of the parameters and of the products' activations."""

    mixed = True

    def __init__(self, model: "LanguageModel"):
        rt, P = model.rt, model.P
        self.P, self.model = P, model
        self.P16 = [Tensor(rt.create_buffer(2 * ((seg.numel + 3) // 4 * 4), f"params16_{i}"),
                           (seg.numel,), "f16", 0, f"params16_{i}") for i, seg in enumerate(P.segments)]
        self.params16 = model.structured({n: Tensor(self.P16[si].buffer, shape, "f16", 2 * off, n)
                                          for n, shape in P.shapes.items() for si, off in [P.where[n]]})
        self.loss_scale = rt.upload(np.ones(1, np.float32), name="loss_scale.one")
        self.scales = F16Scales(rt, self.slot_names(model))

    @staticmethod
    def slot_names(model) -> list:
        return f16_slot_names(model.cfg, model.block)

    def _slot(self, name16: str, i):
        return self.scales[name16 if i is None else f"layers.{i}.{name16}"]

    def cast_weights(self, rec) -> None:
        """The f16 weights from the f32 master weights (after every optimizer step)."""
        for seg, seg16 in zip(self.P.segments, self.P16):
            cast_f16(rec, seg16, seg)

    def act(self, rec, ws, name16: str, i, src):
        dst = getattr(ws, name16)
        dst = dst if i is None else dst[i]
        return cast_f16(rec, dst, src, scale=self._slot(name16, i))

    def weight(self, i: int, field: str):
        return getattr(self.params16.layers[i], field)

    def operands(self, ws, name16: str, i: int, field: str) -> dict:
        return dict(x16=with_scale(getattr(ws, name16)[i], self._slot(name16, i)), w16=self.weight(i, field),
                    dout16=ws.d16, dout_scale=self.scales[f"layers.{i}.{field}.dout"])

    def view(self, ws, name16: str, shape, offset: int):
        return with_scale(getattr(ws, name16).view(shape, offset), self._slot(name16, None))

    def dout_scale(self, name: str):
        return self.scales[f"{name}.dout"]

    def head(self):
        p = self.params16
        return p.lm_head if p.lm_head is not None else p.embeddings


class LanguageModel:
    """A causal LM whose parameters live on the GPU; its layers are its architecture's."""

    def __init__(self, rt: Runtime, config, tensors: dict, *, lora=None):
        arch = models.of(config)
        arch.check_kernel_limits(config)
        self.rt, self.cfg, self.arch = rt, config, arch
        self.shapes = arch.shapes(config)
        tensors = {arch.ALIASES.get(k, k) if arch.ALIASES.get(k, k) not in tensors else k: v
                   for k, v in tensors.items()}
        self.names = list(self.shapes)
        self.gpu_shapes = {n: arch.gpu_shape(n, s) for n, s in self.shapes.items()}
        self.block = arch.block(config)
        self.emb_scale, self.logit_scale = float(arch.embedding_scale(config)), float(arch.logits_scale(config))
        self.P = FlatStore(rt, self.gpu_shapes, "params")
        self.params = self.structured(self.P.views)
        self._G: FlatStore | None = None
        self._grads: Params | None = None
        self.lora = lora  # an engine.lora.LoraAdapter applied in the forward and backward
        self._ws: dict = {}
        self.half = FULL
        self.load_state_dict(tensors)
        self._acc = rt.empty((4,), name="accumulators")

    def structured(self, views: dict) -> Params:
        """Views by name -> the embedding, a `Layer` of fields per layer, the final norm, the head."""
        a, fields = self.arch, self.block.LAYER_FIELDS
        layers = []
        for i in range(self.cfg.num_hidden_layers):
            pre = f"{a.LAYER_PREFIX}{i}."
            layers.append(Layer({f: views.get(pre + suffix) for suffix, f in fields.items()}))
        return Params(embeddings=views.get(a.EMBEDDINGS), layers=layers, norm_f=views.get(a.FINAL_NORM),
                      lm_head=views.get(a.HEAD))

    @classmethod
    def from_checkpoint(cls, rt: Runtime, ckpt, *, lora=None) -> "LanguageModel":
        return cls(rt, ckpt.config, ckpt.tensors, lora=lora)

    # ------------------------------------------------------------------ precision
    @property
    def mixed(self) -> bool:
        return self.half.mixed

    @property
    def loss_scale(self):
        """[1] GPU tensor multiplied into the loss gradient (mixed; the trainer's LossScaler
        writes it), None under fp32."""
        return self.half.loss_scale

    @loss_scale.setter
    def loss_scale(self, tensor) -> None:
        if not self.half.mixed:
            raise MemengineError("a loss scale is for --precision mixed")
        self.half.loss_scale = tensor

    def set_precision(self, precision: str) -> None:
        """'fp32' or 'mixed' (f16 matmul operands, f32 accumulation; needs shader-f16)."""
        if precision not in ("fp32", "mixed"):
            raise MemengineError(f"unknown precision {precision!r} (fp32 or mixed)")
        mixed = precision == "mixed"
        if precision not in self.arch.precisions:
            raise MemengineError(f"--precision {precision} is not yet supported for {self.cfg.model_type}")
        if mixed and not self.rt.has_f16:
            raise MemengineError(f"--precision mixed needs the shader-f16 feature, which the adapter "
                                 f"{self.rt.describe()} lacks; use --precision fp32")
        if mixed == self.mixed:
            return
        self._ws.clear()
        self.half = Half(self) if mixed else FULL

    # ------------------------------------------------------------------ gradients
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
            self._grads = self.structured(self._G.views)
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
        """A trained adapter's matrices when one is attached; else the architecture's
        selection parameters (WSLA) or all."""
        if self.lora is not None and self.lora.train:
            return list(self.lora.names)
        if not wsla:
            return list(self.names)
        return self.arch.wsla_names(self.cfg, self.names)

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
        self.half.cast_weights(rec)
        embedding_forward(rec, ws.h[0], ws.ids, p.embeddings)
        if self.emb_scale != 1.0:
            scale_(rec, ws.h[0], self.emb_scale)
        for i in range(c.num_hidden_layers):
            self.block.forward(rec, self, ws, i, train=train)
            if after_layer is not None:
                after_layer(rec, i)
            rec.boundary()  # a submission per layer while steps are slow (an interrupt acts within one)
        rmsnorm_forward(rec, ws.hf, ws.rstd_f, ws.h[-1], p.norm_f, c.layer_norm_epsilon)
        if self.logit_scale != 1.0:   # logits = s * lm_head(hf): hf scaled (and its gradient below)
            scale_(rec, ws.hf, self.logit_scale)
        self.half.act(rec, ws, "hf16", None, ws.hf)

    def head(self) -> Tensor:
        return self.params.lm_head if self.params.lm_head is not None else self.params.embeddings

    def _dhead(self) -> Tensor:
        return self.grads.lm_head if self.grads.lm_head is not None else self.grads.embeddings

    def head_name(self) -> str:
        return self.arch.HEAD if self.params.lm_head is not None else self.arch.EMBEDDINGS

    def record_loss(self, rec: Recorder, ws: Workspace, *, want_grad: bool, train_head: bool = True,
                    hits: Tensor | None = None) -> None:
        """LM head + cross-entropy in row chunks; with want_grad also dhf and d(lm_head).
        `hits` [2M] (evaluation): top-1 hits in [0, M), top-5 hits in [M, 2M)."""
        E, V, M = self.cfg.hidden_size, self.cfg.vocab_size, ws.M
        W, dW = self.head(), (self._dhead() if want_grad and train_head else None)
        half = self.half
        W16 = half.head()
        for r0 in range(0, M, ws.chunk):
            mc = min(ws.chunk, M - r0)
            logits = ws.logits.view((mc, V))
            hf = ws.hf.view((mc, E), r0 * E)
            hf16 = half.view(ws, "hf16", (mc, E), r0 * E)
            linear_forward(rec, logits, hf, W, None, M=mc, N=V, K=E, x16=hf16, w16=W16)
            h = None if hits is None else (hits.view((mc,), r0), hits.view((mc,), M + r0))
            cross_entropy(rec, ws.loss_rows.view((mc,), r0), logits, ws.targets.view((mc,), r0),
                          ws.scale, want_grad=want_grad, hits=h, loss_scale=half.loss_scale)
            if want_grad:
                linear_backward(rec, ws.dhf.view((mc, E), r0 * E), dW if train_head else None, None,
                                logits, hf, W, M=mc, N=V, K=E, x16=hf16, w16=W16, dout16=ws.d16,
                                dout_scale=half.dout_scale("head"))
            rec.boundary()

    def record_backward(self, rec: Recorder, ws: Workspace, trainable: set) -> None:
        """Gradients of the mean loss for every trainable parameter: the weight gradients of
        frozen ones are not computed (only the activation gradients that flow through them);
        the adapter's, when one is attached and its names are in `trainable`."""
        c, p, a = self.cfg, self.params, self.arch
        self.grad_store(trainable)   # (no-op when the step has made it)
        views = {}

        def grad(name: str):
            """The gradient view of `name` when it is trained, else None (the gradient store
            is made on first use: a LoRA run never makes it)."""
            if name not in trainable:
                return None
            if not views:
                views.update(self._G.views)
            return views[name]

        rec.clear(ws.dh)
        if self.logit_scale != 1.0:
            scale_(rec, ws.dhf, self.logit_scale)
        rmsnorm_backward(rec, ws.dh, grad(a.FINAL_NORM), ws.dhf, ws.h[-1], p.norm_f, ws.rstd_f)
        for i in reversed(range(c.num_hidden_layers)):
            self.block.backward(rec, self, ws, i, grad)
            rec.boundary()
        if a.EMBEDDINGS in trainable:
            if self.emb_scale != 1.0:
                scale_(rec, ws.dh, self.emb_scale)
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
            linear_forward(rec, logits, ws.hf.view((mc, E), r0 * E), self.head(), None, M=mc, N=V, K=E,
                           x16=self.half.view(ws, "hf16", (mc, E), r0 * E), w16=self.half.head())
            rec.submit()
            out[r0:r0 + mc] = self.rt.read(logits)
        return out.reshape(B, L, V)

    def record_gradients(self, rec: Recorder, ws: Workspace, ids: np.ndarray, trainable: set,
                         loss_acc: Tensor, clear: bool = True) -> None:
        """One step's forward and backward for the batch already written to `ws`:
        gradients of the mean loss in `self.grads` (cleared first unless `clear` is False:
        then added to what is there, for gradient accumulation), the mean loss added into
        loss_acc[0].  `ids` (host) plan the embedding's scatter-add."""
        if self.arch.EMBEDDINGS in trainable:
            ws.emb_back.prepare(ids)
        if clear:
            for store in self._grad_stores(trainable):
                store.clear(rec)
        self.record_forward(rec, ws, train=True)
        self.record_loss(rec, ws, want_grad=True, train_head=self.head_name() in trainable)
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


def perplexity(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:
        return float("inf")
