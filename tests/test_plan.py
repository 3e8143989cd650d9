"""The memory plan (engine/plan.py): its figures equal what a run allocates, its refusals
name a flag only when that flag makes the run fit, and the commands refuse before upload."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from memengine.engine.app import plan
from memengine.engine.models.mamba1.config import MambaConfig
from memengine.engine.models import load_config
from memengine.engine.models.mamba1.init import init_weights
from test_cli import assert_one_line_error, run_proc

SMALL = dict(vocab_size=300, hidden_size=64, state_size=16, num_hidden_layers=2, tie_word_embeddings=False,
             use_bias=True)


@pytest.mark.parametrize("kind", plan.KINDS + ("lora", "train-mixed"))
def test_plan_equals_what_a_run_allocates(rt, kind, tmp_path):
    """A whole run through the engine (eval; train with held-out windows, in fp32 and under
    --precision mixed; adapt, which evaluates before and after): the plan it passed equals
    the bytes it allocated."""
    from memengine.engine.app.options import AdaptOptions, EvalOptions, TrainOptions
    from memengine.engine.app.run import run_adapt, run_eval, run_train
    from memengine.engine.io.checkpoint import save_checkpoint

    cfg = MambaConfig.from_dict(SMALL)
    B, L = 2, 300
    save_checkpoint(tmp_path / "m", cfg, init_weights(cfg, 0), dtype="F32")
    rng = np.random.default_rng(0)
    (tmp_path / "d.txt").write_text("".join(chr(c) for c in rng.integers(97, 123, 5 * B * L)), encoding="utf-8")
    common = dict(ckpt=str(tmp_path / "m"), data=[str(tmp_path / "d.txt")], batch_size=B, seq_len=L)
    seen = {}
    real = plan.check_run

    def spy(*a, **kw):
        seen["plan"] = real(*a, **kw)
        return seen["plan"]

    import memengine.engine.app.plan as mplan

    mp = pytest.MonkeyPatch()
    mp.setattr(mplan, "check_run", spy)
    try:
        if kind == "eval":
            run_eval(EvalOptions(**common))
        elif kind == "lora":  # a LoRA adapter trained (with dropout: its masks' buffers too)
            run_train(TrainOptions(**common, epochs=1, val_fraction=0.3, output=tmp_path / "o", lora_rank=4,
                                   lora_dropout=0.1))
        elif kind == "train":
            run_train(TrainOptions(**common, epochs=1, val_fraction=0.3, output=tmp_path / "o"))
        elif kind == "train-mixed":
            if not rt.has_f16:
                pytest.skip("the adapter lacks shader-f16")
            run_train(TrainOptions(**common, epochs=1, val_fraction=0.3, output=tmp_path / "o", precision="mixed"))
        else:
            run_adapt(AdaptOptions(**common, epochs=1, output=tmp_path / "o"))
    finally:
        mp.undo()
    est = seen["plan"]
    got = rt.bytes_allocated
    print(f"\n{kind}: plan {est.total:,} bytes, allocated {got:,} bytes")
    assert got - 4096 <= est.total <= 1.05 * got
    assert est.ok and est.kind == kind.split("-")[0] and (est.batch_size, est.seq_len) == (B, L)
    assert est.mixed == kind.endswith("mixed")


def _lim(memory=None, binding=128 * 2**20, buffer=2**31):
    return plan.Limits(buffer, binding, 256, binding, memory, "test budget")


@pytest.mark.parametrize("kind", plan.KINDS)
@pytest.mark.parametrize("B,L", [(4, 2048), (1, 4096), (16, 512)])
@pytest.mark.parametrize("memory", [int(0.8 * 2**30), 2 * 2**30, 3 * 2**30, 6 * 2**30])
def test_advice_names_a_flag_only_when_it_makes_the_run_fit(kind, B, L, memory):
    """The mamba-130m shape against memory budgets: a refused run's advice, applied, fits;
    and no advice is given when the weights alone are too large."""
    cfg = load_config("mamba-130m")
    lim = _lim(memory)
    p = plan.estimate(cfg, B, L, kind, lim)
    if p.ok:
        assert p.total <= memory
        return
    adv = plan.advice(cfg, p, lim)
    if p.fixed > memory:
        assert adv.startswith("no --batch-size or --seq-len can help"), adv
        return
    words = adv.split()
    b = int(words[words.index("--batch-size") + 1]) if "--batch-size" in words else B
    n = int(words[words.index("--seq-len") + 1]) if "--seq-len" in words else L
    assert (b, n) != (B, L)
    assert plan.estimate(cfg, b, n, kind, lim).ok, adv
    # the largest that fits: one more would not
    if "--seq-len" in words:
        assert not plan.estimate(cfg, b, n + 1, kind, lim).ok
    else:
        assert not plan.estimate(cfg, b + 1, n, kind, lim).ok


def test_refusals_that_no_flag_can_fix():
    cfg = load_config("mamba-130m")
    # a weight larger than the largest buffer
    p = plan.estimate(cfg, 1, 64, "eval", _lim(buffer=100 * 2**20))
    assert "backbone.embeddings.weight needs 147.3 MiB in one GPU buffer" in p.problems[0][0]
    assert plan.advice(cfg, p, _lim(buffer=100 * 2**20)).startswith("no --batch-size or --seq-len")
    # one row of logits larger than a binding
    p = plan.estimate(cfg, 1, 64, "eval", _lim(binding=100 * 2**10))
    assert "one row of logits (50280 values)" in p.problems[0][0]
    # a sequence too long for one binding: only --seq-len helps
    lim = _lim()
    p = plan.estimate(cfg, 2, 40000, "eval", lim)
    assert "--seq-len 40000" in p.problems[0][0]
    assert plan.advice(cfg, p, lim) == "use --seq-len 10922 or less with --batch-size 1"


def test_budget_comes_from_env_or_host_memory(rt, monkeypatch):
    monkeypatch.setenv(plan.ENV_MAX_MEMORY, "3G")
    assert plan.memory_budget("discretegpu") == (3 * 2**30, plan.ENV_MAX_MEMORY)
    monkeypatch.delenv(plan.ENV_MAX_MEMORY)
    mem, src = plan.memory_budget("cpu")
    assert mem and mem > 2**20 and "MemAvailable" in src
    assert plan.memory_budget("cpu", 10**15)[1] == src   # a CPU adapter: host memory still
    assert plan.memory_budget("discretegpu")[0] is None
    # a GPU whose backend tells its memory (Dawn's heaps): that is the budget, unless forced
    mem, src = plan.memory_budget("discretegpu", 80 * 10**9)
    assert mem == 80 * 10**9 and "Dawn" in src
    monkeypatch.setenv(plan.ENV_MAX_MEMORY, "3G")
    assert plan.memory_budget("discretegpu", 80 * 10**9) == (3 * 2**30, plan.ENV_MAX_MEMORY)


def test_the_plan_refuses_what_a_gpus_known_memory_cannot_hold(monkeypatch):
    """On an 80 GB GPU whose size the backend tells, a run whose plan is larger is refused
    in one line naming both figures (mamba-codestral-7b's full training needs 149 GiB)."""
    from memengine.engine import models

    monkeypatch.delenv(plan.ENV_MAX_MEMORY, raising=False)
    path = Path(__file__).resolve().parents[1] / "configs" / "mamba-codestral-7b.json"
    cfg = models.config_from_dict(json.loads(path.read_text()), "codestral")
    lim = plan.Limits(max_buffer=2**40, max_binding=2**31 - 4, memory=80 * 10**9,
                      memory_source=plan.memory_budget("discretegpu", 80 * 10**9)[1])
    p = plan.estimate(cfg, 1, 2048, "train", lim)
    assert p.problems and "but 74.5 GiB is available (the GPU's memory" in p.problems[0][0], p.problems
    assert not plan.estimate(cfg, 1, 2048, "lora", lim).problems


def test_info_prints_the_plan(rt, tiny_ckpt_ro):
    r = run_proc("info", tiny_ckpt_ro, "--seq-len", "64", "--batch-size", "3", "--json",
                 env_extra={"MEMENGINE_MAX_MEMORY_BYTES": "1G"})
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)["plan"]
    assert d["batch_size"] == 3 and d["seq_len"] == 64
    assert d["limits"]["memory_bytes"] == 2**30 and d["limits"]["memory_source"] == "MEMENGINE_MAX_MEMORY_BYTES"
    cfg = MambaConfig.from_dict(json.loads(r.stdout)["config"])
    for kind in plan.KINDS:
        assert d[kind]["ok"] and d[kind]["bytes"] == plan.estimate(cfg, 3, 64, kind, plan.Limits.of(rt)).parts
    assert d["eval"]["bytes"]["gradients"] == 0 and d["train"]["bytes"]["moments"] > d["adapt"]["bytes"]["moments"]
    r = run_proc("info", tiny_ckpt_ro, "--seq-len", "64")
    assert r.returncode == 0 and "memory plan for batch 1 x 64" in r.stdout and "activations" in r.stdout


