"""A hybrid's layer on the GPU: forward and backward.  Per layer i, as transformers'
GraniteMoeHybridDecoderLayer / BambaDecoderLayer (r: Granite's residual_multiplier, else 1):

    u    = rmsnorm(h, input_layernorm)
    hm   = h + r * mixer(u)          mixer: the Mamba-2 mixer (engine/models/ssd_mixer.py,
                                      shared with Mamba-2) or causal self-attention:
               q, k, v = u Wq^T, u Wk^T, u Wv^T;  q, k = rope(q), rope(k) (when configured)
               a = attention(q, k, v) (GQA, scale = attention_multiplier or 1/sqrt(D));  o_proj(a)
    u2   = rmsnorm(hm, post_attention_layernorm | pre_ff_layernorm)
    h'   = hm + r * down(silu(gate(u2)) * up(u2))

r is folded into the input of the layer's last product (out_proj, o_proj, the down
projection): r * W x = W (r x), and the weight's gradient dh^T (r x) is then transformers'.
"""

from __future__ import annotations

from memengine.engine.errors import MemengineError
from memengine.engine.kernels import attention as attn
from memengine.engine.kernels.lora import scale_
from memengine.engine.kernels.matmul import linear_backward, linear_forward
from memengine.engine.kernels.rmsnorm import rmsnorm_backward, rmsnorm_forward
from memengine.engine.kernels.rope import rope_backward, rope_forward, rope_table
from memengine.engine.kernels.swiglu import swiglu_backward, swiglu_forward
from memengine.engine.models.base import Block
from memengine.engine.models.hybrid.config import ATTENTION
from memengine.engine.models.hybrid.tensors import BAMBA, GRANITE, LAYER_FIELDS, names
from memengine.engine.models.ssd_mixer import Mamba2Block, add_scaled_bias, bias_ones, scaled_bias


