"""The Mamba-2 layer on the GPU: forward and backward (engine/kernels/ssd.py for the SSD
pieces), shared by every architecture whose layers are transformers' Mamba2 mixer (Mamba-2
itself, engine/models/mamba2; the hybrids, engine/models/hybrid): a module, not an
architecture folder, so that each of them imports it and none imports another.
Per layer, as transformers' Mamba2Mixer.torch_forward:

    u = rmsnorm(h); zxbcdt = in_proj(u)                   [M, W], W = 2Di + 2GN + H
    xbc = silu(conv(zxbcdt[:, Di:2Di+2GN]))               [M, C], C = Di + 2GN
    dt = clamp(softplus(zxbcdt[:, W-H:] + dt_bias))       [M, H]
    y = ssd(x, dt, A, B, C) + D x                         [M, Di]
    yn = norm_w * rmsnorm_per_group(y * silu(z))          z = zxbcdt[:, :Di]
    h = h + out_proj(yn)                                  (hybrids: h_mid = h + r * out_proj(yn))

Recurrent decoding keeps, per layer, the conv state (the last K-1 xBC inputs, [K-1, C]) and
the SSM state [H, P, N]: after the prompt, the scan's saved state after the last step
(`ssd.state_shape`'s entry NC) and the prompt's last K-1 rows of xBC.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from memengine.engine.kernels import conv1d, ssd
from memengine.engine.kernels.decode import matvec
from memengine.engine.kernels.conv1d import conv1d_backward, conv1d_forward
from memengine.engine.kernels.lora import scale_
from memengine.engine.kernels.matmul import linear_backward, linear_forward, matmul
from memengine.engine.kernels.rmsnorm import rmsnorm_backward, rmsnorm_forward
from memengine.engine.models.base import Block
from memengine.engine.runtime import BindingError, split

LAYER_FIELDS = {
    "norm.weight": "norm_weight",                 # [E]
    "mixer.dt_bias": "dt_bias",                   # [H]
    "mixer.A_log": "A_log",                       # [H]
    "mixer.D": "D",                               # [H]
    "mixer.conv1d.weight": "conv1d_weight",       # [C, K]   (checkpoint [C, 1, K])
    "mixer.conv1d.bias": "conv1d_bias",           # [C]      when use_conv_bias
    "mixer.in_proj.weight": "in_proj_weight",     # [W, E]   rows [z ; xBC ; dt]
    "mixer.in_proj.bias": "in_proj_bias",         # [W]      when use_bias
    "mixer.norm.weight": "gnorm_weight",          # [Di]
    "mixer.out_proj.weight": "out_proj_weight",   # [E, Di]
    "mixer.out_proj.bias": "out_proj_bias",       # [E]      when use_bias
}


def scaled_bias(bias, r: float):
    """(bias for the product, bias to add times r after it): a layer whose output is r * (W x + b)
    reads r * x, and its bias is added times r apart."""
    return (bias, None) if r == 1.0 or bias is None else (None, bias)


def bias_ones(rec, ws, r: float):
    """(A block with r != 1 has `rones` [M] in its workspace.)  The vector whose product with an output gradient is its bias's gradient: M ones, or M
    values r (the bias of an output scaled by r)."""
    if r == 1.0:
        return ws.ones
    if getattr(ws, "_rones_r", None) != r:
        rec.rt.write(ws.rones, np.full(ws.M, r, np.float32))
        ws._rones_r = r
    return ws.rones


def add_scaled_bias(rec, ws, out, bias, r: float, *, M: int, N: int) -> None:
    """out[M, N] += r * bias (a product of the [M, 1] values r and the [1, N] bias)."""
    matmul(rec, out, bias_ones(rec, ws, r), bias, M=M, N=N, K=1, acc=True)


def plan_scratch(lim, cfg, B: int, L: int, kind: str) -> int:
    """Bytes of the Mamba-2 layers' kernel scratch for a `kind` run (eval, train, adapt, lora):
    the memory plan's share of the SSD scan, its column sums and the conv's partials (`cfg`:
    the layer's shape, as Mamba2Block reads it)."""
    H, P, N, G, K = cfg.num_heads, cfg.head_dim, cfg.state_size, cfg.n_groups, cfg.conv_kernel
    Di, C = cfg.intermediate_size, cfg.conv_dim
    grad = kind != "eval"
    lanes = ssd.plan_lanes(lim, L, H, P, N, G)   # the 8-lane scan: no chunked-form scratch
    total = 0 if lanes else 2 * _buf16(16)   # the scan's stand-ins for bindings a product does not read
    try:
        seqs = split(lim, B, lambda nb: ssd.sequence_windows(nb, L, H, P, N, G),
                     scratch=lambda nb: ssd.sequence_scratch(nb, L, H, P, N, G, grad, lanes))
    except BindingError:
        seqs = [(0, 1)]
    for nb in sorted({nb for _, nb in seqs}):
        total += sum(_buf16(b) for b in ssd.sequence_scratch(nb, L, H, P, N, G, grad, lanes))
    if not grad:
        return total
    total += _buf16(4 * B * L * Di)  # the gated norm's weight-gradient terms
    blocks = set()   # the column sums' block sums (dt_bias, the gated norm, A_log and D)
    scan_sums = ([(H, ssd.lane_passes(N) * nb, P) for _, nb in seqs] + [(H, nb, P) for _, nb in seqs] if lanes
                 else [(H, nb * ssd.n_chunks(L), 1) for _, nb in seqs])
    for J, R, Pq in [(H, B * L, 1), (Di, B * L, 1)] + scan_sums:
        blocks |= ssd.reduce_scratch(J, R, Pq, lim.max_binding)
    total += sum(_buf16(4 * n) for n in blocks)
    if kind == "train":
        nch = conv1d.partial_rows(B, L)
        total += _buf16(4 * nch * C * (K + 1)) + _buf16(4 * C * K) + _buf16(4 * C)
    else:
        total += _buf16(4 * C)
    return total


def _buf16(nbytes: int) -> int:
    return max(16, (int(nbytes) + 15) // 16 * 16)


class Mamba2Block(Block):
    """The layer of `cfg` (read: hidden_size, intermediate_size, state_size, conv_kernel,
    num_heads, head_dim, n_groups, conv_dim, in_proj_rows, dt_limit, layer_norm_epsilon,
    num_hidden_layers).  A hybrid's block holds one with its own tensor names: `norm` (the
    pre-norm's name after the layer prefix), `mixer` (the mixer's prefix) and `scale` (the
    residual multiplier r: out_proj reads r * yn, so its output and its weight's gradient
    are transformers' r * out_proj(yn))."""

    LAYER_FIELDS = LAYER_FIELDS

    def __init__(self, cfg, *, norm: str = "norm.weight", mixer: str = "mixer.", scale: float = 1.0):
        super().__init__(cfg)
        self.norm_name, self.mixer_prefix, self.scale = norm, mixer, float(scale)
        self.E, self.Di, self.N, self.K = cfg.hidden_size, cfg.intermediate_size, cfg.state_size, cfg.conv_kernel
        self.H, self.P, self.G = cfg.num_heads, cfg.head_dim, cfg.n_groups
        self.C, self.W = cfg.conv_dim, cfg.in_proj_rows
        self.lo, self.hi = cfg.dt_limit

    def workspace_table(self, B: int, L: int, grad: bool, mixed: bool) -> dict:
        E, Di, H, G, C, W = self.E, self.Di, self.H, self.G, self.C, self.W
        M = B * L
        t = {"un": ((M, E), "f32", True), "rstd": ((M,), "f32", True), "zx": ((M, W), "f32", True),
             "pre": ((M, C), "f32", True), "xbc": ((M, C), "f32", True), "dt": ((M, H), "f32", True),
             "y": ((M, Di), "f32", True), "yn": ((M, Di), "f32", True), "grstd": ((M, G), "f32", True),
             "states": (ssd.state_shape(B, L, H, self.P, self.N), "f32", True)}
        if grad:
            t.update({"dyn": ((M, Di), "f32", False), "dy": ((M, Di), "f32", False),
                      "dxbc": ((M, C), "f32", False), "ddt": ((M, H), "f32", False),
                      "dzx": ((M, W), "f32", False), "dun": ((M, E), "f32", False)})
        if mixed:  # f16 copies of the products' inputs
            t.update({"un16": ((M, E), "f16", True), "yn16": ((M, Di), "f16", True)})
        return t

    def d16_elems(self, M: int) -> int:
        return max(M * self.W, M * self.E)

    def forward(self, rec, model, ws, i: int, *, train: bool, out=None) -> None:
        """ws.h[i + 1] (or `out`) = ws.h[i] + mixer(norm(ws.h[i]))."""
        c, half, lora = self.cfg, model.half, model.lora
        E, Di, N, K, H, P, G, C, W = self.E, self.Di, self.N, self.K, self.H, self.P, self.G, self.C, self.W
        M, B, L = ws.M, ws.B, ws.L
        lp = model.params.layers[i]
        h, hn = ws.h[i], (ws.h[i + 1] if out is None else out)
        rmsnorm_forward(rec, ws.un[i], ws.rstd[i], h, lp.norm_weight, c.layer_norm_epsilon, copy=hn)
        linear_forward(rec, ws.zx[i], ws.un[i], lp.in_proj_weight, lp.in_proj_bias, M=M, N=W, K=E,
                       x16=half.act(rec, ws, "un16", i, ws.un[i]), w16=half.weight(i, "in_proj_weight"))
        if lora is not None:
            lora.forward(rec, ws, i, "in_proj", ws.un[i], ws.zx[i], train=train)
        conv1d_forward(rec, ws.xbc[i], ws.pre[i], ws.zx[i], lp.conv1d_weight, lp.conv1d_bias, B=B, L=L, Di=C, K=K,
                       col=Di, ld=W)
        ssd.dt_forward(rec, ws.dt[i], ws.zx[i], lp.dt_bias, M=M, H=H, W=W, lo=self.lo, hi=self.hi)
        ssd.ssd_forward(rec, ws.y[i], ws.states[i], ws.xbc[i], ws.dt[i], lp.A_log, lp.D, B=B, L=L, H=H, P=P, N=N,
                        G=G)
        ssd.gnorm_forward(rec, ws.yn[i], ws.grstd[i], ws.y[i], ws.zx[i], lp.gnorm_weight, c.layer_norm_epsilon,
                          M=M, Di=Di, G=G, W=W)
        if self.scale != 1.0:
            scale_(rec, ws.yn[i], self.scale)
        bias, rbias = scaled_bias(lp.out_proj_bias, self.scale)
        linear_forward(rec, hn, ws.yn[i], lp.out_proj_weight, bias, M=M, N=E, K=Di, acc=True,
                       x16=half.act(rec, ws, "yn16", i, ws.yn[i]), w16=half.weight(i, "out_proj_weight"))
        if rbias is not None:
            add_scaled_bias(rec, ws, hn, rbias, self.scale, M=M, N=E)
        if lora is not None:   # (an adapter on out_proj: the hybrids')
            lora.forward(rec, ws, i, "out_proj", ws.yn[i], hn, train=train)

    def backward(self, rec, model, ws, i: int, grad) -> None:
        half, lora = model.half, model.lora
        E, Di, N, K, H, P, G, C, W = self.E, self.Di, self.N, self.K, self.H, self.P, self.G, self.C, self.W
        M, B, L = ws.M, ws.B, ws.L
        lp = model.params.layers[i]
        pre = f"{model.arch.LAYER_PREFIX}{i}."
        mz = pre + self.mixer_prefix
        linear_backward(rec, ws.dyn, grad(mz + "out_proj.weight"), grad(mz + "out_proj.bias"),
                        ws.dh, ws.yn[i], lp.out_proj_weight, bias_ones(rec, ws, self.scale), M=M, N=E, K=Di,
                        **half.operands(ws, "yn16", i, "out_proj_weight"))
        if lora is not None:
            lora.backward(rec, ws, i, "out_proj", ws.dh, ws.yn[i], ws.dyn)
        if self.scale != 1.0:
            scale_(rec, ws.dyn, self.scale)
        ssd.gnorm_backward(rec, ws.dy, ws.dzx, grad(mz + "norm.weight"), ws.dyn, ws.y[i], ws.zx[i],
                           lp.gnorm_weight, ws.grstd[i], M=M, Di=Di, G=G, W=W)
        ssd.ssd_backward(rec, ws.dxbc, ws.ddt, grad(mz + "A_log"), grad(mz + "D"), ws.dy, ws.y[i], ws.states[i],
                         ws.xbc[i],
                         ws.dt[i], lp.A_log, lp.D, B=B, L=L, H=H, P=P, N=N, G=G)
        ssd.dt_backward(rec, ws.dzx, grad(mz + "dt_bias"), ws.ddt, ws.zx[i], lp.dt_bias, M=M, H=H, W=W,
                        lo=self.lo, hi=self.hi)
        conv1d_backward(rec, ws.dzx, grad(mz + "conv1d.weight"), grad(mz + "conv1d.bias"), ws.dxbc, ws.pre[i],
                        ws.zx[i], lp.conv1d_weight, B=B, L=L, Di=C, K=K, col=Di, ld=W)
        linear_backward(rec, ws.dun, grad(mz + "in_proj.weight"), grad(mz + "in_proj.bias"),
                        ws.dzx, ws.un[i], lp.in_proj_weight, ws.ones, M=M, N=W, K=E,
                        **half.operands(ws, "un16", i, "in_proj_weight"))
        if lora is not None:
            lora.backward(rec, ws, i, "in_proj", ws.dzx, ws.un[i], ws.dun)
        rmsnorm_backward(rec, ws.dh, grad(pre + self.norm_name), ws.dun, ws.h[i], lp.norm_weight, ws.rstd[i])

    # ------------------------------------------------------------------ recurrent decoding
    def decode_state(self, rt):
        E, Di, N, K, H, P, G, C, W = self.E, self.Di, self.N, self.K, self.H, self.P, self.G, self.C, self.W
        e = rt.empty
        st = SimpleNamespace()
        st.un, st.rstd = e((E,), name="dec.un"), e((1,), name="dec.rstd")
        st.zx, st.xbc, st.dt = e((W,), name="dec.zx"), e((C,), name="dec.xbc"), e((H,), name="dec.dt")
        st.y, st.yn, st.grstd = e((Di,), name="dec.y"), e((Di,), name="dec.yn"), e((G,), name="dec.grstd")
        made = [st.un, st.rstd, st.zx, st.xbc, st.dt, st.y, st.yn, st.grstd]
        if self.scale != 1.0:
            st.r = rt.upload(np.array([self.scale, 0, 0, 0], np.float32), name="dec.r")
            made.append(st.r)
        nl = self.cfg.num_hidden_layers
        st.conv = [e((max(K - 1, 1), C), name=f"dec.conv{i}") for i in range(nl)]
        st.ssm = [e((H, P, N), name=f"dec.ssm{i}") for i in range(nl)]
        return st, made + st.conv + st.ssm

    def decode_prefill(self, rec, model, st, ws, i: int, L: int) -> None:
        Di, N, K, H, P, C, W = self.Di, self.N, self.K, self.H, self.P, self.C, self.W
        ssd.conv_prefill(rec, st.conv[i], ws.zx[i].view((L * W,)), L=L, Di=Di, C=C, W=W, K=K)
        S = H * P * N
        nc = ssd.n_chunks(L)
        rec.copy(ws.states[i].view((S,), nc * S), st.ssm[i].view((S,)))   # the state after the last step

    def decode_step(self, rec, model, st, i: int, h) -> None:
        c, lora = self.cfg, model.lora
        E, Di, N, K, H, P, G, C, W = self.E, self.Di, self.N, self.K, self.H, self.P, self.G, self.C, self.W
        lp = model.params.layers[i]
        rmsnorm_forward(rec, st.un, st.rstd, h, lp.norm_weight, c.layer_norm_epsilon)
        matvec(rec, st.zx, lp.in_proj_weight, st.un, lp.in_proj_bias, rows=W, K=E)
        if lora is not None:
            lora.step(rec, i, "in_proj", st.un, st.zx)
        ssd.conv_step(rec, st.xbc, st.conv[i], st.zx, lp.conv1d_weight, lp.conv1d_bias, Di=Di, C=C, K=K)
        ssd.dt_forward(rec, st.dt, st.zx, lp.dt_bias, M=1, H=H, W=W, lo=self.lo, hi=self.hi)
        ssd.ssd_step(rec, st.y, st.ssm[i], st.xbc, st.dt, lp.A_log, lp.D, H=H, P=P, N=N, G=G)
        ssd.gnorm_forward(rec, st.yn, st.grstd, st.y, st.zx, lp.gnorm_weight, c.layer_norm_epsilon,
                          M=1, Di=Di, G=G, W=W)
        if self.scale != 1.0:
            scale_(rec, st.yn, self.scale)
        bias, rbias = scaled_bias(lp.out_proj_bias, self.scale)
        matvec(rec, h, lp.out_proj_weight, st.yn, bias, rows=E, K=Di, acc=True)
        if rbias is not None:   # h += r * b: the [1, 1] value r times the [1, E] bias
            matmul(rec, h, st.r, rbias, M=1, N=E, K=1, acc=True)
        if lora is not None:
            lora.step(rec, i, "out_proj", st.yn, h)
