"""`memengine train --lora-rank`, `eval`/`adapt` on an adapter, `merge`, end to end, with PEFT
as the oracle: PEFT loads our adapter and its loss equals `memengine eval` on it; the merged
checkpoint equals PEFT's merge_and_unload(); the base is never modified; a resumed run ends
bit-identical to the one that was never stopped."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
from conftest import SAMPLE_TEXT, make_checkpoint
from safetensors.numpy import load_file
from test_cli import assert_one_line_error, run, tree_digest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ODD = {"hidden_size": 20, "state_size": 3, "num_hidden_layers": 2, "time_step_rank": 3, "use_bias": True}
FAST = ["--seq-len", "32", "--batch-size", "2"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_checkpoint(root / "base", ODD, seed=4)
    text = root / "text.txt"
    text.write_text(SAMPLE_TEXT * 2)
    before = tree_digest(base)
    out = root / "ad"
    r = run("train", base, "--data", text, "-o", out, "--lora-rank", "3", "--lora-alpha", "5", "--max-steps", "6",
            "--lr", "1e-2", "--save-every", "3", *FAST, "--json")
    assert r.exit_code == 0, r.stderr
    assert tree_digest(base) == before, "the base checkpoint was modified"
    return root, base, text, out, r


def torch_loss(model, text, seq_len=32) -> float:
    """Mean next-token loss over the windows `memengine eval --seq-len` scores (bytes)."""
    ids = np.frombuffer(text.read_bytes(), np.uint8).astype(np.int64)
    total, n = 0.0, 0
    for s in range(0, len(ids) - 1, seq_len):
        w = ids[s:s + seq_len + 1]
        if len(w) < 2:
            continue
        x, y = torch.tensor(w[None, :-1]), torch.tensor(w[1:])
        with torch.no_grad():
            logits = model(input_ids=x).logits[0].double()
        total += torch.nn.functional.cross_entropy(logits, y, reduction="sum").item()
        n += len(y)
    return total / n


def peft_on(base, adapter):
    return peft.PeftModel.from_pretrained(transformers.MambaForCausalLM.from_pretrained(base).double(),
                                          adapter).eval()


def test_train_writes_a_peft_adapter(lora_run):
    root, base, _, out, r = lora_run
    events = [json.loads(ln) for ln in r.stdout.splitlines()]
    assert events[-1]["event"] == "summary" and events[-1]["steps"] == 6
    assert {p.name for p in out.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors",
                                               "optimizer.safetensors", "trainer_state.json", "memengine.json"}
    assert not (out / "model.safetensors").exists()
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"], cfg["task_type"], cfg["bias"]) == ("LORA", 3, 5, "CAUSAL_LM",
                                                                                           "none")
    assert sorted(cfg["target_modules"]) == ["in_proj", "x_proj"]
    assert cfg["base_model_name_or_path"] == "base"  # an absolute path keeps only its name
    t = load_file(str(out / "adapter_model.safetensors"))
    assert set(t) == {f"base_model.model.backbone.layers.{i}.mixer.{m}.lora_{w}.weight"
                      for i in range(2) for m in ("in_proj", "x_proj") for w in "AB"}
    assert all(np.abs(v).max() > 0 for k, v in t.items() if "lora_B" in k), "training moved no lora_B"
    moments = load_file(str(out / "optimizer.safetensors"))
    assert {k.rsplit(".", 1)[0] for k in moments if k != "__step__"} == {k[len("base_model.model."):] for k in t}
    rec = json.loads((out / "memengine.json").read_text())
    assert rec["options"]["lora_rank"] == 3 and rec["options"]["lora_targets"] == "in_proj,x_proj"


def test_peft_loss_equals_memengine_eval(lora_run):
    root, base, text, out, _ = lora_run
    r = run("eval", out, "--data", text, "--seq-len", "32", "--json")  # base found through the run's state
    assert r.exit_code == 0, r.stderr
    ours = json.loads(r.stdout)["loss"]
    theirs = torch_loss(peft_on(base, out), text)
    base_loss = torch_loss(transformers.MambaForCausalLM.from_pretrained(base).double().eval(), text)
    assert abs(ours - theirs) / theirs < 1e-4, (ours, theirs)
    assert abs(theirs - base_loss) > 1e-3, "the adapter changed nothing"
    again = run("eval", out, "--base", base, "--data", text, "--seq-len", "32", "--json")
    assert json.loads(again.stdout)["loss"] == ours


def test_merge_equals_peft_merge_and_unload(lora_run):
    root, base, text, out, _ = lora_run
    merged = root / "merged"
    before = tree_digest(base)
    r = run("merge", out, "-o", merged, "--json")
    assert r.exit_code == 0, r.stderr
    assert tree_digest(base) == before
    theirs = peft_on(base, out).merge_and_unload()
    sd = {k: v.float().numpy() for k, v in theirs.state_dict().items()}
    ours = load_file(str(merged / "model.safetensors"))
    assert set(ours) == set(sd) - {"lm_head.weight"}
    for k, a in ours.items():
        np.testing.assert_allclose(a, sd[k], rtol=1e-6, atol=1e-7, err_msg=k)
    mine = transformers.MambaForCausalLM.from_pretrained(merged).double().eval()
    assert abs(torch_loss(mine, text) - torch_loss(theirs, text)) < 1e-6
    ev = json.loads(run("eval", merged, "--data", text, "--seq-len", "32", "--json").stdout)["loss"]
    assert abs(ev - torch_loss(theirs, text)) / ev < 1e-4


def test_resume_continues_identically(lora_run):
    root, base, text, out, _ = lora_run
    res = root / "resumed"
    r = run("train", "--resume", out / "checkpoints" / "step-3", "-o", res, "--json")
    assert r.exit_code == 0, r.stderr
    for f in ("adapter_model.safetensors", "optimizer.safetensors"):
        a, b = load_file(str(out / f)), load_file(str(res / f))
        assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a), f


def test_lora_from_and_adapter_as_ckpt(lora_run):
    root, base, text, out, _ = lora_run
    r = run("train", base, "--lora-from", out, "--data", text, "-o", root / "more", "--max-steps", "1", *FAST,
            "--json")
    assert r.exit_code == 0, r.stderr
    cfg = json.loads((root / "more" / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"]) == (3, 5)
    # the moments beside the adapter were resumed: AdamW's step count goes on
    assert int(load_file(str(root / "more" / "optimizer.safetensors"))["__step__"][0]) == 7
    # the adapter as CKPT is the same run (its base from the adapter)
    r2 = run("train", out, "--data", text, "-o", root / "more2", "--max-steps", "1", *FAST, "--json")
    assert r2.exit_code == 0, r2.stderr
    a, b = (load_file(str(root / d / "adapter_model.safetensors")) for d in ("more", "more2"))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    r = run("train", base, "--lora-from", out, "--data", text, "-o", root / "bad", "--lora-rank", "4", *FAST)
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "--lora-rank 4")


def test_adapt_with_an_adapter_writes_the_merged_model(lora_run):
    root, base, text, out, _ = lora_run
    r = run("adapt", out, "--data", text, "-o", root / "adapted", "--max-steps", "2", "--no-rollback", *FAST,
            "--json")
    assert r.exit_code == 0, r.stderr
    summary = json.loads(r.stdout.splitlines()[-1])
    ev = json.loads(run("eval", root / "adapted", "--data", text, "--seq-len", "32", "--json").stdout)
    assert abs(ev["perplexity"] - summary["perplexity_after"]) / ev["perplexity"] < 1e-5
    a = load_file(str(root / "adapted" / "model.safetensors"))
    b = load_file(str(base / "model.safetensors"))
    changed = sorted(k for k in a if not np.array_equal(a[k], b[k]))
    assert changed == sorted(f"backbone.layers.{i}.mixer.{m}.weight" for i in range(2) for m in ("in_proj", "x_proj"))


@pytest.mark.parametrize("args,needle", [
    (["--lora-rank", "2", "--lora-targets", "out_proj"], "--lora-targets out_proj"),
    (["--lora-rank", "2", "--lora-targets", "dt_proj"], "dt_proj"),
    (["--lora-alpha", "4"], "needs --lora-rank"),
    (["--lora-rank", "0"], "--lora-rank 0"),
])
def test_bad_lora_flags_are_one_line(tiny_ckpt_ro, sample_text, tmp_path, args, needle):
    r = run("train", tiny_ckpt_ro, "--data", sample_text, "-o", tmp_path / "o", *args)
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, needle)


def test_base_flag_needs_an_adapter(tiny_ckpt_ro, sample_text):
    r = run("eval", tiny_ckpt_ro, "--base", tiny_ckpt_ro, "--data", sample_text)
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "--base")


def test_adapt_does_not_take_lora_flags(tiny_ckpt_ro, sample_text, tmp_path):
    r = run("adapt", tiny_ckpt_ro, "--data", sample_text, "-o", tmp_path / "o", "--lora-rank", "2")
    assert r.exit_code == 2


def test_dropout_runs_are_reproducible_from_the_seed(lora_run):
    root, base, text, _, _ = lora_run

    def train(name, seed):
        r = run("train", base, "--data", text, "-o", root / name, "--lora-rank", "2", "--lora-dropout", "0.2",
                "--seed", seed, "--max-steps", "2", "--lr", "1e-2", *FAST, "--no-shuffle", "--json")
        assert r.exit_code == 0, r.stderr
        return load_file(str(root / name / "adapter_model.safetensors"))

    a, b, c = train("d1", 3), train("d2", 3), train("d3", 4)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert any(not np.array_equal(a[k], c[k]) for k in a)
    assert json.loads((root / "d1" / "adapter_config.json").read_text())["lora_dropout"] == 0.2


def test_resumed_and_continued_adapters_keep_their_base_name(lora_run):
    root, base, text, out, _ = lora_run
    r1 = run("train", "--resume", out / "checkpoints" / "step-3", "-o", root / "kb1", "--max-steps", "4", "--json")
    r2 = run("train", out, "--data", text, "-o", root / "kb2", "--max-steps", "1", *FAST, "--json")
    for r, d in ((r1, "kb1"), (r2, "kb2")):
        assert r.exit_code == 0, r.stderr
        assert json.loads((root / d / "adapter_config.json").read_text())["base_model_name_or_path"] == "base"


def test_info_on_an_adapter(lora_run):
    root, base, text, out, _ = lora_run
    r = run("info", out, "--json")
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert (d["r"], d["lora_alpha"], d["scaling"], d["tensors"], d["base_model_name_or_path"]) == (3, 5.0, 5 / 3, 8,
                                                                                               "base")
    t = load_file(str(out / "adapter_model.safetensors"))
    assert d["parameters"] == sum(v.size for v in t.values())


def test_generate_with_an_adapter_equals_peft_generate(lora_run, tmp_path):
    """Greedy tokens of `memengine generate ADAPTER` (prompt pass and decoding steps with the
    adapter applied, not merged) equal PEFT's generate on the base with the adapter."""
    from memengine.engine import lora as el
    from memengine.engine.models.mamba1.config import MambaConfig

    root, base, text, _, _ = lora_run
    cfg = MambaConfig.from_dict(json.loads((base / "config.json").read_text()))
    spec = el.LoraSpec(r=3, alpha=6, base=str(base))
    rng = np.random.default_rng(7)
    el.write_adapter(tmp_path / "ad", spec, {n: (0.5 * rng.standard_normal(sh)).astype(np.float32)
                                             for n, sh in el.shapes(cfg, spec).items()})
    prompt = "it was the age of"
    r = run("generate", tmp_path / "ad", "-p", prompt, "-n", "16", "-t", "0", "--json")
    assert r.exit_code == 0, r.stderr
    ours = json.loads(r.stdout.splitlines()[-1])["tokens"]
    ids = torch.tensor([list(prompt.encode())])
    with torch.no_grad():
        theirs = peft_on(base, tmp_path / "ad").generate(input_ids=ids, max_new_tokens=16, do_sample=False)
    assert len(ours) >= 8 and ours == theirs[0, ids.shape[1]:].tolist()[:len(ours)]
    plain = run("generate", base, "-p", prompt, "-n", "16", "-t", "0", "--json")
    assert json.loads(plain.stdout.splitlines()[-1])["tokens"] != ours, "the adapter changed nothing"
