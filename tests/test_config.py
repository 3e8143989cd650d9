import json
import math

import numpy as np
import pytest
from memengine.engine.errors import MemengineError
from memengine.engine.models.mamba1.config import MambaConfig, expected_shapes
from memengine.engine.models import load_config
from memengine.engine.models.mamba1.init import init_weights

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


@pytest.mark.parametrize("name", ["tiny", "small", "mamba-130m"])
def test_named_configs_match_transformers(name):
    cfg = load_config(name)
    hf = transformers.MambaConfig(**cfg.to_hf_dict())
    assert hf.intermediate_size == cfg.intermediate_size
    assert hf.time_step_rank == cfg.dt_rank
    # shapes against a real (meta-device) HF model
    with torch.device("meta"):
        model = transformers.MambaForCausalLM(hf)
    sd = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight")
    assert list(sd.items()) == list(expected_shapes(cfg).items())


def test_mamba_130m_numbers():
    cfg = load_config("mamba-130m")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.state_size, cfg.num_hidden_layers, cfg.conv_kernel) == (50280, 768, 16, 24, 4)
    assert cfg.tie_word_embeddings and cfg.dt_rank == 48 and cfg.intermediate_size == 1536
    assert sum(math.prod(s) for s in expected_shapes(cfg).values()) == 129_135_360


@pytest.mark.parametrize("kw", [dict(use_bias=True, tie_word_embeddings=False), dict(use_conv_bias=False, expand=3, time_step_rank=5)])
def test_expected_shapes_match_hf_model(kw):
    cfg = MambaConfig(vocab_size=50, hidden_size=24, state_size=3, num_hidden_layers=2, conv_kernel=3, **kw)
    with torch.device("meta"):
        model = transformers.MambaForCausalLM(transformers.MambaConfig(**cfg.to_hf_dict()))
    sd = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight")
    assert list(sd.items()) == list(expected_shapes(cfg).items())


def test_from_dict_reads_hf_config_json(tmp_path):
    hf = transformers.MambaConfig(vocab_size=100, hidden_size=40, state_size=6, num_hidden_layers=3, use_bias=True)
    hf.save_pretrained(tmp_path)
    cfg = load_config(str(tmp_path / "config.json"))
    assert (cfg.vocab_size, cfg.hidden_size, cfg.state_size, cfg.num_hidden_layers, cfg.use_bias) == (100, 40, 6, 3, True)
    assert cfg.dt_rank == 3
    assert load_config(str(tmp_path)) == cfg


