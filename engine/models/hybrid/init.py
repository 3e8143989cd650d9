"""Fresh weights for a hybrid, from the distributions of transformers' init
(`GraniteMoeHybridPreTrainedModel._init_weights`, `BambaPreTrainedModel._init_weights`):

    embeddings, every Linear and the conv1d weights     normal(0, initializer_range)
    RMS norms (the gated one too), D, dt_bias           1
    A_log                                               log(1..H)
    biases                                              0

Numpy-seeded: the same (config, seed) gives bit-identical weights.
"""

from __future__ import annotations

import numpy as np
from memengine.engine.hostmem import check_fits
from memengine.engine.models.hybrid.tensors import iter_expected_shapes

TENSOR_OVERHEAD = 1024


def init_weights(cfg, seed: int = 0) -> dict:
    shapes = list(iter_expected_shapes(cfg))
    n = sum(int(np.prod(s)) for _, s in shapes)
    largest = max(int(np.prod(s)) for _, s in shapes)
    check_fits(4 * n + 8 * largest + TENSOR_OVERHEAD * len(shapes),
               f"initialising {n:,} parameters in {len(shapes):,} tensors",
               "reduce vocab_size, hidden_size, intermediate_size or num_hidden_layers in the config")
    rng = np.random.default_rng(seed)
    std = cfg.initializer_range
    H = cfg.mamba_n_heads
    out = {}
    for name, shape in shapes:
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight") or name.endswith("layernorm.weight") or leaf in ("D", "dt_bias"):
            w = np.ones(shape, np.float32)
        elif leaf == "A_log":
            w = np.log(np.arange(1, H + 1, dtype=np.float32))
        elif leaf == "bias":
            w = np.zeros(shape, np.float32)
        else:
            w = rng.normal(0.0, std, size=shape).astype(np.float32)
        out[name] = w
    return out
