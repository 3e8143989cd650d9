"""The architecture seam: a model family defined under tests/ alone (tests/toy_conv_arch.py,
a causal-convolution LM), registered through the public registry, runs through the engine's
shell and the command line: init, train (two steps), eval and generate.  Its oracles are a
float64 numpy forward and torch autograd of the same model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import toy_conv_arch as toy
from memengine.engine import models
from memengine.engine.io.checkpoint import load_checkpoint
from memengine.engine.models.lm import LanguageModel

HERE = Path(__file__).resolve().parent
ENGINE = HERE.parent / "engine"
CFG = dict(model_type="toy_conv", vocab_size=259, hidden_size=24, inner_size=36, conv_kernel=3, num_hidden_layers=2,
           tie_word_embeddings=False)


def test_nothing_of_the_toy_architecture_is_in_the_engine():
    hits = [p for p in ENGINE.rglob("*.py") if "toy_conv" in p.read_text(encoding="utf-8")]
    assert hits == []
    assert models.architecture("toy_conv").name == "toy causal-conv LM"   # registered from tests/


def _model(rt, seed=0):
    cfg = models.config_from_dict(dict(CFG), "toy")
    w = models.of(cfg).init_weights(cfg, seed)
    return cfg, w, LanguageModel(rt, cfg, w)


def test_logits_equal_numpy(rt):
    cfg, w, m = _model(rt)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 19))
    ours = m.logits(ids)
    for b in range(2):
        ref = toy.numpy_logits(cfg, w, ids[b])
        assert np.abs(ours[b] - ref).max() / np.abs(ref).max() < 1e-5


def test_every_gradient_equals_torch_autograd(rt):
    torch = pytest.importorskip("torch")
    cfg, w, m = _model(rt, seed=1)
    rng = np.random.default_rng(1)
    ids, targets = rng.integers(0, cfg.vocab_size, (2, 13)), rng.integers(0, cfg.vocab_size, (2, 13))
    targets[0, :3] = -1
    loss = m.loss_and_grads(ids, targets)
    grads = m.grad_dict()
    tw = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in w.items()}
    a, K = models.of(cfg), cfg.conv_kernel

    def norm(x, g):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + cfg.layer_norm_epsilon) * g

    h = tw[a.EMBEDDINGS][torch.tensor(ids)]
    for i in range(cfg.num_hidden_layers):
        p = f"{a.LAYER_PREFIX}{i}."
        x = norm(h, tw[p + "norm.weight"]) @ tw[p + "in_proj.weight"].T
        c = torch.nn.functional.conv1d(x.transpose(1, 2), tw[p + "conv.weight"], padding=K - 1,
                                       groups=cfg.inner_size)[..., :x.shape[1]].transpose(1, 2)
        h = h + torch.nn.functional.silu(c) @ tw[p + "out_proj.weight"].T
    logits = norm(h, tw[a.FINAL_NORM]) @ tw[a.HEAD].T
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), torch.tensor(targets).reshape(-1),
                                            ignore_index=-1)
    ref.backward()
    assert abs(loss - ref.item()) < 1e-5 * abs(ref.item())
    assert set(grads) == set(w)
    for name, g in grads.items():
        want = tw[name].grad.numpy()
        err = np.abs(g - want).max() / max(np.abs(want).max(), 1e-12)
        assert err < 1e-4, (name, err)


def _cli(*args, cwd):
    env = dict(os.environ, MEMENGINE_MODELS="toy_conv_arch",
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    env.pop("MEMENGINE_DEBUG", None)
    r = subprocess.run([sys.executable, "-m", "memengine.cli.main", *map(str, args)], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]


def test_init_train_eval_generate_through_the_cli(tmp_path):
    (tmp_path / "toy.json").write_text(json.dumps(CFG))
    (tmp_path / "d.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    _cli("init", "toy.json", "-o", "m", "--seed", "3", "--json", cwd=tmp_path)
    ev = _cli("train", "m", "--data", "d.txt", "-o", "t", "--max-steps", "2", "--log-every", "1", "--seq-len", "32",
              "--batch-size", "2", "--lr", "1e-2", "--json", cwd=tmp_path)
    steps = [e for e in ev if e["event"] == "step"]
    assert [e["step"] for e in steps] == [1, 2] and all(np.isfinite(e["loss"]) for e in steps)
    before, after = load_checkpoint(tmp_path / "m"), load_checkpoint(tmp_path / "t")
    assert after.config.model_type == "toy_conv"
    assert all(not np.array_equal(before.tensors[n], after.tensors[n]) for n in before.tensors)

    # eval: the loss over the text's windows equals the numpy model's
    (res,) = _cli("eval", "t", "--data", "d.txt", "--seq-len", "64", "--json", cwd=tmp_path)
    ids = np.frombuffer((tmp_path / "d.txt").read_bytes(), np.uint8).astype(np.int64)
    losses = []
    for s in range(0, len(ids) - 1, 64):
        win = ids[s:s + 65]
        lg = toy.numpy_logits(after.config, after.tensors, win[:-1])
        lg = lg - lg.max(-1, keepdims=True)
        lp = lg - np.log(np.exp(lg).sum(-1, keepdims=True))
        losses += list(-lp[np.arange(len(win) - 1), win[1:]])
    assert res["tokens"] == len(losses)
    assert abs(res["loss"] - np.mean(losses)) < 1e-5 * abs(np.mean(losses))

    # generate: greedy tokens equal the numpy model's argmax, token by token
    (gen,) = _cli("generate", "t", "-p", "the quick", "-n", "10", "-t", "0", "--json", cwd=tmp_path)
    seq = list(b"the quick")
    for _ in range(10):
        seq.append(int(np.argmax(toy.numpy_logits(after.config, after.tensors, np.array(seq))[-1])))
    assert gen["tokens"] == seq[len(b"the quick"):]
