"""Mamba-2's GGUF mapping: what llama.cpp's own converter (convert_hf_to_gguf.py, class
Mamba2Model) writes for `mamba2` checkpoints (engine/io/gguf.py writes the file).

- llama.cpp's architecture "mamba2"; `mamba2.ssm.time_step_rank` is the head count H and
  `mamba2.ssm.group_count` G;
- `dt_bias` is stored as `ssm_dt.bias`, A as `ssm_a` = -exp(A_log) and D as `ssm_d`, both
  [H, 1]; conv1d's [C, 1, K] as [C, K]; the gated norm's weight as [G, Di/G]; a tied or
  equal lm_head is left out;
- 1-D tensors, norms, conv1d and every tensor whose name does not end in ".weight" (ssm_a,
  ssm_d, the biases) stay F32.

What llama.cpp cannot run is refused before anything is written (`check_runnable`).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
from memengine.engine.errors import MemengineError

ARCH = "mamba2"
CONTEXT_LENGTH = 2**20  # the converter's value: a recurrent model has no context limit

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
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    parts = hf.split(".", 3)  # backbone.layers.<i>.<rest>
    if len(parts) == 4 and parts[:2] == ["backbone", "layers"] and parts[3] in _LAYER:
        return f"blk.{int(parts[2])}.{_LAYER[parts[3]]}"
    raise MemengineError(f"{hf}: no GGUF name for this tensor")


def stays_f32(name: str, data: np.ndarray) -> bool:
    """The converter's rule (TextModel.prepare_tensors): 1-D tensors, norms, conv1d and
    names not ending in .weight stay F32."""
    return (data.ndim <= 1 or name.endswith("_norm.weight") or ".ssm_conv1d." in name
            or not name.endswith(".weight"))


def gguf_tensors(cfg, tensors: dict) -> Iterator[tuple[str, str, np.ndarray]]:
    """(gguf name, HF name, float32 array in llama.cpp's layout) in the checkpoint's order."""
    emb = None
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
        if name == "token_embd.weight":
            emb = a
        elif name == "output.weight" and emb is not None and np.array_equal(emb, a):
            continue  # tied: llama.cpp reads token_embd in its place
        yield name, hf, a
        if hf.endswith("mixer.conv1d.weight") and not cfg.use_conv_bias:
            i = hf.split(".")[2]
            yield f"blk.{i}.ssm_conv1d.bias", f"backbone.layers.{i}.mixer.conv1d.bias", \
                np.zeros(a.shape[0], np.float32)


def add_metadata(w, cfg) -> None:
    """The converter's metadata keys of the model's shape."""
    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_ssm_conv_kernel(cfg.conv_kernel)
    w.add_ssm_inner_size(cfg.intermediate_size)
    w.add_ssm_state_size(cfg.state_size)
    w.add_ssm_time_step_rank(cfg.num_heads)
    w.add_ssm_group_count(cfg.n_groups)
    w.add_layer_norm_rms_eps(cfg.layer_norm_epsilon)


def describe(cfg) -> str:
    """What the export says it writes, beside the architecture's name."""
    return f", {cfg.num_heads} heads, {cfg.n_groups} group(s)"
