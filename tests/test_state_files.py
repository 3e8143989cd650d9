"""trainer_state.json and optimizer.safetensors of a checkpoint, mutated field by field and
tensor by tensor (type, absence, range): --resume gives exit status 2 (one line) or a run
bit-identical to the one never stopped, never an internal error (exit 1)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import SAMPLE_TEXT
from memengine.engine.train import state_schema
from safetensors.numpy import load_file, save_file
from test_cli import assert_one_line_error, run

FAST = ("--seq-len", "32", "--batch-size", "2")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, _tiny_master):
    """A run stopped at step 4 (its checkpoints at 2 and 4) and the same run never stopped,
    to step 6."""
    root = tmp_path_factory.mktemp("statefiles")
    text = root / "text.txt"
    text.write_text(SAMPLE_TEXT * 2)
    r = run("train", _tiny_master, "--data", text, "-o", root / "run", *FAST, "--max-steps", "4", "--save-every", "2")
    assert r.exit_code == 0, r.stderr
    r = run("train", _tiny_master, "--data", text, "-o", root / "ref", *FAST, "--max-steps", "6")
    assert r.exit_code == 0, r.stderr
    return root


def _resume(root: Path, name: str, edit_state=None, edit_opt=None, reseal: bool = True):
    """Copy step-4 of the stopped run to root/name (a sibling, so the data path holds), edit
    its files, resume it to step 6 elsewhere: (the result, OUT)."""
    case = root / name
    shutil.rmtree(case, ignore_errors=True)
    step = case / "checkpoints" / "step-4"
    shutil.copytree(root / "run" / "checkpoints" / "step-4", step)
    if edit_state is not None:
        p = step / "trainer_state.json"
        st = json.loads(p.read_text())
        st = edit_state(st)
        if reseal and isinstance(st, dict):
            st = state_schema.with_checksum(st)
        p.write_text(json.dumps(st))
    if edit_opt is not None:
        p = step / "optimizer.safetensors"
        save_file(edit_opt(load_file(str(p))), str(p), metadata={"format": "memengine-adamw"})
    out = root / f"{name}-out"
    shutil.rmtree(out, ignore_errors=True)
    r = run("train", "--resume", step, "-o", out, "--max-steps", "6")
    return r, out


def _identical(out: Path, ref: Path) -> bool:
    if not (out / "model.safetensors").is_file() or not (out / "optimizer.safetensors").is_file():
        return False
    a, b = load_file(str(out / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    oa, ob = load_file(str(out / "optimizer.safetensors")), load_file(str(ref / "optimizer.safetensors"))
    return (a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
            and oa.keys() == ob.keys() and all(np.array_equal(oa[k], ob[k]) for k in oa))


def _paths(obj, prefix=()):
    """Every field of a JSON value: (path, value) of each dict entry and list item, inner first."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
            yield prefix + (k,), v
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:2]):   # a list's items are alike: the first two stand for all
            yield from _paths(v, prefix + (i,))
            yield prefix + (i,), v


def _mutations(value):
    """(kind, new value or DELETE) for one field."""
    yield "absent", DELETE
    yield "type", {str: 12345, bool: "yes", int: "12", float: "1.5", dict: [1], list: {"a": 1},
                   type(None): "x"}.get(type(value), None)
    if isinstance(value, bool):
        yield "range", 2
    elif isinstance(value, int):
        yield "range", -1
        yield "range", 10 ** 30
    elif isinstance(value, float):
        yield "range", -1.0
        yield "range", float("nan")
        yield "range", 1e300
    elif isinstance(value, str):
        yield "range", ""
        yield "range", "\x00" * 3
    elif isinstance(value, list):
        yield "range", []


DELETE = object()


def _set(st, path, new):
    st = copy.deepcopy(st)
    d = st
    for k in path[:-1]:
        d = d[k]
    if new is DELETE:
        if isinstance(d, list):
            d.pop(path[-1])
        else:
            d.pop(path[-1])
    else:
        d[path[-1]] = new
    return st


def test_an_edited_state_is_refused_by_its_checksum(runs):
    r, _ = _resume(runs, "edited", lambda st: {**st, "step": st["step"]}, reseal=False)
    assert r.exit_code == 0, r.stderr   # unchanged content: the checksum holds
    r, out = _resume(runs, "edited", lambda st: _set(st, ("options", "lr"), 0.5), reseal=False)
    assert r.exit_code == 2 and not out.exists()
    assert_one_line_error(r.stderr, "checksum")


def _state_cases(runs) -> list:
    st0 = json.loads((runs / "run" / "checkpoints" / "step-4" / "trainer_state.json").read_text())
    cases = []
    for path, value in _paths(st0):
        if path[0] == "checksum":
            continue
        for kind, new in _mutations(value):
            cases.append((path, kind, new))
    assert len(cases) > 400
    return cases


