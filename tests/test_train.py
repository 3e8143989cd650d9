"""The training loop end to end: convergence, exact resume, WSLA, and a step against torch."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
from memengine.engine.app.options import AdaptOptions, TrainOptions
from memengine.engine.errors import NonFiniteError
from memengine.engine.io.data import make_batches, make_windows
from memengine.engine.models.mamba1.config import MambaConfig
from memengine.engine.models.mamba1.init import init_weights
from memengine.engine.models.lm import LanguageModel
from memengine.engine.train.loop import LoopState, fit
from memengine.engine.train.trainer import evaluate

TEXT = b"the quick brown fox jumps over the lazy dog; a stitch in time saves nine. " * 3
CFG = MambaConfig(vocab_size=256, hidden_size=24, state_size=4, num_hidden_layers=1, expand=2, conv_kernel=4)



def windows(seq_len=32):
    ids = np.frombuffer(TEXT, np.uint8).astype(np.int32)
    return make_windows(ids, seq_len)


def batches(seq_len=32, batch_size=2):
    return make_batches(windows(seq_len), batch_size, seq_len)


def epochs_of(loop):
    return [e for e in loop.state.history if e["event"] == "epoch"]


def test_training_halves_the_loss(rt):
    model = LanguageModel(rt, CFG, init_weights(CFG, 0))
    hist = epochs_of(fit(model, windows(), TrainOptions(epochs=25, lr=3e-3, batch_size=2, seq_len=32)))
    losses = [h["loss"] for h in hist]
    print(f"\nloss: first {losses[0]:.4f} last {losses[-1]:.4f}; grad norm first {hist[0]['grad_norm']:.4f}")
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0]
    assert hist[0]["grad_norm"] > 0 and hist[0]["tokens"] > 0


def test_resume_continues_exactly(rt):
    """In memory: weights, optimizer state and loop state carry a run on bit for bit
    (shuffled windows, a warmup, and a stop in the middle of an epoch; the schedule is
    constant after the warmup because --max-steps would move a decaying one; the file
    checkpoints' test in test_long_runs.py resumes a cosine schedule)."""
    opts = dict(lr=2e-3, batch_size=2, seq_len=32, lr_schedule="constant", warmup_steps=2, log_every=1)
    ws = windows()
    straight = LanguageModel(rt, CFG, init_weights(CFG, 1))
    full = fit(straight, ws, TrainOptions(epochs=3, **opts))
    spe = full.steps_per_epoch
    stop = spe + 1  # inside the second epoch
    assert spe >= 2
    steps = [e for e in full.state.history if e["event"] == "step"]
    for ep in epochs_of(full):  # an epoch's loss and norm are the means of its steps'
        mine = [e for e in steps if e["epoch"] == ep["epoch"]]
        assert len(mine) == spe and ep["tokens"] == sum(e["tokens"] for e in mine)
        assert abs(ep["loss"] - np.mean([e["loss"] for e in mine])) < 1e-12
        assert abs(ep["grad_norm"] - np.mean([e["grad_norm"] for e in mine])) < 1e-12

    first = LanguageModel(rt, CFG, init_weights(CFG, 1))
    part = fit(first, ws, TrainOptions(epochs=3, max_steps=stop, **opts))
    weights, opt_state = first.state_dict(), part.trainer.optimizer_state()
    state = LoopState.from_dict(part.state_dict())
    assert int(np.asarray(opt_state["__step__"]).reshape(-1)[0]) == stop

    resumed = LanguageModel(rt, CFG, weights)
    rest = fit(resumed, ws, TrainOptions(epochs=3, **opts), optimizer_state=opt_state, state=state)
    want = [(e["step"], e["loss"], e["lr"]) for e in full.state.history if e["event"] == "step"]
    got = [(e["step"], e["loss"], e["lr"]) for e in rest.state.history if e["event"] == "step"]
    assert got == want  # the history continues exactly (steps, losses, lrs)
    a, b = straight.state_dict(), resumed.state_dict()
    for k in a:
        assert a[k].tobytes() == b[k].tobytes(), k

    # without the optimizer and loop state the continuation differs (the test can fail)
    fresh = LanguageModel(rt, CFG, weights)
    fit(fresh, ws, TrainOptions(epochs=3, max_steps=3 * spe - stop, **opts))
    assert any(fresh.state_dict()[k].tobytes() != a[k].tobytes() for k in a)


def test_wsla_trains_only_x_proj(rt):
    w0 = init_weights(CFG, 2)
    model = LanguageModel(rt, CFG, w0)
    fit(model, windows(), AdaptOptions(epochs=2, lr=1e-3, batch_size=2, seq_len=32, max_delta=0.05,
                                       weight_decay=0.0))
    # the gradient store holds x_proj's gradients only, not a second copy of every weight
    assert sorted(model._G.views) == sorted(n for n in w0 if ".mixer.x_proj." in n)
    assert sum(t.nbytes for t in model._G.segments) < sum(t.nbytes for t in model.P.segments) / 4
    w1 = model.state_dict()
    for name in w0:
        if ".mixer.x_proj." in name:
            assert not np.array_equal(w0[name], w1[name]), name
            steps = 2 * len(batches())
            assert np.abs(w1[name] - w0[name]).max() <= 0.05 * steps + 1e-6
        else:
            assert np.array_equal(w0[name].astype(np.float32), w1[name]), name


def test_trust_region_bounds_every_step(rt):
    w0 = init_weights(CFG, 3)
    model = LanguageModel(rt, CFG, w0)
    before = model.state_dict()
    fit(model, windows(), TrainOptions(max_steps=1, lr=10.0, batch_size=2, seq_len=32, max_delta=1e-3,
                                       weight_decay=0.0, max_grad_norm=0.0))
    after = model.state_dict()
    worst = max(float(np.abs(after[k] - before[k]).max()) for k in before)
    print(f"\nlargest |delta| after one step with lr=10, max_delta=1e-3: {worst:.3e}")
    for k in before:
        # |p_new - p_old| <= max_delta, up to the rounding of p_new to f32
        slack = np.spacing(np.abs(after[k]).astype(np.float32))
        assert (np.abs(after[k] - before[k]) <= 1e-3 + slack).all(), k
    assert worst > 0.5e-3


def test_nonfinite_loss_stops_and_never_writes_nan(rt):
    w = init_weights(CFG, 4)
    w["backbone.norm_f.weight"] = np.full_like(w["backbone.norm_f.weight"], 3e38)  # logits overflow
    model = LanguageModel(rt, CFG, w)
    with pytest.raises(NonFiniteError, match="step 1 "):
        fit(model, windows(), TrainOptions(epochs=3, lr=1e-3, batch_size=2, seq_len=32, log_every=4))
    for k, v in model.state_dict().items():
        assert np.isfinite(v).all(), k


def test_eval_matches_mean_of_step_losses(rt):
    model = LanguageModel(rt, CFG, init_weights(CFG, 5))
    bs = batches(seq_len=16, batch_size=3)
    res = evaluate(model, bs)
    total, n = 0.0, 0
    for b in bs:
        lg = model.logits(b.ids).astype(np.float64)
        lg -= lg.max(-1, keepdims=True)
        logp = lg - np.log(np.exp(lg).sum(-1, keepdims=True))
        mask = b.targets >= 0
        total += -logp[mask, b.targets[mask]].sum()
        n += int(mask.sum())
    assert res.tokens == n
    assert abs(res.loss - total / n) < 1e-4 * total / n
    assert abs(res.perplexity - np.exp(total / n)) < 1e-3 * np.exp(total / n)


def test_steps_match_torch_adamw_with_clipping(rt):
    """Two full training steps (clip + AdamW + weight decay) against transformers + torch."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=1, expand=2, conv_kernel=4,
                      use_bias=True, tie_word_embeddings=False)
    w = init_weights(cfg, 6)
    hf = transformers.MambaForCausalLM(transformers.MambaConfig(**cfg.to_hf_dict())).double()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            p.copy_(torch.tensor(w[n], dtype=torch.float64))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 64, size=(2, 12)).astype(np.int32)
    tg = rng.integers(0, 64, size=(2, 12)).astype(np.int32)
    two_windows = [(ids[0], tg[0]), (ids[1], tg[1])]

    opt = torch.optim.AdamW(hf.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    norms = []
    for _ in range(2):
        opt.zero_grad()
        logits = hf(input_ids=torch.tensor(ids, dtype=torch.long)).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), torch.tensor(tg, dtype=torch.long).reshape(-1))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(hf.parameters(), 0.5)))
        opt.step()

    model = LanguageModel(rt, cfg, w)
    hist = epochs_of(fit(model, two_windows, TrainOptions(epochs=2, lr=1e-2, batch_size=2, seq_len=12,
                                                          max_grad_norm=0.5, shuffle=False)))
    assert norms[0] > 0.5  # clipping really happened
    ours_norms = [h["grad_norm"] for h in hist]
    print(f"\ngrad norms: ours {ours_norms} torch {norms}")
    np.testing.assert_allclose(ours_norms, norms, rtol=1e-4)
    ours = model.state_dict()
    worst = 0.0
    for n, p in hf.named_parameters():
        ref = p.detach().numpy()
        err = float(np.abs(ours[n] - ref).max() / max(np.abs(ref).max(), 1e-30))
        worst = max(worst, err)
        assert err < 1e-4, n
    print(f"weights after 2 steps: largest rel err {worst:.2e}")


@pytest.mark.parametrize("copies", ["buffer", "dispatch"])
def test_steps_and_evaluations_create_nothing_per_call(rt, monkeypatch, copies):
    """After the first step and the first evaluation, more steps (with a changing lr and a
    trace read every few steps) and a longer evaluation create no buffer, bind group or
    uniform block, with copies recorded either way (gpu.Recorder.copy)."""
    from memengine.engine.train.trainer import Trainer

    monkeypatch.setattr(rt, "copy_by_dispatch", copies == "dispatch")
    model = LanguageModel(rt, CFG, init_weights(CFG, 8))
    o = TrainOptions(batch_size=2, seq_len=32, grad_accum=2)
    tr = Trainer(model, o, trace_capacity=4)
    bs = batches()
    created = []
    real = rt.device.create_buffer
    rt.device.create_buffer = lambda *a, **k: created.append(k.get("size")) or real(*a, **k)
    try:
        tr.step(bs[:2], 1e-3)
        tr.read_trace()
        evaluate(model, bs[:2], fence=tr.fence)
        seen = (len(created), len(rt._bind_groups), len(rt._uniforms))
        for k in range(8):
            tr.step(bs[2 * (k % 2):2 * (k % 2) + 2], 1e-3 * (k + 1))
            if k % 4 == 3:
                tr.read_trace()
        r = evaluate(model, bs, fence=tr.fence)
        # the longer evaluation needs its one per-batch sums buffer, nothing else
        assert len(created) - seen[0] <= 1, created[seen[0]:]
        assert (len(rt._bind_groups), len(rt._uniforms)) == seen[1:]
    finally:
        rt.device.create_buffer = real
    assert np.isfinite(r.loss)


def test_slow_steps_go_in_pieces_with_a_tenth_of_a_second_queued(rt, monkeypatch):
    """While steps are slow the trainer submits them in pieces of about 40 ms of work (whole
    layers) and keeps as many pieces queued as hold about 0.1 s of work (2 to 8); the
    weights are the same bits as with whole steps."""
    from types import SimpleNamespace

    from memengine.engine import runtime as gpu
    from memengine.engine.train import trainer as trmod

    assert gpu.piece_depth(0.44, 50) == 8    # 9 ms pieces (mamba-130m B 8 on the H200): the most
    assert gpu.piece_depth(1.5, 50) == 3     # 30 ms pieces
    assert gpu.piece_depth(20.0, 50) == 2    # 0.4 s pieces: the fewest
    assert gpu.piece_span(0.405, 61) == 4    # mamba-130m B 8: 6.6 ms a layer's forward or backward
    assert gpu.piece_span(2.0, 61) == 1      # 33 ms a boundary: a piece each

    cfg = MambaConfig(vocab_size=256, hidden_size=24, state_size=4, num_hidden_layers=9, expand=2, conv_kernel=4)
    o = TrainOptions(batch_size=2, seq_len=32)
    bs = batches()
    clock = [0.0]
    monkeypatch.setattr(trmod, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    saved = (rt.bounded, rt.piece_depth, rt.piece_span)
    weights = []
    try:
        for step_s, bounded in ((0.1, False), (0.26, True)):
            model = LanguageModel(rt, cfg, init_weights(cfg, 3))
            tr = trmod.Trainer(model, o, trace_capacity=4)
            rt.bounded, rt.piece_depth, rt.piece_span = bounded, 2, 1
            before, fence = rt.pieces, rt.piece_fence()
            per_step = []
            for k in range(3):
                clock[0] += step_s
                b0 = rt.boundaries
                tr.step(bs[k:k + 1], 1e-3)
                per_step.append(rt.boundaries - b0)
            tr.read_trace()
            pieces = rt.pieces - before
            if bounded:   # 0.26 s a step over 19 boundaries (9 layers forward and back, the head): 14 ms each
                n = per_step[0]
                assert n >= 2 * cfg.num_hidden_layers and per_step == [n] * 3
                assert rt.bounded and rt.piece_span == gpu.piece_span(step_s, n) == 2
                # a piece per layer until the second step had timed the first, then two layers
                assert pieces == 2 * n + n // 2
                assert rt.piece_depth == gpu.piece_depth(step_s, -(-n // 2) + 1) > 2
                # the depth changed on the same fence: no new buffers
                assert rt.piece_fence() is fence and len(fence.bufs) == gpu.MAX_PIECES
            else:
                assert pieces == 0 and not rt.bounded
            weights.append(model.state_dict())
    finally:
        rt.bounded, rt.piece_depth, rt.piece_span = saved
    for n in weights[0]:
        np.testing.assert_array_equal(weights[0][n], weights[1][n], err_msg=n)


def test_gradient_store_grows_from_x_proj_to_every_tensor(rt):
    """A step over x_proj makes a store of x_proj's gradients; a later step over every
    tensor makes it again over all, and x_proj's gradients are the same bits."""
    model = LanguageModel(rt, CFG, init_weights(CFG, 4))
    ids = np.frombuffer(TEXT[:66], np.uint8).astype(np.int32).reshape(2, 33)
    xp = [n for n in model.names if ".mixer.x_proj." in n]
    model.loss_and_grads(ids[:, :-1], ids[:, 1:], trainable=xp)
    first = model.grad_dict()
    assert sorted(first) == sorted(xp)
    model.loss_and_grads(ids[:, :-1], ids[:, 1:])
    every = model.grad_dict()
    assert sorted(every) == sorted(model.names)
    for n in xp:
        np.testing.assert_array_equal(first[n], every[n], err_msg=n)
    assert any(np.abs(every[n]).max() > 0 for n in model.names if n not in xp)


def test_a_device_with_webgpus_eight_storage_buffers_trains(rt, monkeypatch):
    """WebGPU guarantees 8 storage buffers an entry point and the 8-lane scan backward binds
    9: a device made with 8 takes the other kernels (wgpu refuses a pipeline that binds more
    than its device allows, so every kernel of the steps is checked) and trains as the
    default device does."""
    from memengine.engine import runtime as gpu
    from memengine.engine.kernels.lanes import cpu_lanes
    from memengine.engine.runtime import runtime as runtime_module

    monkeypatch.setattr(runtime_module, "STORAGE_BUFFERS", 8)
    rt8 = gpu.Runtime("auto")
    assert rt8.limits["max-storage-buffers-per-shader-stage"] == 8
    assert not cpu_lanes(rt8)
    cfg = MambaConfig(vocab_size=256, hidden_size=64, state_size=16, num_hidden_layers=2)
    o = TrainOptions(max_steps=3, lr=1e-3, batch_size=2, seq_len=32, log_every=1)
    losses = []
    for r in (rt8, rt):
        loop = fit(LanguageModel(r, cfg, init_weights(cfg, 0)), windows(), o)
        losses.append([e["loss"] for e in loop.state.history if e["event"] == "step"])
    print(f"\n8 storage buffers: {losses[0]}\ndefault ({cpu_lanes(rt)=}): {losses[1]}")
    assert len(losses[0]) == 3
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)


