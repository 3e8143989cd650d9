"""LoRA adapters against PEFT (the oracle): the file format PEFT writes and reads, the
adapter's effect on the loss, the gradients of lora_A/lora_B (PEFT + torch autograd), one
AdamW step (torch.optim.AdamW on those parameters), and PEFT's merge_and_unload.

Models are tiny with odd shapes (lavapipe is slow); the base is float64 in torch, float32 on
our GPU.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from memengine.engine import lora as el  # noqa: E402
from memengine.engine.io.checkpoint import save_checkpoint  # noqa: E402
from memengine.engine.models.mamba1.config import MambaConfig  # noqa: E402
from memengine.engine.models.lm import LanguageModel  # noqa: E402

ODD = dict(vocab_size=263, hidden_size=20, state_size=3, num_hidden_layers=2, expand=2, conv_kernel=3,
           use_bias=True, use_conv_bias=True, tie_word_embeddings=True, time_step_rank=3)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def hf_base(kw, falcon=False, seed=0):
    torch.manual_seed(seed)
    if falcon:
        m = transformers.FalconMambaForCausalLM(transformers.FalconMambaConfig(**kw))
    else:
        m = transformers.MambaForCausalLM(transformers.MambaConfig(**kw))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(".D") or name.endswith("norm.weight") or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return m.eval()


def save_base(m, d):
    sd = {k: v.detach().float().numpy().copy() for k, v in m.state_dict().items()}
    if m.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    cfg = MambaConfig.from_dict(m.config.to_dict())
    save_checkpoint(d, cfg, sd, dtype="F32")
    return cfg, sd


def random_adapter(cfg, spec, seed=1):
    """An adapter whose B is not zero (a trained one), so every gradient is non-trivial."""
    rng = np.random.default_rng(seed)
    return {n: (0.3 * rng.standard_normal(s)).astype(np.float32) for n, s in el.shapes(cfg, spec).items()}


def peft_model(base_dir, adapter_dir, falcon=False, trainable=False):
    cls = transformers.FalconMambaForCausalLM if falcon else transformers.MambaForCausalLM
    base = cls.from_pretrained(base_dir).double()
    return peft.PeftModel.from_pretrained(base, adapter_dir, is_trainable=trainable)


def test_adapter_files_are_what_peft_writes_and_reads(tmp_path):
    """Our adapter_config.json and tensor names against a PEFT model saved by PEFT itself."""
    kw = dict(ODD, num_hidden_layers=1)
    m = hf_base(kw)
    targets = ["in_proj", "x_proj"]
    pm = peft.get_peft_model(m, peft.LoraConfig(r=3, lora_alpha=5, lora_dropout=0.0, target_modules=targets,
                                                task_type="CAUSAL_LM"))
    pm.save_pretrained(tmp_path / "theirs")
    from safetensors.numpy import load_file

    theirs = load_file(str(tmp_path / "theirs" / el.ADAPTER_WEIGHTS))
    cfg = MambaConfig.from_dict(m.config.to_dict())
    spec = el.LoraSpec(r=3, alpha=5, targets=tuple(targets), base="some/base")
    el.write_adapter(tmp_path / "ours", spec, el.init_tensors(cfg, spec, 0))
    ours = load_file(str(tmp_path / "ours" / el.ADAPTER_WEIGHTS))
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    c_theirs = json.loads((tmp_path / "theirs" / el.ADAPTER_CONFIG).read_text())
    c_ours = json.loads((tmp_path / "ours" / el.ADAPTER_CONFIG).read_text())
    for key in c_ours:
        if key in ("base_model_name_or_path", "target_modules"):
            continue
        assert key in c_theirs, key
        assert c_ours[key] == c_theirs[key], key
    assert sorted(c_ours["target_modules"]) == sorted(c_theirs["target_modules"])
    # PEFT reads our config back as the same LoraConfig
    lc = peft.LoraConfig.from_pretrained(tmp_path / "ours")
    assert (lc.r, lc.lora_alpha, lc.lora_dropout, lc.use_rslora, lc.task_type) == (3, 5, 0.0, False, "CAUSAL_LM")
    assert lc.base_model_name_or_path == "some/base" and set(lc.target_modules) == set(targets)
    # and we read PEFT's adapter
    ad = el.read_adapter(tmp_path / "theirs")
    assert (ad.spec.r, ad.spec.alpha, ad.spec.targets) == (3, 5.0, tuple(targets))
    for k, v in theirs.items():
        np.testing.assert_array_equal(ad.tensors[k[len(el.PREFIX):]], v)


def test_fresh_adapter_is_initialised_like_peft():
    cfg = MambaConfig.from_dict(ODD)
    spec = el.LoraSpec(r=4, alpha=8)
    t = el.init_tensors(cfg, spec, seed=3)
    for name, a in t.items():
        if name.endswith("lora_B.weight"):
            assert not a.any()
        else:  # kaiming_uniform(a=sqrt 5): U(+-1/sqrt(fan_in))
            bound = 1 / np.sqrt(a.shape[1])
            assert np.abs(a).max() <= bound and np.abs(a).max() > 0.5 * bound
    again = el.init_tensors(cfg, spec, seed=3)
    assert all(np.array_equal(t[k], again[k]) for k in t)


@pytest.mark.parametrize("falcon,targets,alpha,rslora", [
    (False, ("in_proj", "x_proj"), 7.0, False),
    (False, ("x_proj",), 4.0, True),
    (True, ("in_proj", "x_proj"), 3.0, False),
], ids=["mamba-all", "mamba-x_proj-rslora", "falcon"])
def test_loss_and_gradients_equal_peft_autograd(rt, tmp_path, falcon, targets, alpha, rslora):
    kw = dict(ODD, mixer_rms_eps=1e-6) if falcon else ODD
    m = hf_base(kw, falcon=falcon)
    cfg, sd = save_base(m, tmp_path / "base")
    spec = el.LoraSpec(r=3, alpha=alpha, targets=targets, base=str(tmp_path / "base"), use_rslora=rslora)
    tensors = random_adapter(cfg, spec)
    el.write_adapter(tmp_path / "ad", spec, tensors)

    pm = peft_model(tmp_path / "base", tmp_path / "ad", falcon=falcon, trainable=True)
    rng = np.random.default_rng(0)
    B, L = 2, 9
    ids = rng.integers(0, cfg.vocab_size, size=(B, L + 1))
    x, y = torch.tensor(ids[:, :-1]), torch.tensor(ids[:, 1:])
    logits = pm(input_ids=x).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1))
    loss.backward()
    want = {n[len("base_model.model."):].replace(".default", ""): p.grad.numpy()
            for n, p in pm.named_parameters() if p.requires_grad}
    assert set(want) == set(tensors)

    model = LanguageModel(rt, cfg, sd)
    model.lora = el.LoraAdapter(rt, cfg, spec, tensors, train=True)
    got = model.loss_and_grads(ids[:, :-1], ids[:, 1:], trainable=set(model.lora.names))
    assert model._G is None, "a LoRA step made the base's gradient store"
    assert rel(got, loss.item()) < 1e-5
    grads = model.lora.grad_dict()
    for n in tensors:
        assert rel(grads[n], want[n]) < 1e-4, n


def test_adamw_step_equals_torch(rt, tmp_path):
    """One Trainer step (clip off) equals torch.optim.AdamW on PEFT's lora parameters."""
    from memengine.engine.app.options import TrainOptions
    from memengine.engine.io.data import make_batches
    from memengine.engine.train.trainer import Trainer

    m = hf_base(ODD)
    cfg, sd = save_base(m, tmp_path / "base")
    spec = el.LoraSpec(r=2, alpha=6, targets=("in_proj", "x_proj"))
    tensors = random_adapter(cfg, spec, seed=5)
    el.write_adapter(tmp_path / "ad", spec, tensors)
    o = TrainOptions(ckpt="x", data=["x"], output=tmp_path / "o", lr=3e-3, weight_decay=0.1, max_grad_norm=0.0)

    rng = np.random.default_rng(1)
    ids = rng.integers(0, cfg.vocab_size, size=(1, 12))
    windows = [(ids[0, :-1], ids[0, 1:])]
    model = LanguageModel(rt, cfg, sd)
    model.lora = el.LoraAdapter(rt, cfg, spec, tensors, train=True)
    tr = Trainer(model, o)
    tr.step(make_batches(windows, 1, 11), o.lr)
    tr.read_trace()
    after = model.lora.state_dict()
    assert model.state_dict().keys() == sd.keys()
    assert all(np.array_equal(model.state_dict()[k], sd[k]) for k in sd)  # the base is frozen

    pm = peft_model(tmp_path / "base", tmp_path / "ad", trainable=True)
    params = {n[len("base_model.model."):].replace(".default", ""): p
              for n, p in pm.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(list(params.values()), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay)
    logits = pm(input_ids=torch.tensor(ids[:, :-1])).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), torch.tensor(ids[0, 1:])).backward()
    opt.step()
    for n, p in params.items():
        moved = p.detach().numpy() - tensors[n]
        assert rel(after[n] - tensors[n], moved) < 1e-3, n
        assert rel(after[n], p.detach().numpy()) < 1e-6, n


