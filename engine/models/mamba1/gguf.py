"""Mamba-1's GGUF mapping: what llama.cpp's own converter (convert_hf_to_gguf.py, class
MambaModel) writes for `mamba` and `falcon_mamba` checkpoints (engine/io/gguf.py writes the
file).

- one llama.cpp architecture, "mamba", for both model types; falcon_mamba is
  `mamba.ssm.dt_b_c_rms` true (llama.cpp then RMS-normalises dt, B and C without weights,
  with `layer_norm_epsilon`: it has no key for the mixer's own epsilon);
- A is stored as `ssm_a` = -exp(A_log), conv1d's [Di, 1, K] as [Di, K];
- which tensors stay F32, and the tied head, are the writer's rule (engine/io/gguf.py).

What llama.cpp cannot run is refused before anything is written (`check_runnable`).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
from memengine.engine.errors import MemengineError
from memengine.engine.io.gguf import add_recurrent_shape, tensor_name

ARCH = "mamba"

# llama.cpp's tensor names per HF name (gguf's TensorNameMap for MODEL_ARCH.MAMBA gives the same)
_LAYER = {
    "norm.weight": "attn_norm.weight",
    "mixer.in_proj.weight": "ssm_in.weight",
    "mixer.conv1d.weight": "ssm_conv1d.weight",
    "mixer.conv1d.bias": "ssm_conv1d.bias",
    "mixer.x_proj.weight": "ssm_x.weight",
    "mixer.dt_proj.weight": "ssm_dt.weight",
    "mixer.dt_proj.bias": "ssm_dt.bias",
    "mixer.A_log": "ssm_a",
    "mixer.D": "ssm_d",
    "mixer.out_proj.weight": "ssm_out.weight",
}
_GLOBAL = {"backbone.embeddings.weight": "token_embd.weight", "backbone.norm_f.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def check_runnable(cfg) -> list[str]:
    """Refuse, in one line, a model llama.cpp's Mamba-1 cannot run (llama-model.cpp,
    models/mamba.cpp and mamba-base.cpp); return notes on what is converted with a change."""
    where = "llama.cpp cannot run this model"
    if cfg.intermediate_size != 2 * cfg.hidden_size:
        raise MemengineError(f"{where}: its Mamba-1 takes only expand 2 (\"only an expansion factor of 2 is supported "
                             f"for now\"); this model has expand {cfg.expand}")
    if cfg.use_bias:
        raise MemengineError(f"{where}: use_bias=true (biases on in_proj and out_proj), which llama.cpp's Mamba-1 "
                             "has no tensors for")
    notes = []
    if not cfg.use_conv_bias:
        notes.append("use_conv_bias=false: written with a zero ssm_conv1d.bias (llama.cpp requires the tensor; "
                     "the model computes the same)")
    if cfg.model_type == "falcon_mamba" and cfg.mixer_rms_eps != cfg.layer_norm_epsilon:
        notes.append(f"falcon_mamba: llama.cpp normalises dt, B and C with layer_norm_epsilon "
                     f"({cfg.layer_norm_epsilon:g}), not mixer_rms_eps ({cfg.mixer_rms_eps:g}); its logits differ "
                     "from this model's by that much")
    return notes


def gguf_name(hf: str) -> str:
    """llama.cpp's name for a HF tensor name."""
    return tensor_name(hf, _GLOBAL, _LAYER)


def gguf_tensors(cfg, tensors: dict) -> Iterator[tuple[str, str, np.ndarray]]:
    """(gguf name, HF name, float32 array in llama.cpp's layout) in the converter's order."""
    for hf, x in tensors.items():
        name = gguf_name(hf)
        a = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
        if hf.endswith(".A_log"):
            a = -np.exp(a)
        elif hf.endswith("mixer.conv1d.weight"):
            a = a.reshape(a.shape[0], a.shape[-1])  # [Di, 1, K] -> [Di, K]
        yield name, hf, a
        if hf.endswith("mixer.conv1d.weight") and not cfg.use_conv_bias:
            i = hf.split(".")[2]
            yield f"blk.{i}.ssm_conv1d.bias", f"backbone.layers.{i}.mixer.conv1d.bias", \
                np.zeros(a.shape[0], np.float32)


def add_metadata(w, cfg) -> None:
    """The converter's metadata keys of the model's shape."""
    add_recurrent_shape(w, cfg, inner=cfg.intermediate_size, state=cfg.state_size, rank=cfg.dt_rank)
    w.add_ssm_dt_b_c_rms(cfg.model_type == "falcon_mamba")


def describe(cfg) -> str:
    """What the export says it writes, beside the architecture's name."""
    return ", dt/B/C RMS norms" if cfg.model_type == "falcon_mamba" else ""
