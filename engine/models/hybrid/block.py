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

import numpy as np
from memengine.engine.errors import MemengineError
from memengine.engine.kernels import attention as attn
from memengine.engine.kernels.lora import scale_
from memengine.engine.kernels.decode import matvec
from memengine.engine.kernels.matmul import linear_backward, linear_forward, matmul
from memengine.engine.kernels.rmsnorm import rmsnorm_backward, rmsnorm_forward
from memengine.engine.kernels.rope import rope_backward, rope_forward, rope_step, rope_table
from memengine.engine.kernels.swiglu import swiglu_backward, swiglu_forward
from memengine.engine.models.base import Block
from memengine.engine.models.hybrid.config import ATTENTION
from memengine.engine.models.hybrid.tensors import BAMBA, GRANITE, LAYER_FIELDS, names
from memengine.engine.models.ssd_mixer import Mamba2Block, add_scaled_bias, bias_ones, scaled_bias


DECODE_CAPACITY = 4096   # positions of the KV cache generate keeps (at most max_position_embeddings)


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
        self.down = "output_linear" if self.granite else "down_proj"
        other = BAMBA if self.granite else GRANITE   # the other model type's names of the same fields
        self.LAYER_FIELDS = {k: f for k, f in LAYER_FIELDS.items()
                             if not (k == other["norm2"] or k.startswith(other["mlp"]))}

    # -- activations
    def workspace_table(self, B: int, L: int, grad: bool, mixed: bool) -> dict:
        E, I, Hq, Hkv, D = self.E, self.I, self.Hq, self.Hkv, self.D
        M = B * L
        att = list(self.cfg.attention_layers)
        mam = [i for i in range(self.cfg.num_hidden_layers) if i not in att]
        t = {n: (shape, dt, mam if per else False) for n, (shape, dt, per) in
             self.mamba.workspace_table(B, L, grad, mixed).items()}
        # the pre-norm's output and rstd serve both kinds
        t["un"], t["rstd"] = ((M, E), "f32", True), ((M,), "f32", True)
        t.update({"hm": ((M, E), "f32", True), "un2": ((M, E), "f32", True), "rstd2": ((M,), "f32", True),
                  "gu": ((M, 2 * I), "f32", True), "act": ((M, I), "f32", True)})
        if self.r != 1.0:
            t["rones"] = ((M,), "f32", False)   # M values r: the scaled biases (ssd_mixer.bias_ones)
        if self.cfg.attention_layers:
            t.update({"q": ((M, Hq * D), "f32", att), "k": ((M, Hkv * D), "f32", att),
                      "v": ((M, Hkv * D), "f32", att), "att": ((M, Hq * D), "f32", att),
                      "lse": ((M, Hq), "f32", att), "lsum": ((M, Hq), "f32", False)})
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
        if mixed:   # f16 copies of the products' inputs: the pre-norm's output in every layer
            t.update({"un16": ((M, E), "f16", True), "un216": ((M, E), "f16", True), "act16": ((M, I), "f16", True)})
            if self.cfg.attention_layers:
                t["att16"] = ((M, Hq * D), "f16", att)
            if self.cfg.attention_layers and attn.sg_head_dim(D):
                # the attention's own operands where it runs on subgroup matrices (their rows of
                # zeros after M: attention.SG_PAD_ROWS); datt16 only for its scale slot's sake per layer
                Mp = M + attn.SG_PAD_ROWS
                t.update({"q16": ((Mp, Hq * D), "f16", att), "k16": ((Mp, Hkv * D), "f16", att),
                          "v16": ((Mp, Hkv * D), "f16", att)})
                if grad:
                    t["datt16"] = ((Mp, Hq * D), "f16", att)
        return t

    def d16_elems(self, M: int) -> int:
        return max(self.mamba.d16_elems(M), M * 2 * self.I, M * self.Hq * self.D)

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
        half = model.half
        un216 = half.act(rec, ws, "un216", i, un2)
        if self.granite:
            linear_forward(rec, gu, un2, lp.gu_weight, None, M=M, N=2 * I, K=E, x16=un216,
                           w16=half.weight(i, "gu_weight"))
            if lora is not None:
                lora.forward(rec, ws, i, "input_linear", un2, gu, train=train)
        else:
            for col, w, b, t, f in ((0, lp.gate_weight, lp.gate_bias, "gate_proj", "gate_weight"),
                                    (I, lp.up_weight, lp.up_bias, "up_proj", "up_weight")):
                linear_forward(rec, gu, un2, w, b, M=M, N=I, K=E, ldo=2 * I, out_col=col, x16=un216,
                               w16=half.weight(i, f))
                if lora is not None:
                    lora.forward(rec, ws, i, t, un2, gu, train=train, ldo=2 * I, out_col=col)
        swiglu_forward(rec, ws.act[i], gu, rows=M, I=I, r=self.r)
        linear_forward(rec, ws.h[i + 1], ws.act[i], lp.down_weight, None if self.granite else lp.down_bias, M=M, N=E,
                       K=I, acc=True, x16=half.act(rec, ws, "act16", i, ws.act[i]), w16=half.weight(i, "down_weight"))
        if lora is not None:
            lora.forward(rec, ws, i, self.down, ws.act[i], ws.h[i + 1], train=train)

    def _attention_forward(self, rec, model, ws, i: int, *, train: bool) -> None:
        c = self.cfg
        E, Hq, Hkv, D, M, B, L = self.E, self.Hq, self.Hkv, self.D, ws.M, ws.B, ws.L
        lp = model.params.layers[i]
        rmsnorm_forward(rec, ws.un[i], ws.rstd[i], ws.h[i], lp.norm_weight, c.rms_norm_eps, copy=ws.hm[i])
        q, k, v = ws.q[i], ws.k[i], ws.v[i]
        half = model.half
        un16 = half.act(rec, ws, "un16", i, ws.un[i])
        for out, w, b, f, n in ((q, lp.q_weight, lp.q_bias, "q_weight", Hq * D), (k, lp.k_weight, lp.k_bias, "k_weight",
                                                                                Hkv * D),
                                (v, lp.v_weight, lp.v_bias, "v_weight", Hkv * D)):
            linear_forward(rec, out, ws.un[i], w, b, M=M, N=n, K=E, x16=un16, w16=half.weight(i, f))
        lora = model.lora
        if lora is not None:
            for t, out in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                lora.forward(rec, ws, i, t, ws.un[i], out, train=train)
        if c.rope:
            table = self._rope_table(rec, ws)
            R = c.rotary_dims
            rope_forward(rec, q, table, rows=M, L=L, heads=Hq, D=D, R=R, ld=Hq * D)
            rope_forward(rec, k, table, rows=M, L=L, heads=Hkv, D=D, R=R, ld=Hkv * D)
        att = ws.att[i]
        if half.mixed and attn.takes_subgroup_matrices(rec.rt, D):
            q16, k16, v16 = (half.act(rec, ws, n, i, x) for n, x in (("q16", q), ("k16", k), ("v16", v)))
            attn.attention_forward_f16(rec, att, ws.lse[i], q16, k16, v16, B=B, L=L, Hq=Hq, Hkv=Hkv, D=D,
                                       scale=c.attention_scale)
        else:
            attn.attention_forward(rec, att, ws.lse[i], q, k, v, ws.lsum, B=B, L=L, Hq=Hq, Hkv=Hkv, D=D,
                                   scale=c.attention_scale)
        if self.r != 1.0:
            scale_(rec, att, self.r)
        bias, rbias = scaled_bias(lp.o_bias, self.r)
        linear_forward(rec, ws.hm[i], att, lp.o_weight, bias, M=M, N=E, K=Hq * D, acc=True,
                       x16=half.act(rec, ws, "att16", i, att), w16=half.weight(i, "o_weight"))
        if rbias is not None:
            add_scaled_bias(rec, ws, ws.hm[i], rbias, self.r, M=M, N=E)
        if lora is not None:
            lora.forward(rec, ws, i, "o_proj", att, ws.hm[i], train=train)

    def backward(self, rec, model, ws, i: int, grad) -> None:
        c, lora = self.cfg, model.lora
        E, I, M = self.E, self.I, ws.M
        lp = model.params.layers[i]
        pre = f"{model.arch.LAYER_PREFIX}{i}."
        mlp = pre + self.n["mlp"]
        d = "output_linear" if self.granite else "down_proj"
        half = model.half
        linear_backward(rec, ws.dact, grad(f"{mlp}{d}.weight"), grad(f"{mlp}{d}.bias"), ws.dh, ws.act[i],
                        lp.down_weight, ws.ones, M=M, N=E, K=I, **half.operands(ws, "act16", i, "down_weight"))
        if lora is not None:
            lora.backward(rec, ws, i, self.down, ws.dh, ws.act[i], ws.dact)
        swiglu_backward(rec, ws.dgu, ws.dact, ws.gu[i], rows=M, I=I, r=self.r)
        if self.granite:
            linear_backward(rec, ws.dun2, grad(mlp + "input_linear.weight"), None, ws.dgu, ws.un2[i],
                            lp.gu_weight, M=M, N=2 * I, K=E, **half.operands(ws, "un216", i, "gu_weight"))
            if lora is not None:
                lora.backward(rec, ws, i, "input_linear", ws.dgu, ws.un2[i], ws.dun2)
        else:
            for col, w, t, f in ((0, lp.gate_weight, "gate_proj", "gate_weight"), (I, lp.up_weight, "up_proj",
                                                                                  "up_weight")):
                linear_backward(rec, ws.dun2, grad(f"{mlp}{t}.weight"), grad(f"{mlp}{t}.bias"), ws.dgu, ws.un2[i],
                                w, ws.ones, M=M, N=I, K=E, lddo=2 * I, dout_col=col, dx_acc=col > 0,
                                **half.operands(ws, "un216", i, f))
            if lora is not None:
                for col, t in ((0, "gate_proj"), (I, "up_proj")):
                    lora.backward(rec, ws, i, t, ws.dgu, ws.un2[i], ws.dun2, lddo=2 * I, dout_col=col)
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
        half = model.half
        linear_backward(rec, ws.datt, grad(a + "o_proj.weight"), grad(a + "o_proj.bias"), ws.dh, ws.att[i],
                        lp.o_weight, bias_ones(rec, ws, self.r), M=M, N=E, K=Hq * D,
                        **half.operands(ws, "att16", i, "o_weight"))
        lora = model.lora
        if lora is not None:
            lora.backward(rec, ws, i, "o_proj", ws.dh, ws.att[i], ws.datt)
        if self.r != 1.0:
            scale_(rec, ws.datt, self.r)
        if half.mixed and attn.takes_subgroup_matrices(rec.rt, D):
            do16 = half.act(rec, ws, "datt16", i, ws.datt)
            attn.attention_backward_f16(rec, ws.dq, ws.dk, ws.dv, ws.delta, ws.datt, ws.att[i], ws.lse[i],
                                        ws.q16[i], ws.k16[i], ws.v16[i], do16, B=B, L=L, Hq=Hq, Hkv=Hkv, D=D,
                                        scale=c.attention_scale, o_scale=self.r)
        else:
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
                            M=M, N=n, K=E, dx_acc=j > 0, **half.operands(ws, "un16", i, t[0] + "_weight"))
        if lora is not None:
            for t, dout in (("q_proj", ws.dq), ("k_proj", ws.dk), ("v_proj", ws.dv)):
                lora.backward(rec, ws, i, t, dout, ws.un[i], ws.dun)
        rmsnorm_backward(rec, ws.dh, grad(f"{model.arch.LAYER_PREFIX}{i}.input_layernorm.weight"), ws.dun,
                         ws.h[i], lp.norm_weight, ws.rstd[i])

    # -- recurrent decoding (batch 1): the Mamba layers' states (ssd_mixer), the attention
    # layers' KV cache of `decode_capacity` positions, the position on the GPU
    @property
    def decode_capacity(self) -> int:
        return min(self.cfg.max_position_embeddings, DECODE_CAPACITY)

    def decode_state(self, rt):
        c = self.cfg
        E, I, Hq, Hkv, D = self.E, self.I, self.Hq, self.Hkv, self.D
        st, made = self.mamba.decode_state(rt)
        e = rt.empty
        st.un2, st.rstd2, st.gu, st.act = e((E,), name="dec.un2"), e((1,), name="dec.rstd2"), \
            e((2 * I,), name="dec.gu"), e((I,), name="dec.act")
        made += [st.un2, st.rstd2, st.gu, st.act]
        if c.attention_layers:
            cap = self.decode_capacity
            st.q, st.k, st.v, st.att = (e((Hq * D,), name="dec.q"), e((Hkv * D,), name="dec.k"),
                                        e((Hkv * D,), name="dec.v"), e((Hq * D,), name="dec.att"))
            st.part = e((attn.decode_part_elems(Hq, D, cap),), name="dec.part")
            st.pos = rt.zeros((4,), "u32", name="dec.pos")
            st.kc = {i: e((cap, Hkv * D), name=f"dec.kc{i}") for i in c.attention_layers}
            st.vc = {i: e((cap, Hkv * D), name=f"dec.vc{i}") for i in c.attention_layers}
            made += [st.q, st.k, st.v, st.att, st.part, st.pos, *st.kc.values(), *st.vc.values()]
            if c.rope:
                st.rope = rt.upload(rope_table(cap, c.rotary_dims, c.rope_theta), name="dec.rope")
                made.append(st.rope)
            if self.r != 1.0 and not hasattr(st, "r"):
                st.r = rt.upload(np.array([self.r, 0, 0, 0], np.float32), name="dec.r")
                made.append(st.r)
        return st, made

    def decode_prefill(self, rec, model, st, ws, i: int, L: int) -> None:
        c = self.cfg
        if c.layer_kinds[i] != ATTENTION:
            self.mamba.decode_prefill(rec, model, st, ws, i, L)
            return
        cap = self.decode_capacity
        if L >= cap:
            raise MemengineError(f"the prompt ({L} tokens) does not fit the attention layers' KV cache "
                                 f"({cap} positions)")
        n = L * self.Hkv * self.D
        rec.copy(ws.k[i].view((n,)), st.kc[i].view((n,)))
        rec.copy(ws.v[i].view((n,)), st.vc[i].view((n,)))
        if i == c.attention_layers[0]:
            rec.rt.write(st.pos, np.array([L, 0, 0, 0], np.uint32))

    def decode_step(self, rec, model, st, i: int, h) -> None:
        c = self.cfg
        E, I = self.E, self.I
        lp = model.params.layers[i]
        if c.layer_kinds[i] == ATTENTION:
            self._attention_step(rec, model, st, i, h)
        else:
            self.mamba.decode_step(rec, model, st, i, h)
        lora = model.lora
        rmsnorm_forward(rec, st.un2, st.rstd2, h, lp.norm2_weight, c.rms_norm_eps)
        if self.granite:
            matvec(rec, st.gu, lp.gu_weight, st.un2, rows=2 * I, K=E)
            if lora is not None:
                lora.step(rec, i, "input_linear", st.un2, st.gu)
        else:
            matvec(rec, st.gu.view((I,)), lp.gate_weight, st.un2, lp.gate_bias, rows=I, K=E)
            matvec(rec, st.gu.view((I,), I), lp.up_weight, st.un2, lp.up_bias, rows=I, K=E)
            if lora is not None:
                lora.step(rec, i, "gate_proj", st.un2, st.gu.view((I,)))
                lora.step(rec, i, "up_proj", st.un2, st.gu.view((I,), I))
        swiglu_forward(rec, st.act, st.gu, rows=1, I=I, r=self.r)
        matvec(rec, h, lp.down_weight, st.act, None if self.granite else lp.down_bias, rows=E, K=I, acc=True)
        if lora is not None:
            lora.step(rec, i, self.down, st.act, h)
        if c.attention_layers and i == c.num_hidden_layers - 1:
            attn.decode_advance(rec, st.pos)

    def _attention_step(self, rec, model, st, i: int, h) -> None:
        c = self.cfg
        E, Hq, Hkv, D = self.E, self.Hq, self.Hkv, self.D
        lp = model.params.layers[i]
        rmsnorm_forward(rec, st.un, st.rstd, h, lp.norm_weight, c.rms_norm_eps)
        matvec(rec, st.q, lp.q_weight, st.un, lp.q_bias, rows=Hq * D, K=E)
        matvec(rec, st.k, lp.k_weight, st.un, lp.k_bias, rows=Hkv * D, K=E)
        matvec(rec, st.v, lp.v_weight, st.un, lp.v_bias, rows=Hkv * D, K=E)
        lora = model.lora
        if lora is not None:
            for t, out in (("q_proj", st.q), ("k_proj", st.k), ("v_proj", st.v)):
                lora.step(rec, i, t, st.un, out)
        if c.rope:
            rope_step(rec, st.q, st.rope, st.pos, heads=Hq, D=D, R=c.rotary_dims)
            rope_step(rec, st.k, st.rope, st.pos, heads=Hkv, D=D, R=c.rotary_dims)
        attn.attention_decode(rec, st.att, st.q, st.k, st.v, st.kc[i], st.vc[i], st.pos, st.part, Hq=Hq, Hkv=Hkv,
                              D=D, cap=self.decode_capacity, scale=c.attention_scale)
        if self.r != 1.0:
            scale_(rec, st.att, self.r)
        bias, rbias = scaled_bias(lp.o_bias, self.r)
        matvec(rec, h, lp.o_weight, st.att, bias, rows=E, K=Hq * D, acc=True)
        if rbias is not None:
            matmul(rec, h, st.r, rbias, M=1, N=E, K=1, acc=True)
        if lora is not None:
            lora.step(rec, i, "o_proj", st.att, h)