class _Mask(torch.nn.Module):
    """Stands in for PEFT's lora_dropout: multiplies by a given mask (ours)."""

    def __init__(self, mask):
        super().__init__()
        self.mask = mask

    def forward(self, x):
        return x * self.mask.reshape(x.shape).to(x.dtype)


def test_dropout_gradients_equal_peft_with_the_same_mask(rt, tmp_path):
    """With --lora-dropout the loss and the A/B gradients equal PEFT's when PEFT's dropout
    draws our mask; the mask is the one the kernel draws for (seed, counter, layer, target),
    reproducible, different per counter, and drops about p of the inputs."""
    from memengine.engine.kernels.lora import dropout

    m = hf_base(ODD)
    cfg, sd = save_base(m, tmp_path / "base")
    p = 0.3
    spec = el.LoraSpec(r=3, alpha=5, dropout=p, targets=("in_proj", "x_proj"))
    tensors = random_adapter(cfg, spec, seed=2)
    el.write_adapter(tmp_path / "ad", spec, tensors)
    B, L = 2, 9
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, size=(B, L + 1))

    model = LanguageModel(rt, cfg, sd)
    model.lora = ad = el.LoraAdapter(rt, cfg, spec, tensors, seed=11, train=True)

    def masks(counter):
        ad.set_counter(counter)
        out = {}
        for key in ad.pairs:
            K = ad.fan_in[key[1]]
            ones, got = rt.upload(np.ones((B * L, K), np.float32)), rt.zeros((B * L, K))
            rec = rt.recorder()
            dropout(rec, got, ones, ad.rng, rows=B * L, cols=K, p=p, salt=ad._salt(key))
            rec.submit()
            out[key] = rt.read(got)
        return out

    mk = masks(5)
    again, other = masks(5), masks(6)
    assert all(np.array_equal(mk[k], again[k]) for k in mk)
    assert all(not np.array_equal(mk[k], other[k]) for k in mk)
    allm = np.concatenate([v.ravel() for v in mk.values()])
    assert set(np.unique(allm)) == {0.0, np.float32(1 / (1 - p))}
    assert abs((allm == 0).mean() - p) < 0.05

    ad.set_counter(5)
    loss = model.loss_and_grads(ids[:, :-1], ids[:, 1:], trainable=set(ad.names))
    grads = ad.grad_dict()

    pm = peft_model(tmp_path / "base", tmp_path / "ad", trainable=True).train()
    for (i, t), mask in mk.items():
        layer = getattr(pm.base_model.model.backbone.layers[i].mixer, t)
        layer.lora_dropout["default"] = _Mask(torch.tensor(mask))
    logits = pm(input_ids=torch.tensor(ids[:, :-1])).logits
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), torch.tensor(ids[:, 1:]).reshape(-1))
    ref.backward()
    assert rel(loss, ref.item()) < 1e-5
    want = {n[len("base_model.model."):].replace(".default", ""): q.grad.numpy()
            for n, q in pm.named_parameters() if q.requires_grad}
    for n in tensors:
        assert rel(grads[n], want[n]) < 1e-4, n