def test_runs_refused_before_upload_with_the_flag_that_helps(rt, tiny_ckpt_ro, sample_text, tmp_path):
    cfg = MambaConfig.from_dict(json.loads((tiny_ckpt_ro / "config.json").read_text()))
    lim = _lim()
    lim.lanes = plan.Limits.of(rt).lanes   # the kernels the runs below take (their scratch differs)
    fixed = plan.estimate(cfg, 1, 1, "eval", lim).fixed  # the parameters
    budget = plan.estimate(cfg, 1, 512, "train", lim).total + 1  # B=1 fits, B=8 does not
    r = run_proc("train", tiny_ckpt_ro, "--data", sample_text, "-o", tmp_path / "o", "--batch-size", "8",
                 env_extra={"MEMENGINE_MAX_MEMORY_BYTES": str(budget)})
    assert r.returncode == 2
    assert_one_line_error(r.stderr, "use --batch-size")
    assert not (tmp_path / "o").exists()
    r = run_proc("adapt", tiny_ckpt_ro, "--data", sample_text, "-o", tmp_path / "o", "--batch-size", "8",
                 env_extra={"MEMENGINE_MAX_MEMORY_BYTES": str(budget)})
    assert r.returncode == 2  # (adapt also evaluates: one more workspace than train)
    assert_one_line_error(r.stderr, "use --seq-len")
    assert not (tmp_path / "o").exists()
    r = run_proc("eval", tiny_ckpt_ro, "--data", sample_text,
                 env_extra={"MEMENGINE_MAX_MEMORY_BYTES": str(fixed // 2)})
    assert r.returncode == 2
    assert_one_line_error(r.stderr, "no --batch-size or --seq-len can help")


def test_eval_with_tiny_forced_binding_gives_the_same_loss(tiny_ckpt_ro, sample_text):
    a = run_proc("eval", tiny_ckpt_ro, "--data", sample_text, "--seq-len", "12", "--json")
    b = run_proc("eval", tiny_ckpt_ro, "--data", sample_text, "--seq-len", "12", "--json",
                 env_extra={"MEMENGINE_MAX_BINDING_BYTES": "4K", "MEMENGINE_MAX_BUFFER_BYTES": "20K"})
    assert a.returncode == 0 and b.returncode == 0, b.stderr
    la, lb = json.loads(a.stdout)["loss"], json.loads(b.stdout)["loss"]
    assert abs(la - lb) <= 1e-5 * abs(la), (la, lb)
    r = run_proc("eval", tiny_ckpt_ro, "--data", sample_text, env_extra={"MEMENGINE_MAX_BINDING_BYTES": "much"})
    assert r.returncode == 2
    assert_one_line_error(r.stderr, "MEMENGINE_MAX_BINDING_BYTES")


def test_mamba_1_4b_config_and_its_plan(rt, monkeypatch):
    """configs/mamba-1.4b.json is state-spaces/mamba-1.4b-hf's shape: every tensor name and
    shape as transformers' MambaForCausalLM makes them (on the meta device: no memory), and
    its plan at batch 8 x 2048: everything fits a 141 GiB budget (an H200); with 16 GiB
    training is refused with no flag to try (the weights, gradients and moments alone are
    larger) while evaluation fits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from memengine.engine.models.mamba1.config import expected_shapes

    cfg = load_config("mamba-1.4b")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.state_size, cfg.intermediate_size,
            cfg.conv_kernel, cfg.dt_rank) == (2048, 48, 50280, 16, 4096, 4, 128)
    with torch.device("meta"):
        hf = transformers.MambaForCausalLM(transformers.MambaConfig(
            vocab_size=50280, hidden_size=2048, num_hidden_layers=48))
    want = {k: tuple(v.shape) for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied
    assert expected_shapes(cfg) == want
    n_params = sum(int(np.prod(s)) for s in want.values())
    assert 1.3e9 < n_params < 1.4e9

    monkeypatch.setenv(plan.ENV_MAX_MEMORY, "141G")
    rep = plan.report(cfg, 8, 2048, plan.Limits.of(rt))
    assert all(rep[k]["ok"] for k in plan.KINDS)
    assert 4 * n_params <= rep["train"]["bytes"]["parameters"] <= 4 * n_params + 256 * len(want)
    assert 8 * n_params <= rep["train"]["bytes"]["moments"] <= 8 * n_params + 32 * len(want)  # AdamW's two
    monkeypatch.setenv(plan.ENV_MAX_MEMORY, "16G")
    rep = plan.report(cfg, 8, 2048, plan.Limits.of(rt))
    assert rep["eval"]["ok"] and not rep["train"]["ok"]
    assert "for the weights alone" in rep["train"]["problem"]
    assert rep["train"]["advice"].startswith("no --batch-size or --seq-len can help")


def test_a_remade_gradient_store_is_counted_once(rt):
    """An x_proj-only gradient store remade over every tensor (a WSLA run, then a full one in
    the same process) adds to the allocation count what a fresh full store adds."""
    from memengine.engine.models.lm import LanguageModel

    cfg = MambaConfig.from_dict(SMALL)
    fresh = LanguageModel(rt, cfg, init_weights(cfg, 0))
    before = rt.bytes_allocated
    fresh.grad_store(fresh.names)
    full = rt.bytes_allocated - before
    model = LanguageModel(rt, cfg, init_weights(cfg, 0))
    before = rt.bytes_allocated
    model.grad_store([n for n in model.names if "x_proj" in n])
    assert 0 < rt.bytes_allocated - before < full
    model.grad_store(model.names)
    assert rt.bytes_allocated - before == full
