"""Data-parallel training (`--nproc-per-node`, engine/train/distributed.py) on two CPU ranks
(gloo, both on lavapipe): a 2-rank run at --batch-size B ends where a one-process run at
2B ends (float rounding only), rank 0 alone writes, a failure or Ctrl-C stops every rank,
and without torch the flag is one error line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import SAMPLE_TEXT, make_checkpoint

RTOL, ATOL = 1e-5, 1e-7
TEXT = SAMPLE_TEXT * 3 + "The end of the text." # 45 windows of 16
COMMON = ("--seq-len", "16", "--log-every", "1", "--json", "--lr", "3e-3")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("dp")
    ckpt = make_checkpoint(d / "ckpt", {"hidden_size": 16, "num_hidden_layers": 2}, seed=3)
    txt = d / "text.txt"
    txt.write_text(TEXT, encoding="utf-8")
    return ckpt, txt


def _env() -> dict:
    env = dict(os.environ)
    for k in ("MEMENGINE_DEBUG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def cli(*args, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memengine.cli", *map(str, args)], capture_output=True, text=True,
                          env=_env(), timeout=timeout)


def events(stdout: str, kind: str) -> list[dict]:
    return [e for e in map(json.loads, stdout.splitlines()) if e.get("event") == kind]


def tensors_of(d: Path) -> dict:
    from safetensors.numpy import load_file

    return {f"{p.relative_to(d)}:{k}": v for p in sorted(d.rglob("*.safetensors")) for k, v in load_file(p).items()}


def files_of(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())


def assert_same_run(one: Path, two: Path, r1, r2, rtol=RTOL, atol=ATOL) -> None:
    """The same files, tensors within float rounding, the same step losses and norms."""
    assert files_of(one) == files_of(two)
    a, b = tensors_of(one), tensors_of(two)
    assert sorted(a) == sorted(b) and a
    for k in a:
        assert a[k].shape == b[k].shape, k
        np.testing.assert_allclose(b[k], a[k], rtol=rtol, atol=atol, err_msg=k)
    s1, s2 = events(r1.stdout, "step"), events(r2.stdout, "step")
    assert [e["step"] for e in s1] == [e["step"] for e in s2] and s1
    for x, y in zip(s1, s2):
        assert x["tokens"] == y["tokens"]
        np.testing.assert_allclose([y["loss"], y["grad_norm"]], [x["loss"], x["grad_norm"]], rtol=rtol)
    assert len(events(r2.stdout, "summary")) == 1   # one JSON stream: rank 0's


def _pair(base, tmp_path, extra: tuple, B: int = 1):
    ckpt, txt = base
    one, two = tmp_path / "one", tmp_path / "two"
    r1 = cli("train", ckpt, "--data", txt, "-o", one, "--batch-size", 2 * B, *COMMON, *extra)
    assert r1.returncode == 0, r1.stderr
    r2 = cli("train", ckpt, "--data", txt, "-o", two, "--batch-size", B, "--nproc-per-node", 2, *COMMON, *extra)
    assert r2.returncode == 0, r2.stderr
    return one, two, r1, r2


def test_two_ranks_end_where_one_process_at_twice_the_batch_ends(base, tmp_path):
    one, two, r1, r2 = _pair(base, tmp_path, ("--epochs", "1", "--save-every", "4"))
    st = json.loads((two / "trainer_state.json").read_text())
    # an odd number of windows: the epoch's last step leaves rank 1 a padding batch
    assert st["data"]["windows"] % 2 == 1, st["data"]
    assert_same_run(one, two, r1, r2)
    assert len(list((two / "checkpoints").iterdir())) >= 2
    assert st["world_size"] == 2 and st["options"]["nproc_per_node"] == 2
    assert json.loads((two / "memengine.json").read_text())["world_size"] == 2
    # a resumed run keeps its world size: another is one line
    r = cli("train", "--resume", two, "--epochs", "2")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "2 rank(s)" in lines[0] and "--nproc-per-node 2" in lines[0], r.stderr


def test_two_ranks_with_grad_accum(base, tmp_path):
    one, two, r1, r2 = _pair(base, tmp_path, ("--max-steps", "3", "--grad-accum", "2"))
    assert_same_run(one, two, r1, r2)
    assert events(r2.stdout, "step")[0]["tokens"] == 4 * 16   # 2 ranks x 1 x 2 micro-batches


def test_two_ranks_train_a_lora_adapter(base, tmp_path):
    one, two, r1, r2 = _pair(base, tmp_path, ("--max-steps", "3", "--lora-rank", "4"))
    assert (two / "adapter_model.safetensors").is_file()
    assert_same_run(one, two, r1, r2)


def test_two_ranks_under_mixed_precision(base, tmp_path):
    """Loss scaling decides on the summed gradients: the same skips, scale and weights (an
    absolute 1e-6: batch 2 and two batches of 1 round differently, and AdamW's first steps
    at --lr 3e-3 make that a few 1e-7 in the weights under mixed precision, 1e-8 in fp32)."""
    one, two, r1, r2 = _pair(base, tmp_path, ("--max-steps", "3", "--precision", "mixed"))
    assert_same_run(one, two, r1, r2, atol=1e-6)
    assert [e["skipped_steps"] for e in events(r1.stdout, "step")] == \
        [e["skipped_steps"] for e in events(r2.stdout, "step")]


def test_two_ranks_with_sharded_moments(base, tmp_path):
    """--shard-moments (ZeRO stage 1): the same run, and the checkpoints hold every moment."""
    one, two, r1, r2 = _pair(base, tmp_path, ("--max-steps", "4", "--save-every", "2", "--shard-moments"))
    assert_same_run(one, two, r1, r2)
    # resumed from its first checkpoint (sharded again), it ends at the same place
    again = tmp_path / "again"
    r = cli("train", "--resume", two / "checkpoints" / "step-2", "-o", again, "--nproc-per-node", 2)
    assert r.returncode == 0, r.stderr
    a, b = tensors_of(one), tensors_of(again)
    for k in a:
        if not k.startswith("checkpoints"):
            np.testing.assert_allclose(b[k], a[k], rtol=RTOL, atol=ATOL, err_msg=k)


def test_sharded_moments_live_on_their_rank_only(tiny_ckpt_ro, rt):
    """Each rank makes and steps only the moments of the tensors it owns."""
    from dataclasses import replace

    from memengine.engine.app.options import TrainOptions
    from memengine.engine.io.checkpoint import load_checkpoint
    from memengine.engine.io.data import make_batches
    from memengine.engine.models.lm import LanguageModel
    from memengine.engine.train.trainer import Trainer, shard_owners

    class OneOfTwo:   # rank 1 of 2, alone: the sums are this rank's own values
        rank, world = 1, 2

        def all_reduce(self, a):
            return a

    model = LanguageModel.from_checkpoint(rt, load_checkpoint(tiny_ckpt_ro))
    o = replace(TrainOptions(ckpt="x", data=["x"]), shard_moments=True)
    tr = Trainer(model, o, group=OneOfTwo())
    ids = np.arange(16, dtype=np.int32).reshape(1, 16) % 200
    tr.step(make_batches([(ids[0], ids[0] + 1)], 1, 16), 1e-3)
    mine = {n for n, r in tr.owner.items() if r == 1}
    assert mine and set(tr.opt.moments) == mine and len(mine) < len(tr.names)
    owners = shard_owners({"a": 10, "b": 6, "c": 5, "d": 1}, 2)
    assert owners == {"a": 0, "b": 1, "c": 1, "d": 0}


def test_adapt_on_two_ranks(base, tmp_path):
    ckpt, txt = base
    one, two = tmp_path / "one", tmp_path / "two"
    args = ("--data", txt, "--seq-len", "16", "--max-steps", "3", "--log-every", "1", "--json", "--no-rollback")
    r1 = cli("adapt", ckpt, "-o", one, "--batch-size", 2, *args)
    r2 = cli("adapt", ckpt, "-o", two, "--batch-size", 1, "--nproc-per-node", 2, *args)
    assert r1.returncode == 0 and r2.returncode == 0, r1.stderr + r2.stderr
    assert_same_run(one, two, r1, r2)
    s1, s2 = events(r1.stdout, "summary")[0], events(r2.stdout, "summary")[0]
    assert s1["perplexity_after"] == pytest.approx(s2["perplexity_after"], rel=1e-5)
    # a regression rolls back on every rank: exit 3, nothing written
    out = tmp_path / "rb"
    r = cli("adapt", ckpt, "-o", out, "--batch-size", 1, "--nproc-per-node", 2, "--data", txt, "--seq-len", "16",
            "--max-steps", "2", "--tolerance", "0.5", "--json")
    assert r.returncode == 3, r.stderr
    assert not out.exists()
    assert events(r.stdout, "summary")[0]["rolled_back"] is True


def test_torchrun_runs_the_same_ranks(base, tmp_path):
    """The documented equivalent across hosts: torchrun starting `-m memengine.cli` (here
    on one host), without --nproc-per-node."""
    ckpt, txt = base
    one, two = tmp_path / "one", tmp_path / "two"
    extra = ("--max-steps", "2")
    r1 = cli("train", ckpt, "--data", txt, "-o", one, "--batch-size", 2, *COMMON, *extra)
    assert r1.returncode == 0, r1.stderr
    r2 = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                         "-m", "memengine.cli", "train", str(ckpt), "--data", str(txt), "-o", str(two),
                         "--batch-size", "1", *COMMON, *extra], capture_output=True, text=True, env=_env(),
                        timeout=240)
    assert r2.returncode == 0, r2.stderr
    assert_same_run(one, two, r1, r2)


def test_rank_share_is_the_one_process_step_split():
    """Each rank's micro-batches are its rows of the one-process micro-batches at B x W."""
    from memengine.engine.io.data import make_batches
    from memengine.engine.train.loop import TrainingLoop

    L, B, W, K = 4, 2, 3, 2
    rng = np.random.default_rng(0)
    windows = [(rng.integers(1, 50, L - (i % 2)).astype(np.int32), rng.integers(1, 50, L - (i % 2)).astype(np.int32))
               for i in range(40)]
    idx = np.array([5, 3, 9, 1, 0, 7, 2, 8, 4, 6, 11])    # a short (last) step of 11 windows
    ref = make_batches([windows[i] for i in idx], B * W, L)

    class G:
        world = W

    class O:
        batch_size, seq_len, grad_accum = B, L, K

    for r in range(W):
        loop = TrainingLoop.__new__(TrainingLoop)
        g = G()
        g.rank = r
        loop.group, loop.o, loop.windows = g, O(), windows
        micro, n_total, tokens = loop._rank_share(idx)
        assert len(micro) == len(ref)
        assert n_total == sum(b.n_targets for b in ref) and tokens == sum(b.n_tokens for b in ref)
        for mine, whole in zip(micro, ref):
            np.testing.assert_array_equal(mine.ids, whole.ids[r * B:(r + 1) * B])
            np.testing.assert_array_equal(mine.targets, whole.targets[r * B:(r + 1) * B])
            assert mine.n_targets == int(np.sum(whole.targets[r * B:(r + 1) * B] >= 0))