def test_eval_reads_its_sums_back_in_pieces_whatever_the_number_of_windows(rt, monkeypatch):
    """The per-window sums are read back every EVAL_READ_WINDOWS windows (a GPU buffer of that
    many, not one of every window: 12 bytes a window on GPU and host before, 1.2 GB for a
    3 GiB corpus at --seq-len 32), added in blocks counted from the first window: the result
    does not depend on the batch size, and equals the one-read sum within float64 rounding."""
    from memengine.engine.train import trainer

    model = LanguageModel(rt, CFG, init_weights(CFG, 5))
    whole = evaluate(model, batches(seq_len=8, batch_size=1))
    monkeypatch.setattr(trainer, "EVAL_READ_WINDOWS", 4)
    sizes = []
    real = rt.scratch

    def scratch(key, shape, *a, **k):
        if key[0] == "eval.sums":
            sizes.append(int(np.prod(shape)))
        return real(key, shape, *a, **k)

    monkeypatch.setattr(rt, "scratch", scratch)
    got = {b: evaluate(model, batches(seq_len=8, batch_size=b)) for b in (1, 2, 3)}
    assert len(batches(seq_len=8, batch_size=1)) > 12   # several read-backs
    assert max(sizes) <= 3 * 4 and got[1].tokens == whole.tokens
    for r in got.values():
        assert (r.loss, r.top1_accuracy, r.top5_accuracy) == (got[1].loss, got[1].top1_accuracy, got[1].top5_accuracy)
    assert abs(got[1].loss - whole.loss) < 1e-12 * whole.loss and got[1].top5_accuracy == whole.top5_accuracy