def test_fresh_adapter_leaves_the_base_model_unchanged(rt):
    """lora_B starts at zero: step 0 of a LoRA run computes exactly the base model."""
    cfg = MambaConfig.from_dict(ODD)
    m = hf_base(ODD)
    sd = {k: v.detach().float().numpy() for k, v in m.state_dict().items() if k != "lm_head.weight"}
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 6))
    base = LanguageModel(rt, cfg, sd).logits(ids)
    model = LanguageModel(rt, cfg, sd)
    spec = el.LoraSpec(r=4, alpha=8)
    model.lora = el.LoraAdapter(rt, cfg, spec, el.init_tensors(cfg, spec, 0))
    np.testing.assert_array_equal(model.logits(ids), base)


@pytest.mark.parametrize("change,needle", [
    ({"use_dora": True}, "use_dora"),
    ({"bias": "all"}, "bias"),
    ({"peft_type": "IA3"}, "peft_type"),
    ({"rank_pattern": {"x_proj": 2}}, "rank_pattern"),
    ({"r": 0}, "r is 0"),
])
def test_unsupported_adapter_configs_are_one_line(tmp_path, change, needle):
    from memengine.engine.errors import MemengineError

    cfg = MambaConfig.from_dict(ODD)
    spec = el.LoraSpec(r=2, alpha=2)
    el.write_adapter(tmp_path, spec, el.init_tensors(cfg, spec, 0))
    d = json.loads((tmp_path / el.ADAPTER_CONFIG).read_text())
    (tmp_path / el.ADAPTER_CONFIG).write_text(json.dumps({**d, **change}))
    with pytest.raises(MemengineError, match=needle):
        el.read_adapter(tmp_path)


