"""Fresh weights, drawn from the same distributions as transformers' Mamba init.

`MambaPreTrainedModel._init_weights` (transformers 5.x), per tensor:

    embeddings, in_proj, x_proj, lm_head   normal(0, initializer_range)
    norm.weight, norm_f.weight, D          1
    A_log                                  log(1..N), the same row for every channel
    conv1d.weight                          kaiming_uniform(a=sqrt 5) = U(+-1/sqrt(K))
    out_proj.weight                        U(+-1/sqrt(Di))  (/ sqrt(layers) if rescale_prenorm_residual)
    dt_proj.weight                         U(+-R^-0.5 * time_step_scale)  (constant if scheme="constant")
    dt_proj.bias                           softplus^-1(dt), dt = exp(U(log dt_min, log dt_max)) >= floor
    all other biases                       0

Numpy-seeded: the same (config, seed) gives bit-identical weights.
"""

from __future__ import annotations

import math

import numpy as np
from memengine.engine.hostmem import check_fits
from memengine.engine.models.mamba1.config import MambaConfig, expected_shapes

# host bytes per tensor beyond its data (name, shape, array object) while the weights are built
TENSOR_OVERHEAD = 1024


def host_bytes(cfg: MambaConfig) -> int:
    """What `init_weights` holds at its peak: every tensor in f32, plus the f64 draw of the
    largest one, plus the bookkeeping per tensor."""
    return 4 * cfg.n_params + 8 * cfg.largest_tensor + TENSOR_OVERHEAD * cfg.n_tensors


def init_weights(cfg: MambaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Fresh f32 weights for `cfg` (refused with one line when they cannot fit in host memory)."""
    check_fits(host_bytes(cfg), f"initialising {cfg.n_params:,} parameters in {cfg.n_tensors:,} tensors",
               "reduce vocab_size, hidden_size, expand, state_size or num_hidden_layers in the config")
    rng = np.random.default_rng(seed)
    std = cfg.initializer_range or 0.02
    Di, N, K, R = cfg.intermediate_size, cfg.state_size, cfg.conv_kernel, cfg.dt_rank

    def normal(shape):
        return rng.normal(0.0, std, size=shape).astype(np.float32)

    def uniform(shape, bound):
        return rng.uniform(-bound, bound, size=shape).astype(np.float32)

    out: dict[str, np.ndarray] = {}
    for name, shape in expected_shapes(cfg).items():
        leaf = name.split("mixer.")[-1] if ".mixer." in name else name
        if name in ("backbone.embeddings.weight", "lm_head.weight") or leaf in ("in_proj.weight", "x_proj.weight"):
            w = normal(shape)
        elif name.endswith("norm.weight") or name.endswith("norm_f.weight") or leaf == "D":
            w = np.ones(shape, np.float32)
        elif leaf == "A_log":
            a = np.log(np.arange(1, N + 1, dtype=np.float32))
            w = np.ascontiguousarray(np.broadcast_to(a[None, :], (Di, N)))
        elif leaf == "conv1d.weight":
            w = uniform(shape, 1.0 / math.sqrt(K))
        elif leaf == "out_proj.weight":
            w = uniform(shape, 1.0 / math.sqrt(Di))
            if cfg.rescale_prenorm_residual:
                w = (w / np.float32(math.sqrt(cfg.num_hidden_layers))).astype(np.float32)
        elif leaf == "dt_proj.weight":
            dt_std = R**-0.5 * cfg.time_step_scale
            if cfg.time_step_init_scheme == "constant":
                w = np.full(shape, dt_std, np.float32)
            else:
                w = uniform(shape, dt_std)
        elif leaf == "dt_proj.bias":
            lo, hi = math.log(cfg.time_step_min), math.log(cfg.time_step_max)
            dt = np.exp(rng.random(Di) * (hi - lo) + lo)
            dt = np.maximum(dt, cfg.time_step_floor)
            w = (dt + np.log(-np.expm1(-dt))).astype(np.float32)  # inverse softplus
        else:  # remaining biases: in_proj, out_proj, conv1d
            w = np.zeros(shape, np.float32)
        assert w.shape == tuple(shape), name
        out[name] = w
    return out
