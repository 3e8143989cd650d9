"""Periodic checkpoints of a run and what --resume reads back.

    OUT/checkpoints/step-K/   model.safetensors, config.json (+ tokenizer.json)  <- transformers loads it
                              optimizer.safetensors                             <- AdamW moments by name
                              trainer_state.json                                <- step, data position, RNG,
                                                                                   schedule, sums, history
    OUT/                      the same files for the run's result (+ memengine.json)

A step directory is written whole into a hidden temporary directory and renamed into
place (engine/staging.py), so a listing never shows a partial one.  `--resume DIR` takes a
step directory, or an OUT: the highest step among OUT/checkpoints/step-*/ and OUT itself.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from memengine.engine.errors import MemengineError
from memengine.engine.hostmem import check_fits
from memengine.engine.io.inputs import check_regular, read_json
from memengine.engine.io.staging import remove_dir, write_json
from memengine.engine.train import state_schema

STATE_FILE = "trainer_state.json"
CHECKPOINTS_DIR = "checkpoints"
STATE_FORMAT = state_schema.STATE_FORMAT
# trainer_state.json holds every event of the run: larger than a config, still bounded
MAX_STATE_BYTES = 2**30
JSON_EXPANSION = 10  # host bytes per byte of JSON once parsed into Python objects (generous)
# options whose paths a trainer state holds relative to the run directory (OUT)
RUN_RELATIVE = ("data", "val_data")
_STEP = re.compile(r"^step-(\d+)$")


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR / f"step-{int(step)}"


def list_steps(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, directory) of the complete checkpoints under run_dir, oldest first."""
    d = Path(run_dir) / CHECKPOINTS_DIR
    if not d.is_dir():
        return []
    out = []
    for p in d.iterdir():
        m = _STEP.match(p.name)
        if m and p.is_dir() and (p / STATE_FILE).is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def read_state(directory: Path) -> dict:
    p = Path(directory) / STATE_FILE
    if not os.path.lexists(p):
        raise MemengineError(f"--resume {directory}: no {STATE_FILE} (not a memengine checkpoint)")
    size = check_regular(p, "--resume: trainer state").st_size  # a FIFO or device is refused, not read
    check_fits(JSON_EXPANSION * size, f"--resume: trainer state '{p}' ({size:,} bytes)",
               "is it the right file?")
    try:
        st = read_json(p, "--resume: trainer state", max_bytes=MAX_STATE_BYTES)
    except MemengineError as e:
        raise MemengineError(f"--resume {e}" if str(e).startswith(str(p)) else str(e)) from None
    return state_schema.validate(st, f"--resume {p}")


def write_state(directory: Path, state: dict) -> None:
    """trainer_state.json into `directory`, with its checksum (engine/train/state_schema.py)."""
    write_json(Path(directory) / STATE_FILE, state_schema.with_checksum(state))


@dataclass
class Snapshot:
    """A checkpoint to resume from."""

    dir: Path            # holds the model, optimizer state and trainer state
    step: int
    state: dict          # trainer_state.json
    run_dir: Path        # the OUT it belongs to

    @property
    def kind(self) -> str:
        return str(self.state.get("kind", "train"))


def run_dir_of(path) -> Optional[Path]:
    """The OUT a --resume path belongs to: the path, or the run of a step directory."""
    p = Path(path)
    if not p.is_dir():
        return None
    if _STEP.match(p.name) and p.parent.name == CHECKPOINTS_DIR:
        return p.parent.parent
    return p


def locate(path: Path) -> Snapshot:
    """The checkpoint --resume DIR means: DIR itself when it is a step directory, else the
    highest step among DIR/checkpoints/step-*/ and DIR (a finished OUT)."""
    p = Path(path)
    if not p.is_dir():
        raise MemengineError(f"--resume {p}: no such directory")
    if _STEP.match(p.name) and p.parent.name == CHECKPOINTS_DIR:
        st = read_state(p)
        return Snapshot(p, int(st["step"]), st, p.parent.parent)
    cands = [(s, 1, d) for s, d in list_steps(p)]
    if (p / STATE_FILE).is_file():
        st = read_state(p)
        cands.append((int(st["step"]), 0, p))
    if not cands:
        raise MemengineError(f"--resume {p}: no checkpoint there (no {CHECKPOINTS_DIR}/step-K/ and no {STATE_FILE})")
    step, _, d = max(cands)
    st = read_state(d)
    return Snapshot(d, step, st, p)


def resumable(run_dir: Path) -> bool:
    """True when `run_dir` holds a run --resume can continue (a step checkpoint or a
    finished OUT's trainer state)."""
    p = Path(run_dir)
    return p.is_dir() and ((p / STATE_FILE).is_file() or bool(list_steps(p)))


def relative_to_run(path: str, run_dir: Path) -> str:
    """A data path as a trainer state holds it: relative to the run directory (no absolute
    local path in an output, and --resume finds it from any working directory)."""
    if str(path) == "-":
        return "-"
    return os.path.relpath(Path(path).resolve(), Path(run_dir).resolve())


def recorded_options(path: Path, kind: str) -> tuple[dict, bool, str]:
    """The options of the run --resume continues (after checking it is the same kind), whether
    its state is of a version that records all of them, and where they come from."""
    snap = locate(path)
    if snap.kind != kind:
        raise MemengineError(f"--resume {path}: that run was '{snap.kind}'; continue it with "
                             f"memengine {snap.kind} --resume {path}")
    opts = snap.state.get("options")
    opts = dict(opts) if isinstance(opts, dict) else {}
    where = f"--resume {snap.dir / STATE_FILE}"
    for key in RUN_RELATIVE:
        v = opts.get(key)
        if v is not None and not (isinstance(v, list) and all(isinstance(x, str) and x and "\x00" not in x for x in v)):
            raise MemengineError(f"{where}: the run's option '{key}' is {v!r}, not a list of paths; the state is not "
                                 "one memengine wrote")
        if isinstance(opts.get(key), list):
            if "-" in opts[key]:
                raise MemengineError(f"--resume {path}: the run read stdin; give --{key.replace('_', '-')} again")
            opts[key] = [os.path.normpath(os.path.join(os.path.abspath(snap.run_dir), d)) for d in opts[key]]
    return opts, int(snap.state.get("version", 1)) >= 2, where


def later_steps(run_dir: Path, step: int) -> list[Path]:
    return [d for s, d in list_steps(run_dir) if s > step]


def prune(run_dir: Path, keep_last: int, keep: Optional[int] = None) -> list[Path]:
    """Remove all but the newest `keep_last` checkpoints (and step `keep`, the best)."""
    if keep_last <= 0:
        return []
    steps = list_steps(run_dir)
    newest = {s for s, _ in steps[-keep_last:]}
    gone = []
    for s, d in steps:
        if s not in newest and s != keep:
            remove_dir(d)
            gone.append(d)
    return gone