# ----------------------------------------------------------------------------- failures
def _children(pid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(p.name))
    return out


def _ranks(pid: int, deadline: float) -> dict[int, int]:
    """{rank: pid} of the launcher's workers, once both are up."""
    while time.time() < deadline:
        found = {}
        for c in _children(pid):
            try:
                env = (Path("/proc") / str(c) / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for kv in env:
                if kv.startswith(b"RANK="):
                    found[int(kv[5:])] = c
        if len(found) == 2:
            return found
        time.sleep(0.2)
    raise AssertionError("the two ranks did not start")


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_for(cond, deadline: float, what: str) -> None:
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _launch(args, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "memengine.cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), **kw)


def test_a_killed_rank_stops_the_run_and_it_resumes(base, tmp_path):
    ckpt, txt = base
    out = tmp_path / "out"
    steps = 40
    args = ("--data", txt, *COMMON, "--max-steps", steps)
    p = _launch(["train", ckpt, "-o", out, "--batch-size", 1, "--nproc-per-node", 2, "--save-every", 2, *args])
    try:
        deadline = time.time() + 120
        ranks = _ranks(p.pid, deadline)
        _wait_for(lambda: (out / "checkpoints" / "step-4").is_dir(), deadline, "a checkpoint")
        os.kill(ranks[0], signal.SIGKILL)       # the rank that writes
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 137, err
    assert "rank 0 was killed by SIGKILL" in err
    _wait_for(lambda: not _alive(ranks[1]), time.time() + 10, "rank 1 to stop")
    done = sorted(int(d.name.split("-")[1]) for d in (out / "checkpoints").iterdir() if d.name.startswith("step-"))
    assert done and done[-1] < steps
    for d in (out / "checkpoints").iterdir():
        if d.name.startswith("step-"):
            assert (d / "trainer_state.json").is_file() and (d / "optimizer.safetensors").is_file()
    # continued on two ranks, it ends where the uninterrupted one-process run at batch 2 ends
    r = cli("train", "--resume", out, "--nproc-per-node", 2)
    assert r.returncode == 0, r.stderr
    ref = tmp_path / "ref"
    r1 = cli("train", ckpt, "-o", ref, "--batch-size", 2, *args)
    assert r1.returncode == 0, r1.stderr
    a, b = tensors_of(ref), tensors_of(out)
    for k in a:
        if k.startswith("model.safetensors"):
            np.testing.assert_allclose(b[k], a[k], rtol=1e-4, atol=1e-6, err_msg=k)
    assert json.loads((out / "trainer_state.json").read_text())["step"] == steps


def test_ctrl_c_stops_every_rank(base, tmp_path):
    ckpt, txt = base
    out = tmp_path / "out"
    p = _launch(["train", ckpt, "-o", out, "--nproc-per-node", 2, "--data", txt, "--batch-size", 1, *COMMON,
                 "--max-steps", 100000], start_new_session=True)
    try:
        deadline = time.time() + 120
        ranks = _ranks(p.pid, deadline)
        line = p.stdout.readline()           # the first step event: both ranks are training
        assert '"step"' in line, line
        os.killpg(p.pid, signal.SIGINT)       # Ctrl-C: the whole process group
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130, err
    assert "Traceback" not in err
    for pid in ranks.values():
        _wait_for(lambda pid=pid: not _alive(pid), time.time() + 10, f"rank pid {pid} to stop")
    assert not out.exists()
    assert not [q for q in tmp_path.iterdir() if q.name.startswith(".")]


def test_without_torch_more_than_one_rank_is_one_error_line(base, tmp_path):
    ckpt, txt = base
    code = ("import sys; sys.modules['torch'] = None; from memengine.cli import main; "
            f"sys.argv = ['memengine', 'train', {str(ckpt)!r}, '--data', {str(txt)!r}, '-o', "
            f"{str(tmp_path / 'o')!r}, '--nproc-per-node', '2']; main()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "memengine[distributed]" in lines[0], r.stderr
    assert not (tmp_path / "o").exists()