def test_every_field_of_the_trainer_state_mutated(runs):
    """Every fourth mutation of every field (`-m slow` runs them all: 430 resumes, ~2 min)."""
    _check_state_cases(runs, _state_cases(runs)[::4])


@pytest.mark.slow
def test_every_field_of_the_trainer_state_mutated_every_way(runs):
    _check_state_cases(runs, _state_cases(runs))


def _check_state_cases(runs, cases) -> None:
    """Each mutation re-sealed (as if memengine had written it): the schema and the checks
    against the data, the seed and the optimizer state refuse it, or the run is the same."""
    outcomes = {"refused": 0, "identical": 0}
    failures = []
    for i, (path, kind, new) in enumerate(cases):
        r, out = _resume(runs, "m", lambda st: _set(st, path, new))
        where = f"{'.'.join(map(str, path))} {kind} {new if new is not DELETE else 'deleted'!r}"
        if r.exit_code == 2:
            lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
            if len(lines) != 1 or "Traceback" in r.stderr:
                failures.append((where, "not one line", r.stderr[-300:]))
            outcomes["refused"] += 1
        elif r.exit_code == 0 and _identical(out, runs / "ref"):
            outcomes["identical"] += 1
        else:
            failures.append((where, r.exit_code, r.stderr[-300:]))
    assert not failures, (len(failures), failures[:40])
    assert outcomes["refused"] > outcomes["identical"]


OPT_CASES = {
    "no tensors": lambda o: {},
    "only the step": lambda o: {"__step__": o["__step__"]},
    "one moment of a pair removed": lambda o: {k: v for k, v in o.items() if not k.endswith("norm_f.weight.exp_avg")},
    "both moments of a tensor removed": lambda o: {k: v for k, v in o.items() if ".norm_f.weight." not in k},
    "__step__ of another step": lambda o: {**o, "__step__": np.array([2.0], o["__step__"].dtype)},
    "__step__ removed": lambda o: {k: v for k, v in o.items() if k != "__step__"},
    "__step__ negative": lambda o: {**o, "__step__": -o["__step__"]},
    "__step__ as text-like bytes": lambda o: {**o, "__step__": np.array([52], np.uint8)},
    "a moment in F16": lambda o: {**o, **{k: v.astype(np.float16) for k, v in o.items() if k.endswith("D.exp_avg")}},
    "a moment in I32": lambda o: {**o, **{k: v.astype(np.int32) for k, v in o.items() if k.endswith("D.exp_avg")}},
    "a moment NaN": lambda o: {**o, **{k: np.full_like(v, np.nan) for k, v in o.items() if k.endswith("D.exp_avg")}},
    "a second moment negative": lambda o: {**o, **{k: -np.ones_like(v) for k, v in o.items()
                                                   if k.endswith("D.exp_avg_sq")}},
    "a moment reshaped": lambda o: {**o, **{k: v.reshape(-1)[:-1].copy() for k, v in o.items()
                                            if k.endswith("A_log.exp_avg")}},
    "a moment of no tensor": lambda o: {**o, "backbone.nothing.exp_avg": np.zeros(2, np.float32),
                                        "backbone.nothing.exp_avg_sq": np.zeros(2, np.float32)},
}


@pytest.mark.parametrize("case", sorted(OPT_CASES))
def test_every_kind_of_optimizer_state_damage_is_refused(runs, case):
    r, out = _resume(runs, "opt", edit_opt=OPT_CASES[case])
    assert r.exit_code == 2, (case, r.exit_code, r.stderr)
    assert_one_line_error(r.stderr)
    assert not out.exists()


def test_every_tensor_of_the_optimizer_state_mutated(runs):
    o0 = load_file(str(runs / "run" / "checkpoints" / "step-4" / "optimizer.safetensors"))
    failures = []
    for key in sorted(o0):
        for kind, edit in (("absent", lambda o: {k: v for k, v in o.items() if k != key}),
                           ("type", lambda o: {**o, key: o[key].astype(np.float64)}),
                           ("range", lambda o: {**o, key: np.full_like(o[key], -np.inf)})):
            r, out = _resume(runs, "optm", edit_opt=edit)
            if r.exit_code == 2:
                continue
            if r.exit_code != 0 or not _identical(out, runs / "ref"):
                failures.append((key, kind, r.exit_code, r.stderr[-200:]))
    assert not failures, failures[:5]


def test_a_state_of_the_previous_version_still_resumes(runs):
    """Checkpoints written before the checksum (version 1) resume as they did."""
    def old(st):
        st = {k: v for k, v in st.items() if k not in ("checksum", "optimizer_step")}
        st["version"] = 1
        return st

    r, out = _resume(runs, "v1", old, reseal=False)
    assert r.exit_code == 0, r.stderr
    assert _identical(out, runs / "ref")
