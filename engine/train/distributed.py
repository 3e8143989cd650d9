"""Data-parallel training over torch.distributed (gloo): the ranks, the all-reduce of host
arrays, and the launcher of `--nproc-per-node N`.

The only module that imports torch, and only when a run has more than one rank (torch is
the optional `memengine[distributed]` extra).  A rank is a process that torch's launcher
started: its environment holds RANK, WORLD_SIZE and LOCAL_RANK (`torchrun` sets the same,
so `torchrun --nnodes ... -m memengine.cli train ...` runs this code across hosts).

What a step does on N ranks (engine/train/trainer.py, loop.py): each rank takes its share
of the windows a one-process run with the global batch (--batch-size x N) would take, in
the same order, divides its loss by the step's global target count, records the whole
backward, and then sums the gradients (each gradient-store segment read back to the host,
all-reduced, written back) and the step's loss; every rank then clips and steps AdamW on
the same sums, so the weights stay identical.  Rank 0 alone writes outputs and reports.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
import uuid
from typing import Optional

import numpy as np
from memengine.engine import interrupts
from memengine.engine.errors import MemengineError

INSTALL_HINT = ("--nproc-per-node > 1 needs torch (torch.distributed): pip install 'memengine[distributed]' "
                "(torch==2.13.0; the CPU build is enough)")


def env_seconds(name: str, default: float) -> float:
    """A number of seconds from the environment; anything else is one error line."""
    text = os.environ.get(name, "").strip()
    if not text:
        return float(default)
    try:
        v = float(text)
        assert math.isfinite(v) and v > 0
    except (ValueError, AssertionError):
        raise MemengineError(f"{name}={text!r}: expected a positive number of seconds") from None
    return v


# seconds a collective waits for the other ranks before it fails (a rank that hangs):
# MEMENGINE_DIST_TIMEOUT, read when the group is made
TIMEOUT_S = 600.0


class PeerLost(MemengineError):
    """Another rank stopped (failed, was killed or interrupted) while this one waited on it."""
    exit_code = 1


def env_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the launcher's environment; (0, 1, 0) outside one."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError:
        return 0, 1, 0
    if world <= 1:
        return 0, 1, 0
    return rank, world, local


def is_rank() -> bool:
    """This process is one rank of a multi-rank run (started by the launcher or torchrun)."""
    return env_world()[1] > 1


def _torch_dist():
    try:
        import torch  # noqa: F401
        import torch.distributed as dist
    except ImportError:
        raise MemengineError(INSTALL_HINT) from None
    if not dist.is_available():
        raise MemengineError(INSTALL_HINT)
    return dist


def check_available() -> None:
    """One MemengineError line when torch.distributed cannot be imported."""
    _torch_dist()


class Group:
    """This rank in the process group (gloo): rank, world, local_rank, and collectives on host
    arrays.  A collective that fails because another rank went away raises PeerLost, or the
    KeyboardInterrupt of a signal this rank got meanwhile."""

    def __init__(self):
        self.rank, self.world, self.local_rank = env_world()
        self.dist = _torch_dist()
        if not self.dist.is_initialized():
            self.dist.init_process_group("gloo", timeout=datetime.timedelta(
                seconds=env_seconds("MEMENGINE_DIST_TIMEOUT", TIMEOUT_S)))

    def _collective(self, fn):
        try:
            return fn()
        except Exception as e:   # gloo: "Connection closed by peer", a timeout, ...
            interrupts.check()   # a Ctrl-C / SIGTERM that reached this rank too
            text = " ".join(str(e).split())[:200]
            raise PeerLost(f"rank {self.rank}: another rank of the run stopped ({text})") from None

    def all_reduce(self, a: np.ndarray, op: str = "sum") -> np.ndarray:
        """Sum `a` (a contiguous float32/float64 host array; with op "max": its maximum, any
        number type) over the ranks, in place."""
        import torch

        t = torch.from_numpy(a)
        red = self.dist.ReduceOp.MAX if op == "max" else self.dist.ReduceOp.SUM
        self._collective(lambda: self.dist.all_reduce(t, op=red))
        return a

    def broadcast(self, obj, src: int = 0):
        """Rank `src`'s `obj` (picklable) on every rank."""
        box = [obj]
        self._collective(lambda: self.dist.broadcast_object_list(box, src=src))
        return box[0]

    def barrier(self) -> None:
        self._collective(lambda: self.dist.barrier())

    def finish(self) -> None:
        """The end of a run: wait for every rank (rank 0's outputs are written when any rank
        returns), then leave the group."""
        self.barrier()
        self.close()

    def close(self) -> None:
        try:
            if self.dist.is_initialized():
                self.dist.destroy_process_group()
        except Exception:
            pass


_GROUP: dict = {"group": None}


def current() -> Optional[Group]:
    """The process group of this rank (made on first use), or None in a one-process run."""
    if not is_rank():
        return None
    if _GROUP["group"] is None:
        import atexit

        _GROUP["group"] = Group()
        # gloo's threads must be joined before the interpreter ends (else std::terminate)
        atexit.register(_GROUP["group"].close)
    return _GROUP["group"]


def device_request(device: Optional[str], group: Optional[Group]) -> Optional[str]:
    """--device when given; else each rank's adapter by its local rank (`auto:K`: the K-th
    hardware GPU, or the software adapter on a machine without one)."""
    if device or group is None:
        return device
    return f"auto:{group.local_rank}"


# ----------------------------------------------------------------------------- launcher
def launch(nproc: int, argv: list) -> tuple[int, Optional[str]]:
    """Start `nproc` ranks of `python -m memengine.cli *argv` on this host through torch's
    elastic agent (as torchrun --standalone does); returns the exit status of the run: 0,
    the status of the first rank that failed (128 + N for one killed by signal N), or
    128 + the signal that stopped the launcher (Ctrl-C: 130); and a line to report when no
    rank could say it (a rank killed by a signal)."""
    _torch_dist()
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # the agent logs each failure on its own; the exit status and our one line say it
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=int(nproc), run_id=f"memengine-{uuid.uuid4().hex}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                          shutdown_timeout=max(1, round(env_seconds("MEMENGINE_DIST_SHUTDOWN_S", 20))))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        elastic_launch(config, sys.executable)("-m", "memengine.cli", *argv)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = int(failure.exitcode)
        if code < 0:
            import signal

            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return 128 - code, f"rank {rank} was killed by {name}; the other ranks were stopped"
        return code or 1, None
    except SignalException as e:
        return 128 + int(e.sigval), None
    except KeyboardInterrupt:
        return interrupts.signal_exit_code(), None
    return 0, None
