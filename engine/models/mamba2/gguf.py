"""Mamba-2's GGUF mapping: what llama.cpp's own converter (convert_hf_to_gguf.py, class
Mamba2Model) writes for `mamba2` checkpoints (engine/io/gguf.py writes the file).

- llama.cpp's architecture "mamba2"; `mamba2.ssm.time_step_rank` is the head count H and
  `mamba2.ssm.group_count` G;
- `dt_bias` is stored as `ssm_dt.bias`, A as `ssm_a` = -exp(A_log) and D as `ssm_d`, both
  [H, 1]; conv1d's [C, 1, K] as [C, K]; the gated norm's weight as [G, Di/G];
- which tensors stay F32, and the tied head, are the writer's rule (engine/io/gguf.py).

What llama.cpp cannot run is refused before anything is written (`check_runnable`).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
from memengine.engine.errors import MemengineError
from memengine.engine.io.gguf import add_recurrent_shape, tensor_name

ARCH = "mamba2"

# llama.cpp's tensor names per HF name (gguf's TensorNameMap for MODEL_ARCH.MAMBA2 gives the same)
_LAYER = {
    "norm.weight": "attn_norm.weight",
    "mixer.in_proj.weight": "ssm_in.weight",
    "mixer.conv1d.weight": "ssm_conv1d.weight",
    "mixer.conv1d.bias": "ssm_conv1d.bias",
    "mixer.dt_bias": "ssm_dt.bias",
    "mixer.A_log": "ssm_a",
    "mixer.D": "ssm_d",
    "mixer.norm.weight": "ssm_norm.weight",
    "mixer.out_proj.weight": "ssm_out.weight",
}
_GLOBAL = {"backbone.embeddings.weight": "token_embd.weight", "backbone.norm_f.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def check_runnable(cfg) -> list[str]:
    """Refuse, in one line, a model llama.cpp's Mamba-2 cannot run (its converter asserts
    expand 2; its loader has no in_proj/out_proj biases); return notes on what is converted
    with a change."""
    where = "llama.cpp cannot run this model"
    if cfg.intermediate_size != 2 * cfg.hidden_size:
        raise MemengineError(f"{where}: its Mamba-2 converter takes only expand 2 (d_inner = 2 x d_model); this "
                             f"model has d_inner {cfg.intermediate_size} for d_model {cfg.hidden_size}")
    if cfg.use_bias:
        raise MemengineError(f"{where}: use_bias=true (biases on in_proj and out_proj), which llama.cpp's Mamba-2 "
                             "has no tensors for")
    notes = []
    if not cfg.use_conv_bias:
        notes.append("use_conv_bias=false: written with a zero ssm_conv1d.bias (llama.cpp requires the tensor; "
                     "the model computes the same)")
    return notes


def gguf_name(hf: str) -> str:
    """llama.cpp's name for a HF tensor name."""
    return tensor_name(hf, _GLOBAL, _LAYER)


def gguf_tensors(cfg, tensors: dict) -> Iterator[tuple[str, str, np.ndarray]]:
    """(gguf name, HF name, float32 array in llama.cpp's layout) in the checkpoint's order."""
    G, Di = cfg.n_groups, cfg.intermediate_size
    for hf, x in tensors.items():
        name = gguf_name(hf)
        a = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
        if hf.endswith(".A_log"):
            a = (-np.exp(a)).reshape(-1, 1)
        elif hf.endswith("mixer.D"):
            a = a.reshape(-1, 1)
        elif hf.endswith("mixer.conv1d.weight"):
            a = a.reshape(a.shape[0], a.shape[-1])  # [C, 1, K] -> [C, K]
        elif hf.endswith("mixer.norm.weight"):
            a = a.reshape(G, Di // G)
        yield name, hf, a
        if hf.endswith("mixer.conv1d.weight") and not cfg.use_conv_bias:
            i = hf.split(".")[2]
            yield f"blk.{i}.ssm_conv1d.bias", f"backbone.layers.{i}.mixer.conv1d.bias", \
                np.zeros(a.shape[0], np.float32)


def add_metadata(w, cfg) -> None:
    """The converter's metadata keys of the model's shape (the time-step rank is the heads)."""
    add_recurrent_shape(w, cfg, inner=cfg.intermediate_size, state=cfg.state_size, rank=cfg.num_heads)
    w.add_ssm_group_count(cfg.n_groups)


def describe(cfg) -> str:
    """What the export says it writes, beside the architecture's name."""
    return f", {cfg.num_heads} heads, {cfg.n_groups} group(s)"
