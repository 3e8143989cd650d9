"""A real checkpoint size on the adapter's own limits: the mamba-130m shape (V 50280, E 768,
24 layers; random weights, nothing downloaded) loads and evaluates, although its embedding
table (147 MiB) is larger than lavapipe's and WebGPU's default 128 MiB storage binding, and
its loss equals transformers' MambaForCausalLM on the same weights (float64, as the other
oracle tests).  The weights are transformers' initialisation with the residual projections
rescaled by 1/sqrt(layers) (`rescale_prenorm_residual`, mamba_ssm's own init): without it a
random 24-layer stack amplifies float32 rounding enough that transformers' own float32
forward drifts 2e-4 from its float64 one.  Run time on lavapipe: about a minute."""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from memengine.engine import plan  # noqa: E402
from memengine.engine.config import MambaConfig, load_config  # noqa: E402
from memengine.engine.data import make_batches, make_windows  # noqa: E402
from memengine.engine.model import MambaModel  # noqa: E402
from memengine.engine.trainer import evaluate  # noqa: E402


def test_mamba_130m_shape_evaluates_like_transformers(rt):
    cfg = load_config("mamba-130m")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    hf = transformers.MambaForCausalLM(transformers.MambaConfig(
        **{**cfg.to_hf_dict(), "rescale_prenorm_residual": True})).eval()
    tensors = {k: v.detach().numpy().copy() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert tensors["backbone.embeddings.weight"].nbytes > rt.max_binding  # 147 MiB > 128 MiB
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 17)
    with torch.no_grad():  # 17 ids: 16 inputs, each predicting the next
        x = torch.tensor(ids[None, :])
        ref = float(hf.double()(input_ids=x, labels=x).loss)
    del hf
    t1 = time.perf_counter()

    assert plan.check_run(rt, MambaConfig.from_dict(cfg.to_hf_dict()), 1, 16, "eval").ok
    model = MambaModel(rt, cfg, tensors)
    del tensors
    res = evaluate(model, make_batches(make_windows(ids, 16), 1, 16))
    t2 = time.perf_counter()
    print(f"\nmamba-130m shape on {rt.describe()}: loss {res.loss:.6f} vs transformers {ref:.6f} "
          f"(rel {abs(res.loss - ref) / ref:.1e}); transformers {t1 - t0:.1f}s, ours (upload + eval) {t2 - t1:.1f}s")
    assert res.tokens == 16
    assert abs(res.loss - ref) <= 1e-4 * abs(ref)