class HybridBlock(Block):
    LAYER_FIELDS = LAYER_FIELDS

    def __init__(self, cfg):
        super().__init__(cfg)
        self.r = cfg.residual_multiplier
        self.mamba = Mamba2Block(cfg.mamba, norm="input_layernorm.weight", mixer="mamba.", scale=self.r)
        self.E, self.I = cfg.hidden_size, cfg.intermediate_size
        self.Hq, self.Hkv, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.granite = cfg.model_type == "granitemoehybrid"
        self.n = names(cfg)
        other = BAMBA if self.granite else GRANITE   # the other model type's names of the same fields
        self.LAYER_FIELDS = {k: f for k, f in LAYER_FIELDS.items()
                             if not (k == other["norm2"] or k.startswith(other["mlp"]))}

    # -- activations
    def workspace_table(self, B: int, L: int, grad: bool, mixed: bool) -> dict:
        if mixed:
            raise MemengineError(f"--precision mixed is not yet supported for {self.cfg.model_type}")
        E, I, Hq, Hkv, D = self.E, self.I, self.Hq, self.Hkv, self.D
        M = B * L
        t = dict(self.mamba.workspace_table(B, L, grad, mixed))
        t.update({"hm": ((M, E), "f32", True), "un2": ((M, E), "f32", True), "rstd2": ((M,), "f32", True),
                  "gu": ((M, 2 * I), "f32", True), "act": ((M, I), "f32", True)})
        if self.r != 1.0:
            t["rones"] = ((M,), "f32", False)   # M values r: the scaled biases (ssd_mixer.bias_ones)
        if self.cfg.attention_layers:
            t.update({"q": ((M, Hq * D), "f32", True), "k": ((M, Hkv * D), "f32", True),
                      "v": ((M, Hkv * D), "f32", True), "att": ((M, Hq * D), "f32", True),
                      "lse": ((M, Hq), "f32", True), "lsum": ((M, Hq), "f32", False)})
            if self.cfg.rope:
                t["rope"] = ((L, self.cfg.rotary_dims), "f32", False)
            if grad:
                t.update({"datt": ((M, Hq * D), "f32", False), "dq": ((M, Hq * D), "f32", False),
                          "dk": ((M, Hkv * D), "f32", False), "dv": ((M, Hkv * D), "f32", False),
                          "delta": ((M, Hq), "f32", False)})
        if grad:
            t.update({"dact": ((M, I), "f32", False), "dgu": ((M, 2 * I), "f32", False),
                      "dun2": ((M, E), "f32", False)})
            t.setdefault("dun", ((M, E), "f32", False))
        return t

    def _rope_table(self, rec, ws):
        if not getattr(ws, "_rope_written", False):
            rec.rt.write(ws.rope, rope_table(ws.L, self.cfg.rotary_dims, self.cfg.rope_theta))
            ws._rope_written = True
        return ws.rope

    # -- the layers
    def forward(self, rec, model, ws, i: int, *, train: bool) -> None:
        c, lora = self.cfg, model.lora
        E, I, M = self.E, self.I, ws.M
        lp = model.params.layers[i]
        hm = ws.hm[i]
        if c.layer_kinds[i] == ATTENTION:
            self._attention_forward(rec, model, ws, i, train=train)
        else:
            self.mamba.forward(rec, model, ws, i, train=train, out=hm)
        un2 = ws.un2[i]
        rmsnorm_forward(rec, un2, ws.rstd2[i], hm, lp.norm2_weight, c.rms_norm_eps, copy=ws.h[i + 1])
        gu = ws.gu[i]
        if self.granite:
            linear_forward(rec, gu, un2, lp.gu_weight, None, M=M, N=2 * I, K=E)
            if lora is not None:
                lora.forward(rec, ws, i, "input_linear", un2, gu, train=train)
        else:
            for col, w, b, t in ((0, lp.gate_weight, lp.gate_bias, "gate_proj"), (I, lp.up_weight, lp.up_bias,
                                                                                    "up_proj")):
                linear_forward(rec, gu, un2, w, b, M=M, N=I, K=E, ldo=2 * I, out_col=col)
        swiglu_forward(rec, ws.act[i], gu, rows=M, I=I, r=self.r)
        linear_forward(rec, ws.h[i + 1], ws.act[i], lp.down_weight, None if self.granite else lp.down_bias, M=M, N=E,
                       K=I, acc=True)

    def _attention_forward(self, rec, model, ws, i: int, *, train: bool) -> None:
        c = self.cfg
        E, Hq, Hkv, D, M, B, L = self.E, self.Hq, self.Hkv, self.D, ws.M, ws.B, ws.L
        lp = model.params.layers[i]
        rmsnorm_forward(rec, ws.un[i], ws.rstd[i], ws.h[i], lp.norm_weight, c.rms_norm_eps, copy=ws.hm[i])
        q, k, v = ws.q[i], ws.k[i], ws.v[i]
        linear_forward(rec, q, ws.un[i], lp.q_weight, lp.q_bias, M=M, N=Hq * D, K=E)
        linear_forward(rec, k, ws.un[i], lp.k_weight, lp.k_bias, M=M, N=Hkv * D, K=E)
        linear_forward(rec, v, ws.un[i], lp.v_weight, lp.v_bias, M=M, N=Hkv * D, K=E)
        if c.rope:
            table = self._rope_table(rec, ws)
            R = c.rotary_dims
            rope_forward(rec, q, table, rows=M, L=L, heads=Hq, D=D, R=R, ld=Hq * D)
            rope_forward(rec, k, table, rows=M, L=L, heads=Hkv, D=D, R=R, ld=Hkv * D)
        att = ws.att[i]
        attn.attention_forward(rec, att, ws.lse[i], q, k, v, ws.lsum, B=B, L=L, Hq=Hq, Hkv=Hkv, D=D,
                               scale=c.attention_scale)
        if self.r != 1.0:
            scale_(rec, att, self.r)
        bias, rbias = scaled_bias(lp.o_bias, self.r)
        linear_forward(rec, ws.hm[i], att, lp.o_weight, bias, M=M, N=E, K=Hq * D, acc=True)
        if rbias is not None:
            add_scaled_bias(rec, ws, ws.hm[i], rbias, self.r, M=M, N=E)

    def backward(self, rec, model, ws, i: int, grad) -> None:
        c = self.cfg
        E, I, M = self.E, self.I, ws.M
        lp = model.params.layers[i]
        pre = f"{model.arch.LAYER_PREFIX}{i}."
        mlp = pre + self.n["mlp"]
        d = "output_linear" if self.granite else "down_proj"
        linear_backward(rec, ws.dact, grad(f"{mlp}{d}.weight"), grad(f"{mlp}{d}.bias"), ws.dh, ws.act[i],
                        lp.down_weight, ws.ones, M=M, N=E, K=I)
        swiglu_backward(rec, ws.dgu, ws.dact, ws.gu[i], rows=M, I=I, r=self.r)
        if self.granite:
            linear_backward(rec, ws.dun2, grad(mlp + "input_linear.weight"), None, ws.dgu, ws.un2[i],
                            lp.gu_weight, M=M, N=2 * I, K=E)
        else:
            for col, w, t in ((0, lp.gate_weight, "gate_proj"), (I, lp.up_weight, "up_proj")):
                linear_backward(rec, ws.dun2, grad(f"{mlp}{t}.weight"), grad(f"{mlp}{t}.bias"), ws.dgu, ws.un2[i],
                                w, ws.ones, M=M, N=I, K=E, lddo=2 * I, dout_col=col, dx_acc=col > 0)
        rmsnorm_backward(rec, ws.dh, grad(pre + self.n["norm2"]), ws.dun2, ws.hm[i], lp.norm2_weight, ws.rstd2[i])
        if c.layer_kinds[i] == ATTENTION:
            self._attention_backward(rec, model, ws, i, grad)
        else:
            self.mamba.backward(rec, model, ws, i, grad)

    def _attention_backward(self, rec, model, ws, i: int, grad) -> None:
        c = self.cfg
        E, Hq, Hkv, D, M, B, L = self.E, self.Hq, self.Hkv, self.D, ws.M, ws.B, ws.L
        lp = model.params.layers[i]
        a = f"{model.arch.LAYER_PREFIX}{i}.self_attn."
        linear_backward(rec, ws.datt, grad(a + "o_proj.weight"), grad(a + "o_proj.bias"), ws.dh, ws.att[i],
                        lp.o_weight, bias_ones(rec, ws, self.r), M=M, N=E, K=Hq * D)
        if self.r != 1.0:
            scale_(rec, ws.datt, self.r)
        attn.attention_backward(rec, ws.dq, ws.dk, ws.dv, ws.delta, ws.datt, ws.att[i], ws.lse[i], ws.q[i],
                                ws.k[i], ws.v[i], B=B, L=L, Hq=Hq, Hkv=Hkv, D=D, scale=c.attention_scale,
                                o_scale=self.r)
        if c.rope:
            table, R = ws.rope, c.rotary_dims
            rope_backward(rec, ws.dq, table, rows=M, L=L, heads=Hq, D=D, R=R, ld=Hq * D)
            rope_backward(rec, ws.dk, table, rows=M, L=L, heads=Hkv, D=D, R=R, ld=Hkv * D)
        for j, (t, w, dout, n) in enumerate((("q_proj", lp.q_weight, ws.dq, Hq * D), ("k_proj", lp.k_weight, ws.dk,
                                                                                      Hkv * D),
                                             ("v_proj", lp.v_weight, ws.dv, Hkv * D))):
            linear_backward(rec, ws.dun, grad(f"{a}{t}.weight"), grad(f"{a}{t}.bias"), dout, ws.un[i], w, ws.ones,
                            M=M, N=n, K=E, dx_acc=j > 0)
        rmsnorm_backward(rec, ws.dh, grad(f"{model.arch.LAYER_PREFIX}{i}.input_layernorm.weight"), ws.dun,
                         ws.h[i], lp.norm_weight, ws.rstd[i])

    # -- recurrent decoding
    def decode_state(self, rt):
        raise MemengineError(f"generate does not yet run {self.cfg.model_type} models (their attention layers need "
                             "a KV cache the decoder does not have yet)")
