"""Recurrent decoding kernels (shaders/decode.wgsl): one token per step, batch 1.

Forward only (nothing here is differentiated).  The step of one layer, given h [E]:

    conv_step   xc = silu(conv(x)) from the layer's conv state [K-1, Di], which it shifts
    ssm_step    dt = softplus(dt_proj(xdbl[:R]) + bias); s = exp(dt A) s + dt Bm xc;
                y = (<s, Cm> + D xc) * silu(z)       (dt_proj is fused in: R is small)
    matvec      in_proj, x_proj, out_proj (accumulating onto h: the residual), LM head

and after a prompt's sequence pass (`LanguageModel.record_forward` on B = 1):

    conv_prefill   the last K-1 pre-conv inputs x of the prompt (zeros before its start)
    ssm_prefill    the SSM state after the prompt's last position

Dependency on the sequence scan (engine/ops/scan.py), and only on its documented contract:
`selective_scan_forward` writes `states` of shape `scan_state_shape(B, L, Di, N)` =
[B, ceil(L / CHUNK), Di, N], entry [b, c] being the state *before* step c*CHUNK of batch row
b.  `ssm_prefill` copies the saved state of the chunk that holds position L-1 and steps it
through that chunk's remaining positions (at most CHUNK) with the scan's own update,
reading dt from `delta` (dt_proj's output without bias), Bm from `xdbl` and u from `xc`.
If the scan's saving interval or layout changes, `CHUNK`/`scan_state_shape` change with it
and this stays right; if the scan stopped saving states, this would have to change.

All tensors may be views at any 4-byte offset (bound through `gpu.bound`); nothing is
allocated and nothing is read back.  Bindings respect `rt.max_binding` (gpu.split): the
matvec binds its weight in row ranges (an LM head of 50280 x 768 is 147 MiB), the prompt
handover steps the SSM state through the last chunk in row ranges; what cannot be split
(one layer's recurrent state, one token's logits) must fit one binding, else BindingError
names it.
"""

from __future__ import annotations

import os
import struct

from memengine.engine.errors import MemengineError
from memengine.engine.kernels.scan import CHUNK, scan_state_shape
from memengine.engine.runtime import Recorder, Tensor, bound, cdiv, pack, split
from memengine.engine.runtime import rows as row_view

SHADER = "decode"
WG = 256


def matvec_lanes(rt) -> int:
    """Threads per row of a matvec.  On a software adapter (lavapipe) every workgroup
    barrier costs and few lanes measured fastest (4: 2.1 GB/s at 3072x768, vs 1.3 with 32);
    on a GPU a warp per row keeps loads coalesced and the loop short for few-row products.
    MEMENGINE_MATVEC_LANES overrides it (benchmarks)."""
    env = os.environ.get("MEMENGINE_MATVEC_LANES", "").strip()
    if env:
        if env not in ("1", "2", "4", "8", "16", "32", "64", "128", "256"):
            raise MemengineError(f"MEMENGINE_MATVEC_LANES={env!r}: expected a power of two from 1 to 256")
        return int(env)
    return 4 if rt.adapter_type.lower() == "cpu" else 32


def pack_layer_constants(rec: Recorder, dst: Tensor, A_log: Tensor, dt_bias: Tensor, D: Tensor,
                         *, Di: int, N: int) -> None:
    """dst [Di*N + 2*Di] = (A_log, dt_proj.bias, D): the step kernel's per-layer constants in
    one binding (copies, recorded once per generation)."""
    assert dst.numel == Di * N + 2 * Di and A_log.numel == Di * N and dt_bias.numel == Di and D.numel == Di
    rec.copy(A_log, dst.view((Di * N,), 0))
    rec.copy(dt_bias, dst.view((Di,), Di * N))
    rec.copy(D, dst.view((Di,), Di * N + Di))


def _fits(rt, what: str, *nbytes: int) -> None:
    """Tensors a kernel binds whole: BindingError naming `what` when one exceeds a binding."""
    split(rt, 1, lambda _: nbytes, unit=what)


def _dp(Di, N, R, K, L=0, has_bias=0, offs=()):
    offs = tuple(offs) + (0,) * (8 - len(offs))
    return pack("16I", Di, N, R, K, L, R + 2 * N, CHUNK, has_bias, *offs)