def test_adapter_on_a_refused_layer_is_one_line(tmp_path):
    from memengine.engine.errors import MemengineError
    from memengine.engine.io.safetensors_io import write_safetensors

    spec = el.LoraSpec(r=2, alpha=2)
    el.write_adapter(tmp_path, spec, {})
    write_safetensors(tmp_path / el.ADAPTER_WEIGHTS,
                      {"base_model.model.backbone.layers.0.mixer.dt_proj.lora_A.weight": np.zeros((2, 3), np.float32)})
    with pytest.raises(MemengineError, match="dt_proj.weight directly"):
        el.read_adapter(tmp_path)
    cfg = MambaConfig.from_dict(ODD)
    el.write_adapter(tmp_path, el.LoraSpec(r=2, alpha=2), el.init_tensors(cfg, el.LoraSpec(r=2, alpha=2), 0))
    small = MambaConfig.from_dict(dict(ODD, hidden_size=8))
    with pytest.raises(MemengineError, match="belongs to another model"):
        el.check_against(el.read_adapter(tmp_path), small, "x")


def test_adapter_of_some_layers_round_trips_through_peft(tmp_path):
    """layers_to_transform: PEFT's adapter of layer 1 only is read, and written back so that
    PEFT loads it with every tensor in place."""
    m = hf_base(ODD)
    pm = peft.get_peft_model(m, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["in_proj", "x_proj"],
                                                layers_to_transform=[1], task_type="CAUSAL_LM"))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_()
    pm.save_pretrained(tmp_path / "theirs")
    ad = el.read_adapter(tmp_path / "theirs")
    assert ad.layers == [1] and ad.spec.layers == (1,)
    el.write_adapter(tmp_path / "ours", ad.spec, ad.tensors)
    again = peft.PeftModel.from_pretrained(hf_base(ODD, seed=1), tmp_path / "ours")
    sd = {k.replace(".default", ""): v for k, v in again.state_dict().items() if "lora_" in k}
    assert set(sd) == {el.PREFIX + n for n in ad.tensors}
    for n, a in ad.tensors.items():
        np.testing.assert_array_equal(sd[el.PREFIX + n].numpy(), a)