def test_yaml_and_legacy(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("hidden_size: 32\nvocab_size: 256\nnum_hidden_layers: 1\nstate_size: 4\n")
    cfg = load_config(str(p))
    assert cfg.hidden_size == 32 and cfg.dt_rank == 2
    legacy = {"d_model": 768, "n_layer": 24, "vocab_size": 50277, "ssm_cfg": {}, "rms_norm": True,
              "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": 8}
    cfg = MambaConfig.from_dict(legacy)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (768, 24, 50280)


@pytest.mark.parametrize("bad,key", [
    ({"hidden_size": "768"}, "hidden_size"), ({"hidden_size": 0}, "hidden_size"),
    ({"state_size": -1}, "state_size"), ({"use_bias": "yes"}, "use_bias"),
    ({"time_step_rank": "big"}, "time_step_rank"), ({"layer_norm_epsilon": -1}, "layer_norm_epsilon"),
    ({"model_type": "mamba2"}, "mamba2"), ({"hidden_act": "gelu"}, "hidden_act"),
    ({"intermediate_size": 7}, "intermediate_size"), ({"time_step_min": 1.0}, "time_step_min"),
    ({"num_hidden_layers": True}, "num_hidden_layers"),
])
def test_from_dict_validation(bad, key):
    with pytest.raises(MemengineError, match=key):
        MambaConfig.from_dict({"hidden_size": 64, "vocab_size": 256, **bad})


def test_load_config_errors(tmp_path):
    with pytest.raises(MemengineError, match="nonexistent.*built-in"):
        load_config("nonexistent")
    p = tmp_path / "c.json"
    p.write_text("{oops")
    with pytest.raises(MemengineError, match="c.json"):
        load_config(str(p))
    p.write_text("[1, 2]")
    with pytest.raises(MemengineError, match="c.json"):
        load_config(str(p))


def test_to_hf_dict_roundtrip():
    cfg = MambaConfig(hidden_size=48, vocab_size=99, num_hidden_layers=2, use_bias=True, tie_word_embeddings=False)
    d = json.loads(json.dumps(cfg.to_hf_dict()))
    assert d["model_type"] == "mamba" and d["architectures"] == ["MambaForCausalLM"]
    back = MambaConfig.from_dict(d)
    assert back.to_hf_dict() == cfg.to_hf_dict()


def _ks_uniform(x, lo, hi):
    x = np.sort(x.ravel())
    cdf = (x - lo) / (hi - lo)
    n = x.size
    return max(np.max(np.arange(1, n + 1) / n - cdf), np.max(cdf - np.arange(n) / n))


def test_init_matches_transformers_distributions():
    cfg = MambaConfig(vocab_size=256, hidden_size=64, state_size=8, num_hidden_layers=2, use_bias=True,
                      tie_word_embeddings=False)
    ours = init_weights(cfg, 0)
    assert list(ours) == list(expected_shapes(cfg))
    assert all(v.dtype == np.float32 for v in ours.values())
    again = init_weights(cfg, 0)
    assert all(np.array_equal(ours[k], again[k]) for k in ours)
    assert not np.array_equal(init_weights(cfg, 1)["lm_head.weight"], ours["lm_head.weight"])
    torch.manual_seed(0)
    ref = {k: v.float().numpy() for k, v in transformers.MambaForCausalLM(transformers.MambaConfig(**cfg.to_hf_dict())).state_dict().items()}
    for k, r in ref.items():
        o = ours[k]
        assert o.shape == r.shape, k
        if r.std() == 0:  # constants: ones, zeros, A_log rows
            assert np.array_equal(o, r), k
        elif k.endswith("A_log"):
            np.testing.assert_allclose(o, r, rtol=1e-6)
        else:
            lo, hi = min(o.min(), r.min()), max(o.max(), r.max())
            # same range, mean and spread as transformers' draw
            assert abs(o.std() - r.std()) < 0.1 * r.std(), k
            assert abs(o.mean() - r.mean()) < 0.2 * r.std() + 1e-6, k
            assert abs(o.min() - r.min()) < 0.25 * (hi - lo) and abs(o.max() - r.max()) < 0.25 * (hi - lo), k
    a = np.log(np.arange(1, 9, dtype=np.float32))
    assert np.array_equal(ours["backbone.layers.0.mixer.A_log"], np.tile(a, (128, 1)))
    # conv / out_proj / dt_proj.weight are uniform with transformers' bounds
    assert _ks_uniform(ours["backbone.layers.0.mixer.conv1d.weight"], -0.5, 0.5) < 0.1
    assert _ks_uniform(ours["backbone.layers.0.mixer.out_proj.weight"], -128**-0.5, 128**-0.5) < 0.05
    assert _ks_uniform(ours["backbone.layers.0.mixer.dt_proj.weight"], -0.5, 0.5) < 0.1
    # softplus(dt bias) is log-uniform in [time_step_min, time_step_max]
    dt = np.log1p(np.exp(ours["backbone.layers.0.mixer.dt_proj.bias"].astype(np.float64)))
    assert dt.min() >= 0.001 * 0.999 and dt.max() <= 0.1 * 1.001
    assert _ks_uniform(np.log(dt), np.log(0.001), np.log(0.1)) < 0.15


@pytest.mark.parametrize("kw", [dict(), dict(use_bias=True, tie_word_embeddings=False),
                                dict(use_conv_bias=False, expand=3, time_step_rank=5)])
def test_counts_without_building_the_shapes_match_transformers(kw):
    # n_params / n_tensors / largest_tensor are what the host-memory checks use before any
    # allocation; the oracle is a (meta-device) transformers model
    cfg = MambaConfig(vocab_size=50, hidden_size=24, state_size=3, num_hidden_layers=2, conv_kernel=3, **kw)
    with torch.device("meta"):
        model = transformers.MambaForCausalLM(transformers.MambaConfig(**cfg.to_hf_dict()))
    assert cfg.n_params == sum(p.numel() for p in model.parameters())  # a tied head is counted once
    sd = model.state_dict()
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight")
    assert cfg.n_tensors == len(sd)
    assert cfg.largest_tensor == max(v.numel() for v in sd.values())