def conv_step(rec: Recorder, xc: Tensor, conv_state: Tensor, xz: Tensor, weight: Tensor,
              bias: Tensor | None, *, Di: int, K: int) -> None:
    """xc[Di] = silu(conv) (WRITE); conv_state [K-1, Di] shifted by one (x appended).
    x is xz[0:Di]; weight is conv1d.weight [Di, K]; bias may be None."""
    assert xc.numel == Di and xz.numel >= 2 * Di and weight.numel == Di * K
    assert conv_state.numel >= max(K - 1, 1) * Di
    rt = rec.rt
    _fits(rt, f"one layer's conv state and conv1d weight ({K} x {Di} values)", 4 * K * Di, 4 * 2 * Di)
    (bo, oo), (bs, os_), (bx, ox), (bw, ow) = (bound(rt, t) for t in (xc, conv_state, xz, weight))
    bb, ob = bound(rt, bias) if bias is not None else (bw, 0)
    u = rt.uniform(_dp(Di, 0, 0, K, 0, int(bias is not None), (oo, os_, ox, ow, ob)))
    rec.dispatch(SHADER, "decode_conv_step", {0: bo, 1: bs, 4: bx, 5: bw, 10: bb, 7: u}, cdiv(Di, WG),
                 {"CONV_K": K})


def ssm_step(rec: Recorder, y: Tensor, ssm_state: Tensor, xc: Tensor, xdbl: Tensor, xz: Tensor,
             dt_weight: Tensor, consts: Tensor, *, Di: int, N: int, R: int) -> None:
    """y[Di] (WRITE); ssm_state [Di, N] updated in place. xdbl [R+2N]; z is xz[Di:2Di];
    dt_weight is dt_proj.weight [Di, R]; consts from `pack_layer_constants`."""
    assert y.numel == Di and ssm_state.numel == Di * N and xc.numel == Di and xdbl.numel == R + 2 * N
    assert xz.numel >= 2 * Di and dt_weight.numel == Di * R and consts.numel == Di * N + 2 * Di
    rt = rec.rt
    _fits(rt, f"one layer's SSM state and constants ({Di} x {N} values)", 4 * (Di * N + 2 * Di), 4 * Di * R)
    b = [bound(rt, t) for t in (y, ssm_state, xc, xdbl, xz, dt_weight, consts)]
    u = rt.uniform(_dp(Di, N, R, 0, 0, 0, (b[0][1], b[1][1], b[2][1], b[3][1], b[4][1], b[5][1], b[6][1])))
    rec.dispatch(SHADER, "decode_ssm_step",
                 {0: b[0][0], 1: b[1][0], 2: b[2][0], 3: b[3][0], 4: b[4][0], 5: b[5][0], 6: b[6][0], 7: u},
                 cdiv(Di, WG))


def conv_prefill(rec: Recorder, conv_state: Tensor, xz: Tensor, *, L: int, Di: int, K: int) -> None:
    """conv_state [K-1, Di] = x rows L-K+1 .. L-1 of the prompt's xz [L, 2Di] (0 before row 0);
    only those rows are bound."""
    if K <= 1:
        return
    assert conv_state.numel >= (K - 1) * Di and xz.numel >= L * 2 * Di
    rt = rec.rt
    r0 = max(0, L - (K - 1))
    _fits(rt, f"one layer's conv state ({K - 1} x {Di} values)", 4 * (K - 1) * 2 * Di)
    (bs, os_), (bx, ox) = bound(rt, conv_state), bound(rt, xz.view(((L - r0) * 2 * Di,), r0 * 2 * Di))
    u = rt.uniform(_dp(Di, 0, 0, K, L - r0, 0, (0, os_, ox)))
    rec.dispatch(SHADER, "decode_conv_prefill", {1: bs, 4: bx, 7: u}, cdiv((K - 1) * Di, WG))


