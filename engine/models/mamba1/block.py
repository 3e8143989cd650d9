"""The Mamba-1 (S6) layer on the GPU: forward, backward and the recurrent decode step.

Names are the checkpoint's (`in_proj`, `x_proj`, `dt_proj`, `A_log`, `D`); see the
glossary in DEVELOPERS.md for the letters.  The computation is exactly SPEC section 2
(transformers' MambaForCausalLM slow path), per layer:

    u = rmsnorm(h); xz = in_proj(u); xc = silu(conv(x)); xdbl = x_proj(xc)
    delta = dt_proj.weight @ dt_low; y = scan(xc, delta, A_log, B, C, D, z)
    h = h + out_proj(y)

falcon_mamba (`FalconMambaForCausalLM`) differs in one place: dt_low, B and C (the three
column slices of xdbl) each pass a weightless RMS norm (eps `mixer_rms_eps`) before dt_proj
and the scan use them.  That variant is data here: `self.mixer_norms` lists the three
column slices (none for mamba), and the normalised copy `xdbl_n` is, for mamba, the same
buffer as xdbl.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from memengine.engine.kernels.conv1d import conv1d_backward, conv1d_forward
from memengine.engine.kernels.decode import (
    conv_prefill,
    conv_step,
    matvec,
    pack_layer_constants,
    ssm_prefill,
    ssm_step,
)
from memengine.engine.kernels.matmul import linear_backward, linear_forward
from memengine.engine.kernels.rmsnorm import rmsnorm_backward, rmsnorm_forward
from memengine.engine.kernels.scan import scan_state_shape, selective_scan_backward, selective_scan_forward
from memengine.engine.models.base import Block

LAYER_FIELDS = {
    "norm.weight": "norm_weight",                 # [E]
    "mixer.in_proj.weight": "in_proj_weight",     # [2Di, E]   rows [x ; z]
    "mixer.in_proj.bias": "in_proj_bias",         # [2Di]      when use_bias
    "mixer.conv1d.weight": "conv1d_weight",       # [Di, K]    (checkpoint [Di, 1, K])
    "mixer.conv1d.bias": "conv1d_bias",           # [Di]       when use_conv_bias
    "mixer.x_proj.weight": "x_proj_weight",       # [R+2N, Di]
    "mixer.dt_proj.weight": "dt_proj_weight",     # [Di, R]
    "mixer.dt_proj.bias": "dt_proj_bias",         # [Di]
    "mixer.A_log": "A_log",                       # [Di, N]
    "mixer.D": "D",                               # [Di]
    "mixer.out_proj.weight": "out_proj_weight",   # [E, Di]
    "mixer.out_proj.bias": "out_proj_bias",       # [E]        when use_bias
}


class Mamba1Block(Block):
    LAYER_FIELDS = LAYER_FIELDS

    def __init__(self, cfg):
        super().__init__(cfg)
        E, Di, N, R, K = cfg.hidden_size, cfg.intermediate_size, cfg.state_size, cfg.dt_rank, cfg.conv_kernel
        self.dims = (E, Di, N, R, K)
        # falcon_mamba's weightless norms: (first column, width) of dt_low, B and C in xdbl
        self.mixer_norms = ((0, R), (R, N), (R + N, N)) if cfg.model_type == "falcon_mamba" else ()
        self._ones = None

    # ------------------------------------------------------------------ activations
    def workspace_table(self, B: int, L: int, grad: bool, mixed: bool) -> dict:
        E, Di, N, R, K = self.dims
        M = B * L
        t = {
            "un": ((M, E), "f32", True), "rstd": ((M,), "f32", True), "xz": ((M, 2 * Di), "f32", True),
            "pre": ((M, Di), "f32", True), "xc": ((M, Di), "f32", True), "xdbl": ((M, R + 2 * N), "f32", True),
            "delta": ((M, Di), "f32", True), "y": ((M, Di), "f32", True),
            "states": (scan_state_shape(B, L, Di, N), "f32", True),
        }
        if self.mixer_norms:  # the normalised dt_low/B/C and the three norms' rstd
            t.update({"xdbl_n": ((M, R + 2 * N), "f32", True), "mixer_rstd": ((3 * M,), "f32", True)})
        if grad:  # backward scratch shared by all layers
            t.update({"du": ((M, Di), "f32", False), "ddelta": ((M, Di), "f32", False),
                      "dxdbl": ((M, R + 2 * N), "f32", False), "dxz": ((M, 2 * Di), "f32", False),
                      "dun": ((M, E), "f32", False)})
            if self.mixer_norms:
                t["dxdbl_raw"] = ((M, R + 2 * N), "f32", False)
        if mixed:  # f16 copies of the products' inputs
            t.update({"un16": ((M, E), "f16", True), "xc16": ((M, Di), "f16", True),
                      "xdbl16": ((M, R + 2 * N), "f16", True), "y16": ((M, Di), "f16", True)})
        return t

    def d16_elems(self, M: int) -> int:
        E, Di, N, R, K = self.dims
        return max(M * 2 * Di, M * (R + 2 * N), M * E)

    def finish_workspace(self, ws) -> None:
        if not self.mixer_norms:  # mamba: dt_low/B/C are read from xdbl itself
            ws.xdbl_n, ws.mixer_rstd = ws.xdbl, None
            if ws.grad:
                ws.dxdbl_raw = ws.dxdbl

    def _mixer_ones(self, rt):
        """The weightless norms' weight (ones), made once."""
        if self._ones is None:
            E, Di, N, R, K = self.dims
            self._ones = rt.upload(np.ones(max(R, N), np.float32), name="mixer_norm_ones")
        return self._ones

    def _norm_views(self, ws, i: int) -> list:
        """falcon_mamba's weightless norms of layer i: (first column, width, rstd view)."""
        M = ws.M
        rs = ws.mixer_rstd[i] if self.mixer_norms else None
        return [(col, w, rs.view((M,), j * M)) for j, (col, w) in enumerate(self.mixer_norms)]

    # ------------------------------------------------------------------ forward
    def forward(self, rec, model, ws, i: int, *, train: bool) -> None:
        c, half, lora = self.cfg, model.half, model.lora
        E, Di, N, R, K = self.dims
        M, B, L = ws.M, ws.B, ws.L
        lp = model.params.layers[i]
        h, hn = ws.h[i], ws.h[i + 1]
        # the norm also writes h_next = h, which out_proj then adds into (the residual)
        rmsnorm_forward(rec, ws.un[i], ws.rstd[i], h, lp.norm_weight, c.layer_norm_epsilon, copy=hn)
        linear_forward(rec, ws.xz[i], ws.un[i], lp.in_proj_weight, lp.in_proj_bias, M=M, N=2 * Di, K=E,
                       x16=half.act(rec, ws, "un16", i, ws.un[i]), w16=half.weight(i, "in_proj_weight"))
        if lora is not None:
            lora.forward(rec, ws, i, "in_proj", ws.un[i], ws.xz[i], train=train)
        conv1d_forward(rec, ws.xc[i], ws.pre[i], ws.xz[i], lp.conv1d_weight, lp.conv1d_bias, B=B, L=L, Di=Di, K=K)
        linear_forward(rec, ws.xdbl[i], ws.xc[i], lp.x_proj_weight, None, M=M, N=R + 2 * N, K=Di,
                       x16=half.act(rec, ws, "xc16", i, ws.xc[i]), w16=half.weight(i, "x_proj_weight"))
        if lora is not None:
            lora.forward(rec, ws, i, "x_proj", ws.xc[i], ws.xdbl[i], train=train)
        for col, w, rstd in self._norm_views(ws, i):
            rmsnorm_forward(rec, ws.xdbl_n[i], rstd, ws.xdbl[i], self._mixer_ones(model.rt).view((w,)),
                            c.mixer_rms_eps, col=col, ld=R + 2 * N)
        linear_forward(rec, ws.delta[i], ws.xdbl_n[i], lp.dt_proj_weight, None, M=M, N=Di, K=R,
                       ldx=R + 2 * N, x16=half.act(rec, ws, "xdbl16", i, ws.xdbl_n[i]),
                       w16=half.weight(i, "dt_proj_weight"))
        selective_scan_forward(rec, ws.y[i], ws.states[i], ws.xc[i], ws.delta[i], lp.dt_proj_bias,
                               lp.A_log, lp.D, ws.xdbl_n[i], ws.xz[i], B=B, L=L, Di=Di, N=N, R=R)
        # residual add fused into out_proj: h_next (= h, from the norm) += y @ out_proj^T (+ b)
        linear_forward(rec, hn, ws.y[i], lp.out_proj_weight, lp.out_proj_bias, M=M, N=E, K=Di, acc=True,
                       x16=half.act(rec, ws, "y16", i, ws.y[i]), w16=half.weight(i, "out_proj_weight"))

    # ------------------------------------------------------------------ backward
    def backward(self, rec, model, ws, i: int, grad) -> None:
        half, lora = model.half, model.lora
        E, Di, N, R, K = self.dims
        M, B, L = ws.M, ws.B, ws.L
        lp = model.params.layers[i]
        pre = f"{model.arch.LAYER_PREFIX}{i}."
        mz = pre + "mixer."
        # dy (the gated scan output's gradient) goes into du: the scan reads it there
        linear_backward(rec, ws.du, grad(mz + "out_proj.weight"), grad(mz + "out_proj.bias"),
                        ws.dh, ws.y[i], lp.out_proj_weight, ws.ones, M=M, N=E, K=Di,
                        **half.operands(ws, "y16", i, "out_proj_weight"))
        selective_scan_backward(rec, ws.du, ws.ddelta, grad(mz + "dt_proj.bias"), grad(mz + "A_log"),
                                grad(mz + "D"), ws.dxdbl, ws.dxz, ws.du, ws.states[i], ws.xc[i], ws.delta[i],
                                lp.dt_proj_bias, lp.A_log, lp.D, ws.xdbl_n[i], ws.xz[i], B=B, L=L, Di=Di, N=N,
                                R=R)
        linear_backward(rec, ws.dxdbl, grad(mz + "dt_proj.weight"), None, ws.ddelta, ws.xdbl_n[i],
                        lp.dt_proj_weight, M=M, N=Di, K=R, ldx=R + 2 * N, lddx=R + 2 * N,
                        **half.operands(ws, "xdbl16", i, "dt_proj_weight"))
        norms = self._norm_views(ws, i)
        if norms:  # back through the dt/B/C norms: dxdbl (normalised) -> dxdbl_raw
            rec.clear(ws.dxdbl_raw)
        for col, w, rstd in norms:
            rmsnorm_backward(rec, ws.dxdbl_raw, None, ws.dxdbl, ws.xdbl[i], self._mixer_ones(model.rt).view((w,)),
                             rstd, col=col, ld=R + 2 * N)
        linear_backward(rec, ws.du, grad(mz + "x_proj.weight"), None, ws.dxdbl_raw, ws.xc[i], lp.x_proj_weight,
                        M=M, N=R + 2 * N, K=Di, dx_acc=True, **half.operands(ws, "xc16", i, "x_proj_weight"))
        if lora is not None:
            lora.backward(rec, ws, i, "x_proj", ws.dxdbl_raw, ws.xc[i], ws.du)
        conv1d_backward(rec, ws.dxz, grad(mz + "conv1d.weight"), grad(mz + "conv1d.bias"), ws.du, ws.pre[i],
                        ws.xz[i], lp.conv1d_weight, B=B, L=L, Di=Di, K=K)
        linear_backward(rec, ws.dun, grad(mz + "in_proj.weight"), grad(mz + "in_proj.bias"),
                        ws.dxz, ws.un[i], lp.in_proj_weight, ws.ones, M=M, N=2 * Di, K=E,
                        **half.operands(ws, "un16", i, "in_proj_weight"))
        if lora is not None:
            lora.backward(rec, ws, i, "in_proj", ws.dxz, ws.un[i], ws.dun)
        rmsnorm_backward(rec, ws.dh, grad(pre + "norm.weight"), ws.dun, ws.h[i], lp.norm_weight, ws.rstd[i])

    # ------------------------------------------------------------------ recurrent decoding
    def decode_state(self, rt):
        """The step's buffers and, per layer, the conv state [K-1, Di], the SSM state
        [Di, N] and the step kernel's constants (A_log, dt_proj.bias, D): (state, the
        tensors made)."""
        E, Di, N, R, K = self.dims
        e = rt.empty
        st = SimpleNamespace()
        st.un, st.rstd = e((E,), name="dec.un"), e((1,), name="dec.rstd")
        st.xz, st.xc = e((2 * Di,), name="dec.xz"), e((Di,), name="dec.xc")
        st.xdbl, st.y = e((R + 2 * N,), name="dec.xdbl"), e((Di,), name="dec.y")
        made = [st.un, st.rstd, st.xz, st.xc, st.xdbl, st.y]
        if self.mixer_norms:  # falcon_mamba: dt_low, B, C each through a weightless RMS norm
            st.xdbl_n = e((R + 2 * N,), name="dec.xdbl_n")
            st.mixer_rstd = e((3,), name="dec.mixer_rstd")
            st.dec_ones = rt.upload(np.ones(max(R, N), np.float32), name="dec.ones")
            made += [st.xdbl_n, st.mixer_rstd, st.dec_ones]
        else:
            st.xdbl_n = st.xdbl
        nl = self.cfg.num_hidden_layers
        st.conv = [e((max(K - 1, 1), Di), name=f"dec.conv{i}") for i in range(nl)]
        st.ssm = [e((Di, N), name=f"dec.ssm{i}") for i in range(nl)]
        st.consts = [e((Di * N + 2 * Di,), name=f"dec.consts{i}") for i in range(nl)]
        return st, made + st.conv + st.ssm + st.consts

    def decode_prefill(self, rec, model, st, ws, i: int, L: int) -> None:
        """Layer i's recurrent state from its activations in the workspace: the last K-1
        conv inputs, and the SSM state after the last position (the scan's saved state at
        the start of the last chunk, stepped through the chunk's remaining rows)."""
        E, Di, N, R, K = self.dims
        lp = model.params.layers[i]
        pack_layer_constants(rec, st.consts[i], lp.A_log, lp.dt_proj_bias, lp.D, Di=Di, N=N)
        conv_prefill(rec, st.conv[i], ws.xz[i], L=L, Di=Di, K=K)
        ssm_prefill(rec, st.ssm[i], ws.states[i], ws.xc[i], ws.delta[i], ws.xdbl_n[i], st.consts[i],
                    L=L, Di=Di, N=N, R=R)

    def decode_step(self, rec, model, st, i: int, h) -> None:
        c, lora = self.cfg, model.lora
        E, Di, N, R, K = self.dims
        lp = model.params.layers[i]
        rmsnorm_forward(rec, st.un, st.rstd, h, lp.norm_weight, c.layer_norm_epsilon)
        matvec(rec, st.xz, lp.in_proj_weight, st.un, lp.in_proj_bias, rows=2 * Di, K=E)
        if lora is not None:  # a LoRA adapter, applied without merging
            lora.step(rec, i, "in_proj", st.un, st.xz)
        conv_step(rec, st.xc, st.conv[i], st.xz, lp.conv1d_weight, lp.conv1d_bias, Di=Di, K=K)
        matvec(rec, st.xdbl, lp.x_proj_weight, st.xc, rows=R + 2 * N, K=Di)
        if lora is not None:
            lora.step(rec, i, "x_proj", st.xc, st.xdbl)
        for j, (col, w) in enumerate(self.mixer_norms):
            rmsnorm_forward(rec, st.xdbl_n, st.mixer_rstd.view((1,), j), st.xdbl,
                            st.dec_ones.view((w,)), c.mixer_rms_eps, col=col, ld=R + 2 * N)
        ssm_step(rec, st.y, st.ssm[i], st.xc, st.xdbl_n, st.xz, lp.dt_proj_weight, st.consts[i],
                 Di=Di, N=N, R=R)
        matvec(rec, h, lp.out_proj_weight, st.y, lp.out_proj_bias, rows=E, K=Di, acc=True)
