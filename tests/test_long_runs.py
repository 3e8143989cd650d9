"""Long runs: periodic checkpoints and exact resume, schedules against transformers,
gradient accumulation against the big batch, held-out evaluation against `eval`,
SIGTERM, shuffling, and the rest of the run options (tiny model, lavapipe-friendly)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import SAMPLE_TEXT
from safetensors.numpy import load_file
from test_cli import assert_one_line_error, run

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TIMING = ("tokens_per_s", "elapsed_s")


def json_lines(stdout: str) -> list[dict]:
    return [json.loads(ln) for ln in stdout.splitlines()]


def events(stdout: str, kind: str) -> list[dict]:
    return [e for e in json_lines(stdout) if e.get("event") == kind]


def untimed(evs: list[dict]) -> list[dict]:
    return [{k: v for k, v in e.items() if k not in TIMING} for e in evs]


def tensors_equal(a: Path, b: Path) -> None:
    ta, tb = load_file(str(a)), load_file(str(b))
    assert set(ta) == set(tb)
    for k in ta:
        assert ta[k].tobytes() == tb[k].tobytes(), k


@pytest.fixture
def text(tmp_path) -> Path:
    p = tmp_path / "text.txt"
    p.write_text(SAMPLE_TEXT * 2)
    return p


# ----------------------------------------------------------------------------- resume
def test_resume_from_inside_the_second_epoch_is_bit_identical(tiny_ckpt_ro, text, tmp_path):
    """A run resumed from a checkpoint inside its second epoch ends with the same bytes as
    the run that was never stopped: weights, optimizer moments, and the history of step,
    eval and epoch events (shuffled windows, cosine schedule with warmup, accumulation,
    a held-out split)."""
    common = ["--data", text, "--seq-len", "32", "--batch-size", "2", "--grad-accum", "2", "--epochs", "3",
              "--lr", "3e-3", "--lr-schedule", "cosine", "--warmup-steps", "2", "--val-fraction", "0.2",
              "--save-every", "4", "--log-every", "2", "--json"]
    a = tmp_path / "a"
    ra = run("train", tiny_ckpt_ro, "-o", a, *common)
    assert ra.exit_code == 0, ra.stderr
    ep = events(ra.stdout, "epoch")
    spe = ep[0]["step"]
    assert len(ep) == 3 and spe == 3, ep  # step 4 is inside the second epoch
    saved = sorted(p.name for p in (a / "checkpoints").iterdir())
    assert saved == ["step-4", "step-8", "step-9"]  # every 4 steps and after the last

    b = tmp_path / "b"
    rb = run("train", "--resume", a / "checkpoints" / "step-4", "-o", b, "--json")
    assert rb.exit_code == 0, rb.stderr
    assert "resuming" in rb.stderr
    tensors_equal(a / "model.safetensors", b / "model.safetensors")
    tensors_equal(a / "optimizer.safetensors", b / "optimizer.safetensors")
    # the resumed run reports steps 5.. exactly as the straight run did
    for kind in ("step", "eval", "epoch"):
        straight = [e for e in untimed(events(ra.stdout, kind)) if e["step"] > 4]
        assert untimed(events(rb.stdout, kind)) == straight, kind
    assert [e["step"] for e in events(rb.stdout, "step")] == [6, 8]
    # memengine.json holds the whole history across the resume
    rec_a = json.loads((a / "memengine.json").read_text())
    rec_b = json.loads((b / "memengine.json").read_text())
    assert untimed(rec_b["history"]) == untimed(rec_a["history"])
    assert len(rec_b["segments"]) == 2 and rec_b["segments"][1]["first_step"] == 4
    assert rec_b["options"]["lr_schedule"] == "cosine"  # taken from the resumed run

    # the checkpoint is a full one: transformers loads it and agrees with us
    step4 = a / "checkpoints" / "step-4"
    hf = transformers.MambaForCausalLM.from_pretrained(str(step4)).float().eval()
    ids = np.frombuffer(SAMPLE_TEXT[:24].encode(), np.uint8).astype(np.int64)[None]
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids)).logits.numpy()
    from memengine.engine.io.checkpoint import load_checkpoint
    from memengine.engine.models.lm import LanguageModel
    from memengine.engine.runtime import get_runtime

    ours = LanguageModel.from_checkpoint(get_runtime(), load_checkpoint(step4)).logits(ids.astype(np.int32))
    np.testing.assert_allclose(ours, want, rtol=1e-4, atol=1e-4)
    for f in [*step4.iterdir(), *b.iterdir()]:  # no absolute local path in what we wrote
        if f.is_file():
            assert str(tmp_path).encode() not in f.read_bytes(), f
    st = json.loads((step4 / "trainer_state.json").read_text())
    assert st["step"] == 4 and st["epoch"] == 2 and st["loop"]["order"]["index"] == 1
    assert st["loop"]["order"]["rng"]["bit_generator"] == "PCG64" and st["loop"]["schedule"]["kind"] == "cosine"


def test_continue_in_place_and_for_more_epochs(tiny_ckpt_ro, text, tmp_path):
    """`train --resume OUT` continues in place (OUT is the resumed run's) and may extend the
    run; the result equals a run that had the longer length from the start."""
    common = ["--data", text, "--seq-len", "32", "--batch-size", "4", "--lr", "3e-3", "--save-every", "3"]
    straight = tmp_path / "straight"
    r = run("train", tiny_ckpt_ro, "-o", straight, "--epochs", "3", *common)
    assert r.exit_code == 0, r.stderr
    out = tmp_path / "out"
    r = run("train", tiny_ckpt_ro, "-o", out, "--epochs", "2", *common)
    assert r.exit_code == 0, r.stderr
    r = run("train", "--resume", out, "--epochs", "3", "--json")
    assert r.exit_code == 0, r.stderr
    tensors_equal(straight / "model.safetensors", out / "model.safetensors")
    rec = json.loads((out / "memengine.json").read_text())
    assert [e["epoch"] for e in rec["history"] if e["event"] == "epoch"] == [1, 2, 3]
    steps = [e["step"] for e in rec["history"] if e["event"] == "epoch"]
    assert steps == sorted(steps) and steps[-1] == events(r.stdout, "summary")[0]["steps"]
    assert len(rec["segments"]) == 2 and rec["options"]["epochs"] == 3
    # nothing to do: the run is already at its end; a CKPT with --resume that is not the one
    # the run started from is refused (the one it started from is accepted: test_everyday.py)
    r = run("train", "--resume", out, "--epochs", "3")
    assert r.exit_code == 0, r.stderr
    other = tmp_path / "other"
    shutil.copytree(tiny_ckpt_ro, other)
    r = run("train", other, "--resume", out)
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "--resume")


def test_resume_refuses_other_data_and_mixed_histories(tiny_ckpt_ro, text, tmp_path):
    out = tmp_path / "out"
    r = run("train", tiny_ckpt_ro, "-o", out, "--data", text, "--seq-len", "32", "--batch-size", "4",
            "--epochs", "2", "--save-every", "2")
    assert r.exit_code == 0, r.stderr
    other = tmp_path / "other.txt"
    other.write_text("something else entirely " * 20)
    r = run("train", "--resume", out, "--data", other)
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "--data")
    r = run("train", "--resume", out / "checkpoints" / "step-2")  # in place, before later steps
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "step-4")
    r = run("adapt", "--resume", out)
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "memengine train --resume")


# ----------------------------------------------------------------------------- SIGTERM
def test_sigterm_keeps_the_last_checkpoint_loadable_and_resumable(tiny_ckpt_ro, text, tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ)
    env.pop("MEMENGINE_DEBUG", None)
    p = subprocess.Popen([sys.executable, "-m", "memengine.cli.main", "train", str(tiny_ckpt_ro), "--data",
                          str(text), "-o", str(out), "--epochs", "500", "--seq-len", "32", "--batch-size", "2",
                          "--save-every", "3"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    seen = ""
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            line = p.stderr.readline()
            seen += line
            if "saved checkpoint" in line or not line:
                break
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 143, seen + err  # 128 + SIGTERM, as a shell reports it
    assert "Traceback" not in err
    assert_one_line_error(err, "the last checkpoint is")
    assert "terminated (SIGTERM)" in err
    steps = sorted(int(d.name[5:]) for d in (out / "checkpoints").iterdir() if d.name.startswith("step-"))
    # the periodic ones, and the one SIGTERM wrote after the step in flight
    assert steps and all(s % 3 == 0 for s in steps[:-1])
    assert not [d for d in (out / "checkpoints").iterdir() if d.name.startswith(".")]  # no partial one
    last = out / "checkpoints" / f"step-{steps[-1]}"
    assert f"step-{steps[-1]}" in err
    transformers.MambaForCausalLM.from_pretrained(str(last))  # loadable
    r = run("train", "--resume", out, "--max-steps", str(steps[-1] + 2), "--json")  # resumable
    assert r.exit_code == 0, r.stderr
    assert events(r.stdout, "summary")[0]["steps"] == steps[-1] + 2
    assert (out / "model.safetensors").is_file()


# ----------------------------------------------------------------------------- schedules
@pytest.mark.parametrize("kind,min_lr", [("constant", 0.0), ("linear", 0.0), ("cosine", 0.0), ("cosine", 2e-4)])
def test_schedule_lrs_equal_transformers(kind, min_lr):
    from memengine.engine.train.schedule import Schedule
    from transformers import (
        get_constant_schedule_with_warmup,
        get_cosine_schedule_with_warmup,
        get_cosine_with_min_lr_schedule_with_warmup,
        get_linear_schedule_with_warmup,
    )

    lr, warmup, total = 1e-3, 4, 17
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    if kind == "constant":
        sch = get_constant_schedule_with_warmup(opt, warmup)
    elif kind == "linear":
        sch = get_linear_schedule_with_warmup(opt, warmup, total)
    elif min_lr:
        sch = get_cosine_with_min_lr_schedule_with_warmup(opt, warmup, total, min_lr=min_lr)
    else:
        sch = get_cosine_schedule_with_warmup(opt, warmup, total)
    ours = Schedule(kind, lr, warmup, total, min_lr)
    want, got = [], []
    for k in range(total + 3):  # update k+1 uses the lr after k scheduler steps
        want.append(opt.param_groups[0]["lr"])
        got.append(ours.lr(k))
        opt.step()
        sch.step()
    assert got == want
    assert len(set(got)) > 3 or kind == "constant"


def test_scheduled_steps_match_torch_adamw(rt):
    """The per-step lr reaches the AdamW kernel: four steps of a linear schedule with
    warmup equal torch AdamW + get_linear_schedule_with_warmup, and AdamW's uniform
    buffer is made once."""
    from memengine.engine.app.options import TrainOptions
    from memengine.engine.models.mamba1.config import MambaConfig
    from memengine.engine.models.mamba1.init import init_weights
    from memengine.engine.models.lm import LanguageModel
    from memengine.engine.train.loop import fit

    cfg = MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=1, expand=2, conv_kernel=4,
                      tie_word_embeddings=False)
    w = init_weights(cfg, 7)
    hf = transformers.MambaForCausalLM(transformers.MambaConfig(**cfg.to_hf_dict())).double()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            p.copy_(torch.tensor(w[n], dtype=torch.float64))
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 64, size=(2, 10)).astype(np.int32)
    tg = rng.integers(0, 64, size=(2, 10)).astype(np.int32)
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-2, weight_decay=0.01)
    sch = transformers.get_linear_schedule_with_warmup(opt, 2, 4)
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.zero_grad()
        logits = hf(input_ids=torch.tensor(ids, dtype=torch.long)).logits
        torch.nn.functional.cross_entropy(logits.reshape(-1, 64), torch.tensor(tg, dtype=torch.long).reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        sch.step()
    model = LanguageModel(rt, cfg, w)
    loop = fit(model, [(ids[0], tg[0]), (ids[1], tg[1])],
               TrainOptions(max_steps=4, lr=1e-2, batch_size=2, seq_len=10, lr_schedule="linear", warmup_steps=2,
                            log_every=1, shuffle=False))
    assert [e["lr"] for e in loop.state.history if e["event"] == "step"] == lrs
    assert lrs[0] == 0.0 and lrs[1] > 0
    assert loop.trainer.opt.uniform_buffers_created == 1
    ours = model.state_dict()
    for n, p in hf.named_parameters():
        ref = p.detach().numpy()
        assert np.abs(ours[n] - ref).max() <= 1e-4 * max(np.abs(ref).max(), 1e-6), n


# ----------------------------------------------------------------------------- accumulation
def test_grad_accum_equals_the_big_batch(rt):
    """--batch-size 2 --grad-accum 3 is --batch-size 6: the same windows in the same order
    (shuffled), the same losses and pre-clip norms up to rounding, the same weights."""
    from memengine.engine.app.options import TrainOptions
    from memengine.engine.io.data import make_windows
    from memengine.engine.models.mamba1.config import MambaConfig
    from memengine.engine.models.mamba1.init import init_weights
    from memengine.engine.models.lm import LanguageModel
    from memengine.engine.train.loop import fit

    cfg = MambaConfig(vocab_size=256, hidden_size=16, state_size=4, num_hidden_layers=1, expand=2, conv_kernel=4)
    ids = np.frombuffer((SAMPLE_TEXT * 2).encode(), np.uint8).astype(np.int32)
    ws = make_windows(ids, 24)
    assert len(ws) % 6, "a partial last step is part of the test"
    common = dict(epochs=2, lr=3e-3, seq_len=24, log_every=1, max_grad_norm=0.5)
    big = LanguageModel(rt, cfg, init_weights(cfg, 3))
    acc = LanguageModel(rt, cfg, init_weights(cfg, 3))
    lb = fit(big, ws, TrainOptions(batch_size=6, **common))
    la = fit(acc, ws, TrainOptions(batch_size=2, grad_accum=3, **common))
    sb = [e for e in lb.state.history if e["event"] == "step"]
    sa = [e for e in la.state.history if e["event"] == "step"]
    assert [e["step"] for e in sa] == [e["step"] for e in sb] and [e["tokens"] for e in sa] == [e["tokens"] for e in sb]
    np.testing.assert_allclose([e["grad_norm"] for e in sa], [e["grad_norm"] for e in sb], rtol=2e-6)
    np.testing.assert_allclose([e["loss"] for e in sa], [e["loss"] for e in sb], rtol=2e-6)
    assert sb[0]["grad_norm"] > 0.5  # clipping was active
    a, b = acc.state_dict(), big.state_dict()
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    print(f"\nlargest weight difference after {len(sa)} steps: {worst:.2e}")
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-5, err_msg=k)
    # not the same as a plain batch of 2 (the test can fail)
    small = LanguageModel(rt, cfg, init_weights(cfg, 3))
    ls = fit(small, ws, TrainOptions(batch_size=2, **common))
    assert len([e for e in ls.state.history if e["event"] == "step"]) != len(sa)


# ----------------------------------------------------------------------------- evaluation
def test_final_val_loss_equals_eval_of_out(tiny_ckpt_ro, text, tmp_path):
    val = tmp_path / "val.txt"
    val.write_text("The season of Light and the season of Darkness, the spring of hope. " * 3)
    out = tmp_path / "out"
    r = run("train", tiny_ckpt_ro, "--data", text, "--val-data", val, "-o", out, "--seq-len", "32",
            "--batch-size", "3", "--epochs", "2", "--eval-every", "4", "--lr", "3e-3", "--json")
    assert r.exit_code == 0, r.stderr
    ev = events(r.stdout, "eval")
    ep = events(r.stdout, "epoch")
    spe = ep[0]["step"]
    want_steps = sorted({*range(4, 2 * spe + 1, 4), spe, 2 * spe})
    assert [e["step"] for e in ev] == want_steps  # every 4 steps, each epoch's end, the last step
    for e in ev:
        assert set(e) == {"event", "step", "val_loss", "val_perplexity", "val_tokens", "val_bits_per_token",
                          "val_top1_accuracy", "val_top5_accuracy"}
    assert ev[-1]["val_loss"] < ev[0]["val_loss"]
    r2 = run("eval", out, "--data", val, "--seq-len", "32", "--json")
    assert r2.exit_code == 0, r2.stderr
    e = json.loads(r2.stdout)
    assert e["loss"] == ev[-1]["val_loss"] and e["tokens"] == ev[-1]["val_tokens"]
    assert e["top1_accuracy"] == ev[-1]["val_top1_accuracy"] and e["top5_accuracy"] == ev[-1]["val_top5_accuracy"]
    s = events(r.stdout, "summary")[0]
    assert s["val_loss"] == e["loss"]
    assert "val loss" in r.stderr  # the table's column


def test_eval_metrics_and_compare(tiny_ckpt_ro, text, tmp_path):
    """bits per token = loss / ln 2; top-1/top-5 against the logits; --compare reports both
    checkpoints and B - A."""
    from memengine.engine.io.checkpoint import load_checkpoint
    from memengine.engine.models.lm import LanguageModel
    from memengine.engine.runtime import get_runtime

    out = tmp_path / "out"
    assert run("train", tiny_ckpt_ro, "--data", text, "-o", out, "--seq-len", "32", "--epochs", "2",
               "--batch-size", "4", "--lr", "3e-3").exit_code == 0
    r = run("eval", out, "--data", text, "--seq-len", "32", "--json")
    d = json.loads(r.stdout)
    ids = np.frombuffer(text.read_bytes(), np.uint8).astype(np.int32)
    model = LanguageModel.from_checkpoint(get_runtime(), load_checkpoint(out))
    top1 = top5 = n = 0
    for s in range(0, ids.size - 1, 32):
        x, y = ids[s:s + 32], ids[s + 1:s + 33]
        x = x[:y.size]
        lg = model.logits(x[None])[0]
        rank = (lg > lg[np.arange(y.size), y][:, None]).sum(1)
        top1 += int((rank < 1).sum())
        top5 += int((rank < 5).sum())
        n += y.size
    assert d["tokens"] == n
    assert d["top1_accuracy"] == top1 / n and d["top5_accuracy"] == top5 / n
    assert 0 < d["top1_accuracy"] < d["top5_accuracy"] < 1
    assert abs(d["bits_per_token"] - d["loss"] / np.log(2)) < 1e-12

    r = run("eval", tiny_ckpt_ro, "--compare", out, "--data", text, "--seq-len", "32", "--json")
    assert r.exit_code == 0, r.stderr
    c = json.loads(r.stdout)
    assert set(c) == {"a", "b", "difference"}
    assert c["b"]["loss"] == d["loss"] and c["a"]["checkpoint"] == str(tiny_ckpt_ro)
    assert c["difference"]["loss"] == c["b"]["loss"] - c["a"]["loss"] < 0
    r = run("eval", tiny_ckpt_ro, "--compare", out, "--data", text, "--seq-len", "32")
    assert "B - A" in r.stdout and "top-5 accuracy" in r.stdout   # the result: on stdout


def test_keep_last_and_keep_best(tiny_ckpt_ro, text, tmp_path):
    out = tmp_path / "out"
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", out, "--seq-len", "32", "--batch-size", "4",
            "--epochs", "4", "--lr", "0.05", "--val-fraction", "0.25", "--save-every", "2", "--keep-last", "1",
            "--keep-best", "--json")
    assert r.exit_code == 0, r.stderr
    ev = {e["step"]: e["val_loss"] for e in events(r.stdout, "eval")}
    saves = [e["step"] for e in events(r.stdout, "checkpoint")]
    assert all(s in ev for s in saves)  # each checkpoint has its validation loss
    best = min(saves, key=lambda s: (ev[s], s))
    left = sorted(int(p.name[5:]) for p in (out / "checkpoints").iterdir())
    assert left == sorted({saves[-1], best})
    tensors_equal(out / "checkpoints" / f"step-{best}" / "model.safetensors", out / "model.safetensors")
    rec = json.loads((out / "memengine.json").read_text())
    assert rec["best"]["step"] == best
    s = events(r.stdout, "summary")[0]
    assert s["best_step"] == best
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", tmp_path / "x", "--keep-best", "--save-every", "2")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "--keep-best")


# ----------------------------------------------------------------------------- data order, steps
def test_window_order_shuffles_per_epoch_and_resumes():
    from memengine.engine.train.sampler import WindowOrder, split_windows

    o = WindowOrder(10, 3, seed=5, shuffle=True)
    seen = [o.next() for _ in range(12)]  # 4 steps per epoch, 3 epochs
    assert [(e, k) for e, k, _ in seen][:5] == [(1, 1), (1, 2), (1, 3), (1, 4), (2, 1)]
    epochs = [np.concatenate([idx for e, _, idx in seen if e == n]) for n in (1, 2, 3)]
    for p in epochs:
        assert sorted(p.tolist()) == list(range(10))
    assert epochs[0].tolist() != epochs[1].tolist() != epochs[2].tolist()
    # the same seed gives the same order; the state continues it exactly
    o2 = WindowOrder(10, 3, seed=5, shuffle=True)
    for _ in range(6):
        o2.next()
    o3 = WindowOrder(10, 3, seed=5, shuffle=True, state=json.loads(json.dumps(o2.state())))
    assert [o3.next()[2].tolist() for _ in range(6)] == [idx.tolist() for _, _, idx in seen[6:]]
    assert WindowOrder(10, 3, seed=6, shuffle=True).next()[2].tolist() != seen[0][2].tolist()
    plain = WindowOrder(10, 3, seed=5, shuffle=False)
    assert np.concatenate([plain.next()[2] for _ in range(4)]).tolist() == list(range(10))
    tr, va = split_windows(20, 0.25, 3)
    assert len(va) == 5 and sorted(tr.tolist() + va.tolist()) == list(range(20))
    assert split_windows(20, 0.25, 3)[1].tolist() == va.tolist() != split_windows(20, 0.25, 4)[1].tolist()


def test_max_steps_and_no_shuffle(tiny_ckpt_ro, text, tmp_path):
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", tmp_path / "a", "--seq-len", "32", "--max-steps", "14",
            "--batch-size", "4", "--log-every", "5", "--json")
    assert r.exit_code == 0, r.stderr
    s = events(r.stdout, "summary")[0]
    assert s["steps"] == 14 and s["epochs"] > 1  # only --max-steps: epochs are not the limit
    assert [e["step"] for e in events(r.stdout, "step")] == [5, 10]
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", tmp_path / "b", "--seq-len", "32", "--max-steps", "100",
            "--epochs", "1", "--batch-size", "4", "--json")
    assert events(r.stdout, "summary")[0]["epochs"] == 1  # whichever ends first
    runs = {}
    for name, flags in (("s1", []), ("s2", []), ("ns", ["--no-shuffle"]), ("seed", ["--seed", "9"])):
        r = run("train", tiny_ckpt_ro, "--data", text, "-o", tmp_path / name, "--seq-len", "32", "--max-steps", "3",
                "--batch-size", "4", "--lr", "3e-3", *flags)
        assert r.exit_code == 0, r.stderr
        runs[name] = (tmp_path / name / "model.safetensors").read_bytes()
    assert runs["s1"] == runs["s2"]  # reproducible
    assert runs["s1"] != runs["ns"] and runs["s1"] != runs["seed"]  # the order matters


def test_config_file_sets_the_new_options(tiny_ckpt_ro, text, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("seq-len: 32\nbatch-size: 2\ngrad-accum: 2\nmax-steps: 3\nlr-schedule: linear\n"
                   "warmup-steps: 1\nlog-every: 1\nshuffle: false\nval-fraction: 0.2\n")
    out = tmp_path / "o"
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", out, "--config", cfg, "--json")
    assert r.exit_code == 0, r.stderr
    assert [e["lr"] for e in events(r.stdout, "step")] == [0.0, 1e-4, 5e-5]
    rec = json.loads((out / "memengine.json").read_text())
    assert rec["options"]["grad_accum"] == 2 and rec["options"]["shuffle"] is False
    cfg.write_text("lr-schedule: sawtooth\n")
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", tmp_path / "p", "--config", cfg)
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "--lr-schedule sawtooth")


def test_mismatched_optimizer_state_is_one_line_naming_the_tensor(tiny_ckpt, text, tmp_path):
    from safetensors.numpy import save_file

    save_file({"backbone.norm_f.weight.exp_avg": np.zeros(7, np.float32),
               "backbone.norm_f.weight.exp_avg_sq": np.zeros(7, np.float32),
               "__step__": np.array([3], np.int64)}, str(tiny_ckpt / "optimizer.safetensors"))
    r = run("train", tiny_ckpt, "--data", text, "-o", tmp_path / "o", "--seq-len", "32", "--epochs", "1")
    assert r.exit_code == 2, r.stderr
    assert_one_line_error(r.stderr, "backbone.norm_f.weight")
    save_file({"backbone.nothing.exp_avg": np.zeros(3, np.float32),
               "backbone.nothing.exp_avg_sq": np.zeros(3, np.float32)}, str(tiny_ckpt / "optimizer.safetensors"))
    r = run("adapt", tiny_ckpt, "--data", text, "-o", tmp_path / "o", "--seq-len", "32", "--epochs", "1")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "backbone.nothing")


# ----------------------------------------------------------------------------- progress lines
def test_progress_line_when_stderr_is_not_a_terminal():
    import io

    from memengine.cli.ui import UI
    from memengine.engine.listener import Plan, Progress

    err = io.StringIO()
    ui = UI(stderr=err, progress_interval=0.05)
    view = ui.run_view()
    view.on_start(Plan(title="train x -> y", total_steps=10, steps_per_epoch=5, epochs=2))
    view.on_progress(Progress(step=3, total_steps=10, epoch=1, step_in_epoch=3, steps_per_epoch=5, lr=1e-3,
                              last_loss=2.5))
    time.sleep(0.4)
    view.on_finish()  # the loop ended: the timer goes on until the command closes the view
    view.close()
    lines = err.getvalue().splitlines()
    beats = [ln for ln in lines if "step 3/10" in ln]
    assert beats and "loss 2.5000" in beats[0] and "elapsed" in beats[0]
    n = len(err.getvalue())
    time.sleep(0.2)
    assert len(err.getvalue()) == n  # the timer stopped with the run


def test_nonfinite_loss_keeps_the_last_checkpoint(tiny_ckpt_ro, text, tmp_path):
    out = tmp_path / "out"
    r = run("train", tiny_ckpt_ro, "--data", text, "-o", out, "--seq-len", "32", "--epochs", "3", "--lr", "1e30",
            "--max-grad-norm", "0", "--save-every", "1", "--json")
    assert r.exit_code == 1, r.stderr
    assert_one_line_error(r.stderr, "non-finite")
    saved = sorted(int(p.name[5:]) for p in (out / "checkpoints").iterdir())
    assert saved and f"step-{saved[-1]}" in r.stderr and "--resume" in r.stderr
    assert not (out / "model.safetensors").exists()  # OUT's model is only the result of a finished run
    st = json.loads((out / "checkpoints" / f"step-{saved[-1]}" / "trainer_state.json").read_text())
    assert all(np.isfinite(e["loss"]) for e in st["loop"]["history"] if "loss" in e)


def test_resume_keeps_what_decides_the_data_order(tiny_ckpt_ro, text, tmp_path):
    out = tmp_path / "out"
    r = run("train", tiny_ckpt_ro, "-o", out, "--data", text, "--seq-len", "32", "--batch-size", "4",
            "--max-steps", "2", "--save-every", "2")
    assert r.exit_code == 0, r.stderr
    for flag, value in (("--seed", "3"), ("--batch-size", "2"), ("--grad-accum", "2"), ("--no-shuffle", None)):
        r = run("train", "--resume", out, "--max-steps", "4", flag, *([value] if value else []))
        assert r.exit_code == 2, flag
        assert_one_line_error(r.stderr, flag)
    r = run("train", "--resume", out, "--max-steps", "4", "--lr", "1e-3")  # the lr may change
    assert r.exit_code == 0, r.stderr


def test_adapt_resumes_exactly_and_keeps_its_before(tiny_ckpt_ro, text, tmp_path):
    common = ["--data", text, "--seq-len", "32", "--batch-size", "2", "--epochs", "2", "--lr", "1e-3",
              "--save-every", "3", "--no-rollback", "--json"]
    a = tmp_path / "a"
    ra = run("adapt", tiny_ckpt_ro, "-o", a, *common)
    assert ra.exit_code == 0, ra.stderr
    b = tmp_path / "b"
    rb = run("adapt", "--resume", a / "checkpoints" / "step-3", "-o", b, "--json")
    assert rb.exit_code == 0, rb.stderr
    tensors_equal(a / "model.safetensors", b / "model.safetensors")
    sa, sb = events(ra.stdout, "summary")[0], events(rb.stdout, "summary")[0]
    assert sb["perplexity_before"] == sa["perplexity_before"]  # measured once, before the run began
    assert sb["perplexity_after"] == sa["perplexity_after"] and sb["steps"] == sa["steps"]
