"""Fresh weights, drawn from the same distributions as transformers' Mamba-2 init.

`Mamba2PreTrainedModel._init_weights` and `Mamba2Mixer.init_mamba2_weights` (transformers 5.x):

    embeddings, in_proj, lm_head           normal(0, initializer_range)
    norm.weight, mixer.norm.weight, D      1
    A_log                                  log(1..H)
    conv1d.weight                          kaiming_uniform(a=sqrt 5) = U(+-1/sqrt(K))
    out_proj.weight                        U(+-1/sqrt(Di))  (/ sqrt(layers) if rescale_prenorm_residual)
    dt_bias                                softplus^-1(dt), dt = exp(U(log dt_min, log dt_max)) >= floor
    all other biases                       0

Numpy-seeded: the same (config, seed) gives bit-identical weights.
"""

from __future__ import annotations

import math

import numpy as np
from memengine.engine.hostmem import check_fits
from memengine.engine.models.mamba2.config import Mamba2Config, iter_expected_shapes

TENSOR_OVERHEAD = 1024


def host_bytes(cfg: Mamba2Config) -> int:
    return 4 * cfg.n_params + 8 * cfg.largest_tensor + TENSOR_OVERHEAD * cfg.n_tensors


def init_weights(cfg: Mamba2Config, seed: int = 0) -> dict[str, np.ndarray]:
    """Fresh f32 weights for `cfg` (refused with one line when they cannot fit in host memory)."""
    check_fits(host_bytes(cfg), f"initialising {cfg.n_params:,} parameters in {cfg.n_tensors:,} tensors",
               "reduce vocab_size, hidden_size, expand, state_size or num_hidden_layers in the config")
    rng = np.random.default_rng(seed)
    std = cfg.initializer_range or 0.02
    Di, K, H = cfg.intermediate_size, cfg.conv_kernel, cfg.num_heads
    out: dict[str, np.ndarray] = {}
    for name, shape in iter_expected_shapes(cfg):
        leaf = name.split("mixer.")[-1] if ".mixer." in name else name
        if name in ("backbone.embeddings.weight", "lm_head.weight") or leaf == "in_proj.weight":
            w = rng.normal(0.0, std, size=shape).astype(np.float32)
        elif name.endswith("norm.weight") or name.endswith("norm_f.weight") or leaf == "D":
            w = np.ones(shape, np.float32)
        elif leaf == "A_log":
            w = np.log(np.arange(1, H + 1, dtype=np.float32))
        elif leaf == "conv1d.weight":
            w = rng.uniform(-1.0 / math.sqrt(K), 1.0 / math.sqrt(K), size=shape).astype(np.float32)
        elif leaf == "out_proj.weight":
            w = rng.uniform(-1.0 / math.sqrt(Di), 1.0 / math.sqrt(Di), size=shape).astype(np.float32)
            if cfg.rescale_prenorm_residual:
                w = (w / np.float32(math.sqrt(cfg.num_hidden_layers))).astype(np.float32)
        elif leaf == "dt_bias":
            lo, hi = math.log(cfg.time_step_min), math.log(cfg.time_step_max)
            dt = np.maximum(np.exp(rng.random(H) * (hi - lo) + lo), cfg.time_step_floor)
            w = (dt + np.log(-np.expm1(-dt))).astype(np.float32)  # inverse softplus
        else:  # in_proj, out_proj, conv1d biases
            w = np.zeros(shape, np.float32)
        assert w.shape == tuple(shape), name
        out[name] = w
    return out