def test_memory_plan_of_a_lora_run():
    """The plan of a LoRA run counts the adapter's parameters, gradients and moments, and no
    gradient store or moments for the base (tests/test_plan.py: it equals what a run allocates)."""
    from memengine.engine.app import plan as mplan

    cfg = MambaConfig.from_dict(ODD)
    spec = el.LoraSpec(r=4, alpha=8)
    t = el.init_tensors(cfg, spec, 0)
    sizes, rows = el.plan_sizes(cfg, spec, t, train=True)
    assert sum(sizes) == sum(a.size for a in t.values()) and rows == (4,) * (2 * cfg.num_hidden_layers + 1)
    lim = mplan.Limits(max_buffer=2**30, max_binding=2**27)
    full = mplan.estimate(cfg, 2, 16, "train", lim)
    lo = mplan.estimate(cfg, 2, 16, "lora", lim, adapter=(sizes, rows))
    # the adapter's gradient store is its parameter store's size; the base has none
    assert lo.parts["gradients"] == lo.parts["parameters"] - full.parts["parameters"]
    assert lo.parts["moments"] < full.parts["moments"] / 5


def test_mixed_precision_lora_gradients_within_bound_of_peft(rt, tmp_path):
    """--lora-rank with --precision mixed: the base's products take f16 operands, the
    adapter's stay f32; loss and adapter gradients within the mixed path's bound of PEFT's
    float64 autograd (depth x 2u, u = 2^-11, as tests/test_mixed.py argues), and the f16
    rounding really in the path."""
    if not rt.has_f16:
        pytest.skip(f"mixed precision needs shader-f16; this is {rt.describe()}")
    kw = dict(vocab_size=256, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4,
              use_bias=False, use_conv_bias=True, tie_word_embeddings=True, time_step_rank=4)
    m = hf_base(kw)
    cfg, sd = save_base(m, tmp_path / "base")
    spec = el.LoraSpec(r=4, alpha=8.0, targets=("in_proj", "x_proj"), base=str(tmp_path / "base"))
    tensors = random_adapter(cfg, spec)
    el.write_adapter(tmp_path / "ad", spec, tensors)
    pm = peft_model(tmp_path / "base", tmp_path / "ad", trainable=True)
    rng = np.random.default_rng(3)
    B, L = 2, 24
    ids = rng.integers(0, cfg.vocab_size, size=(B, L + 1))
    x, y = torch.tensor(ids[:, :-1]), torch.tensor(ids[:, 1:])
    loss = torch.nn.functional.cross_entropy(pm(input_ids=x).logits.reshape(-1, cfg.vocab_size), y.reshape(-1))
    loss.backward()
    want = {n[len("base_model.model."):].replace(".default", ""): p.grad.numpy()
            for n, p in pm.named_parameters() if p.requires_grad}

    def run(precision):
        model = LanguageModel(rt, cfg, sd)
        model.set_precision(precision)
        S = 1024.0 if precision == "mixed" else 1.0
        if precision == "mixed":
            model.loss_scale = rt.upload(np.array([S], np.float32))
        model.lora = el.LoraAdapter(rt, cfg, spec, tensors, train=True)
        got = model.loss_and_grads(ids[:, :-1], ids[:, 1:], trainable=set(model.lora.names))
        return got, {n: g / S for n, g in model.lora.grad_dict().items()}

    u16 = 2.0 ** -11
    depth_fwd = 4 * cfg.num_hidden_layers + 1
    bound_fwd, bound_grad = depth_fwd * 2 * u16, 2 * depth_fwd * 2 * u16
    got, grads = run("mixed")
    f32_loss, f32_grads = run("fp32")
    assert rel(got, loss.item()) < bound_fwd
    errs = {n: rel(grads[n], want[n]) for n in tensors}
    print("\nmixed LoRA gradient rel errors: " + ", ".join(f"{n.split('.')[-2]} {e:.1e}" for n, e in errs.items()))
    assert max(errs.values()) < bound_grad, errs
    # the f16 path really differs from the fp32 one (which is within 1e-4 of PEFT)
    assert max(rel(grads[n], f32_grads[n]) for n in tensors) > 1e-6