def ssm_prefill(rec: Recorder, ssm_state: Tensor, states: Tensor, xc: Tensor, delta: Tensor, xdbl: Tensor,
                consts: Tensor, *, L: int, Di: int, N: int, R: int) -> None:
    """ssm_state [Di, N] = the SSM state after position L-1 of a B = 1 sequence pass: the
    scan's saved state at the start of the chunk holding L-1 (see the module docstring),
    stepped through that chunk's rows of the pass's xc [L, Di], delta [L, Di] (without
    bias) and xdbl [L, R+2N]; only those rows are bound."""
    assert L >= 1 and ssm_state.numel == Di * N
    assert states.numel == 1 * scan_state_shape(1, L, Di, N)[1] * Di * N, (states.shape, L)
    assert xc.numel == L * Di and delta.numel == L * Di and xdbl.numel == L * (R + 2 * N)
    rt = rec.rt
    last = (L - 1) // CHUNK
    rec.copy(states.view((Di * N,), last * Di * N), ssm_state, slot=True)
    t0, ld = last * CHUNK, R + 2 * N
    _fits(rt, f"one layer's SSM state and constants ({Di} x {N} values)", 4 * (Di * N + 2 * Di))
    (bs, os_), (bk, ok) = bound(rt, ssm_state), bound(rt, consts)
    for r0, n in split(rt, L - t0, lambda n: (4 * n * Di, 4 * n * ld),
                       unit=f"one row of a prompt's activations ({Di} values)"):
        (bu, ou), (bx, ox), (bd, od) = (bound(rt, row_view(t, t0 + r0, n, w)) for t, w in ((xc, Di), (xdbl, ld), (delta, Di)))
        u = rt.uniform(_dp(Di, N, R, 0, n, 0, (0, os_, ou, ox, od, 0, ok)))
        rec.dispatch(SHADER, "decode_ssm_prefill", {1: bs, 2: bu, 3: bx, 6: bk, 9: bd, 7: u}, cdiv(Di * N, WG))


def matvec(rec: Recorder, out: Tensor, weight: Tensor, x: Tensor, bias: Tensor | None = None, *,
           rows: int, K: int, acc: bool = False) -> None:
    """out[rows] (+)= weight[rows, K] @ x[K] (+ bias): one row of a linear layer.

    A weight larger than one storage binding (an LM head) is bound in row ranges."""
    assert out.numel == rows and weight.numel == rows * K and x.numel >= K
    if rows == 0:
        return
    rt = rec.rt
    lanes = matvec_lanes(rt)
    per = 256 // lanes                      # rows per workgroup: ranges of whole workgroups
    bx, ox = bound(rt, x, K)
    flags = (1 if acc else 0) | (2 if bias is not None else 0)
    for r0, n in split(rt, rows, lambda n: (4 * n * K, 4 * n, 4 * K), step=per,
                       unit=f"one row of {weight.name or 'a weight'} ({K} values)"):
        bo, oo = bound(rt, row_view(out, r0, n, 1))
        bw, ow = bound(rt, row_view(weight, r0, n, K))
        bb, ob = bound(rt, row_view(bias, r0, n, 1)) if bias is not None else (bx, 0)
        u = rt.uniform(pack("8I", n, K, flags, oo, ow, ox, ob, 0))
        entry = "decode_matvec4" if K % 4 == 0 and ow % 4 == 0 and ox % 4 == 0 else "decode_matvec"
        rec.dispatch(SHADER, entry, {0: bo, 1: bw, 2: bx, 3: bb, 4: u}, cdiv(n, per), {"LANES": lanes})


def sample(rec: Recorder, io: Tensor, logits: Tensor, *, V: int, temperature: float, top_k: int,
           top_p: float, seed: int) -> None:
    """Pick the next token from logits [V] on the GPU (one workgroup).

    io (i32 [2 + cap]): io[0] = how many tokens were sampled so far (t, advanced here),
    io[1] = the picked token (what the next step embeds), io[2 + t % cap] = the picked token.
    temperature 0 is greedy (lowest index of the largest logit); otherwise a draw from
    softmax(logits / temperature) restricted by top-k (0 = off) and top-p (1 = off), from
    a counter-based hash of (seed, t, token id)."""
    assert logits.numel == V and io.dtype == "i32" and io.numel >= 3
    rt = rec.rt
    _fits(rt, f"one token's logits ({V} values)", 4 * V)
    bl, ol = bound(rt, logits)
    assert io.offset % rt.storage_align == 0
    greedy = temperature <= 0
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    data = struct.pack("<6I2f4I", V, 0 if greedy else 1, int(top_k), io.numel - 2, seed & 0xFFFFFFFF, seed >> 32,
                       0.0 if greedy else 1.0 / float(temperature), float(top_p), ol, 0, 0, 0)
    rec.dispatch(SHADER, "decode_sample", {0: io, 1: bl, 2: rt.uniform(data)}, 1)
