"""Soak test (not run in CI): commands on a tiny model sent SIGINT, SIGTERM or SIGKILL at a
random instant (or left alone), then checked: OUT is absent (only where there was none),
the old OUT, or a new one that loads (transformers) and, where it holds a run, whose files
are all of one step; after the next run's recovery (`staging.recover`) no hidden leftover
and no lock file remain; exit statuses are 0 / 2 (a second writer refused) / 3 (adapt
rolled back) / 130 / 143 / killed, and every message is one line without a traceback.

Scenarios (picked at random per run):

  train, adapt, quantize   onto a new OUT, or with --force onto an existing one
  train-save               train --save-every 4, new OUT or --force onto an existing one
                           (the old OUT must stay until the new one has a checkpoint)
  resume                   train --resume OUT in place, OUT a run stopped at step 8 with the
                           user's own files in it (kept, whatever happens)
  concurrent               a train --save-every run and, started during it, a second writer
                           of the same OUT (--resume OUT, or quantize --force): refused while
                           the first runs; the first is the one signalled

    python benchmarks/soak_signals.py --runs 100 [--seed 0] [--workdir DIR] [--json FILE]

Prints one line per run and a summary: runs, signals sent, outcomes, exit statuses.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = {"vocab_size": 256, "hidden_size": 16, "state_size": 4, "num_hidden_layers": 1, "expand": 2,
        "conv_kernel": 4, "time_step_rank": "auto", "tie_word_embeddings": True}
TEXT = ("The lighthouse keeper of Mirrow Point counted seventeen ships at dawn, and wrote each name in the "
        "blue ledger. ") * 20
OLD_MARKER = "OLD-OUT-MARKER"   # the README.md of an old OUT (a file memengine writes, so --force may replace it)
USER_FILE = "eval_results.json"
SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM, "SIGKILL": signal.SIGKILL, "none": None}
SCENARIOS = ("train", "adapt", "quantize", "train-save", "resume", "concurrent")


def cli(*args) -> list[str]:
    return [sys.executable, "-m", "memengine.cli", *[str(a) for a in args]]


def command(kind: str, base: Path, text: Path, out: Path, force: bool) -> list[str]:
    f = ["--force"] if force else []
    if kind == "quantize":
        return cli("quantize", base, "-o", out, *f)
    if kind == "resume":
        return cli("train", "--resume", out, "--max-steps", "24")
    extra = {"adapt": ["--tolerance", "100"], "train-save": ["--save-every", "4"]}.get(kind, [])
    name = "adapt" if kind == "adapt" else "train"
    return cli(name, base, "--data", text, "-o", out, "--epochs", "2", "--seq-len", "32", "--batch-size", "2",
               *extra, *f)


def env() -> dict:
    e = dict(os.environ)
    e.pop("MEMENGINE_DEBUG", None)
    e.setdefault("HF_HUB_OFFLINE", "1")
    return e


def _meta_step(path: Path):
    """The "step" in a safetensors file's metadata (what memengine writes into a model)."""
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            meta = json.loads(f.read(n)).get("__metadata__") or {}
        return int(meta["step"]) if "step" in meta else None
    except (OSError, ValueError, KeyError):
        return None


def _opt_step(path: Path):
    try:
        from safetensors.numpy import load_file

        return int(load_file(str(path))["__step__"][0])
    except Exception:  # noqa: BLE001
        return None


def loadable(d: Path) -> str:
    """'' when `d` loads with transformers and its run files are of one step, else why not."""
    import transformers

    try:
        transformers.MambaForCausalLM.from_pretrained(str(d))
    except Exception as e:  # noqa: BLE001 - any failure to load is the finding
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    st = d / "trainer_state.json"
    if st.is_file():
        step = json.loads(st.read_text())["step"]
        steps = {step, _meta_step(d / "model.safetensors")}
        opt = d / "optimizer.safetensors"
        if opt.is_file() and "optimizer_step" in json.loads(st.read_text()):
            steps.add(_opt_step(opt))
        rec = d / "memengine.json"
        if rec.is_file():
            steps.add(json.loads(rec.read_text())["segments"][-1]["last_step"])
        if len(steps - {None}) != 1:
            return f"files of different steps {sorted(s for s in steps if s is not None)}"
    return ""


def classify(out: Path) -> str:
    """'absent', 'old', 'new' (loadable: OUT itself, or its latest checkpoint) or 'broken: ...'."""
    if not os.path.lexists(out):
        return "absent"
    if not out.is_dir():
        return "broken: not a directory"
    readme = out / "README.md"
    tag = "old" if readme.is_file() and readme.read_text() == OLD_MARKER else "new"
    if (out / "config.json").is_file():
        why = loadable(out)
        return f"broken: {why}" if why else tag
    ckpts = sorted((int(p.name[5:]), p) for p in (out / "checkpoints").glob("step-*")) \
        if (out / "checkpoints").is_dir() else []
    if not ckpts:
        return "broken: neither a model nor a checkpoint"
    why = loadable(ckpts[-1][1])
    return f"broken: checkpoint {ckpts[-1][1].name}: {why}" if why else f"{tag} (checkpoints only)"


def top_step(out: Path):
    try:
        return json.loads((out / "trainer_state.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return None


def leftovers(out: Path) -> list[str]:
    found = sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))
    if (out / "checkpoints").is_dir():
        found += sorted(f"checkpoints/{p.name}" for p in (out / "checkpoints").iterdir() if p.name.startswith("."))
    return found


def one_line(err: str) -> bool:
    lines = [ln for ln in (err or "").splitlines() if ln.startswith("error:")]
    return "Traceback" not in (err or "") and len(lines) == 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="write the summary and every run's line here")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import transformers
    from memengine.engine.io import staging

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    rng = random.Random(a.seed)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="memengine-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    base, text = work / "base", work / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    cfg = work / "tiny.json"
    cfg.write_text(json.dumps(TINY))
    if not base.exists():
        subprocess.run(cli("init", cfg, "-o", base, "-q"), check=True, env=env())

    # how long each command takes undisturbed (the window the signals are spread over)
    full = {}
    for kind in ("train", "adapt", "quantize", "train-save"):
        out = work / f"ref-{kind}"
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.monotonic()
        subprocess.run(command(kind, base, text, out, False), check=True, env=env(), capture_output=True)
        full[kind] = time.monotonic() - t0
    stopped = work / "ref-stopped"   # a run stopped at step 8, to resume in place
    shutil.rmtree(stopped, ignore_errors=True)
    subprocess.run(cli("train", base, "--data", text, "-o", stopped, "--seq-len", "32", "--batch-size", "2",
                       "--max-steps", "8", "--save-every", "4"), check=True, env=env(), capture_output=True)
    t0 = time.monotonic()
    probe = work / "ref-resume"
    shutil.rmtree(probe, ignore_errors=True)
    shutil.copytree(stopped, probe)
    subprocess.run(command("resume", base, text, probe, False), check=True, env=env(), capture_output=True)
    full["resume"] = time.monotonic() - t0
    full["concurrent"] = full["train-save"]
    print("undisturbed run times: " + ", ".join(f"{k} {v:.1f}s" for k, v in full.items()), flush=True)

    tally, sent, codes = collections.Counter(), collections.Counter(), collections.Counter()
    failures, lines = [], []
    for i in range(a.runs):
        kind = rng.choice(SCENARIOS)
        force = kind in ("train", "adapt", "quantize", "train-save") and rng.random() < 0.5
        sig_name = rng.choice(("SIGINT", "SIGTERM", "SIGKILL", "SIGINT", "SIGTERM", "SIGKILL", "none"))
        delay = rng.uniform(0.0, full[kind] * 1.1)
        out = work / f"out-{i}"
        had_out = force or kind == "resume"
        if force:  # an existing, complete OUT to replace: a reference output marked old
            shutil.copytree(work / f"ref-{'train' if kind == 'train-save' else kind}", out)
            (out / "README.md").write_text(OLD_MARKER)
        if kind == "resume":
            shutil.copytree(stopped, out)
            (out / USER_FILE).write_text('{"mine": true}')
        problems = []
        p = subprocess.Popen(command("train-save" if kind == "concurrent" else kind, base, text, out, force),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env())
        started = time.monotonic()
        first_end = {}
        waiter = threading.Thread(target=lambda: first_end.setdefault("t", (p.wait(), time.monotonic())[1]),
                                  daemon=True)
        waiter.start()
        second = None
        if kind == "concurrent":   # a second writer of the same OUT, some time into the first
            time.sleep(rng.uniform(0.5, full[kind] * 0.8))
            other = rng.choice(("resume", "quantize"))
            t1 = time.monotonic()
            q = subprocess.run(command(other, base, text, out, True), capture_output=True, text=True, env=env(),
                               timeout=300)
            second = (other, q.returncode, t1 - started, time.monotonic() - started, q.stderr)
            delay = max(0.0, delay - (time.monotonic() - started))
        got = None
        if sig_name != "none":
            try:
                p.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                p.send_signal(SIGNALS[sig_name])
                got = sig_name
                if sig_name != "SIGKILL" and rng.random() < 0.25:  # sometimes a second one soon after
                    time.sleep(rng.uniform(0.0, 0.5))
                    if p.poll() is None:
                        p.send_signal(SIGNALS[sig_name])
                        got += "x2"
        try:
            _, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            problems.append("did not end within 300 s of the signal")
        waiter.join(timeout=10)
        ended = first_end.get("t", time.monotonic()) - started
        sent["none" if sig_name == "none" else (got or f"{sig_name} not sent (finished first)")] += 1
        code = p.returncode
        codes[code] += 1
        state = classify(out)
        if kind == "resume" and state == "new" and top_step(out) == 8:
            state = "old"   # the stopped run's own files, as they were
        left = leftovers(out)
        if state.startswith("broken"):
            problems.append(state)
        if state == "absent" and had_out:
            problems.append("OUT absent where there was one (neither old nor new)")
        if state == "old" and code == 0 and kind not in ("adapt", "concurrent"):
            problems.append("exit 0 but OUT is still the old one")
        early = code in (-signal.SIGINT, -signal.SIGTERM) and not (err or "").strip()
        if early:  # ended by the signal's default action before the interpreter ran memengine's first line
            codes[f"{code} (before memengine's first line ran)"] += 1
            codes[code] -= 1
        elif code in (130, 143) or code not in (0, 3, -signal.SIGKILL):
            if not one_line(err):
                problems.append(f"exit {code} without exactly one error line: {err[-300:]!r}")
        # the first of two writers may be the one refused: the second held OUT, or had written it already
        refused = code == 2 and kind == "concurrent" and any(w in (err or "") for w in ("another memengine run",
                                                                                       "not empty"))
        if code not in (0, 3, 130, 143, -signal.SIGKILL) and not early and not refused:
            problems.append(f"exit status {code}: {err[-300:]!r}")
        if kind == "resume" and os.path.lexists(out) and not (out / USER_FILE).is_file():
            problems.append(f"the user's {USER_FILE} is gone after an in-place resume")
        if second is not None:
            other, qcode, q0, q1, qerr = second
            codes[f"second writer {qcode}"] += 1
            if qcode not in (0, 2) or (qcode == 2 and not one_line(qerr)):
                problems.append(f"second writer ({other}) exit {qcode}: {qerr[-300:]!r}")
            overlapped = q0 > 4.0 and q1 < ended and code == 0   # the first surely held the lock throughout
            if qcode == 0 and overlapped:
                problems.append(f"second writer ({other}) ran while the first one held OUT ({q0:.1f}-{q1:.1f}s "
                                f"of {ended:.1f}s)")
            if qcode == 2 and not any(w in qerr for w in ("another memengine run", "no such directory",
                                                          "no checkpoint")):
                problems.append(f"second writer refused for another reason: {qerr[-200:]!r}")
        # the next run recognises what a killed one left
        staging.recover(out)
        staging.release_locks()
        after = classify(out)
        if leftovers(out):
            problems.append(f"leftovers after recovery: {leftovers(out)}")
        if os.path.lexists(out.parent / f".{out.name}.lock"):
            problems.append("a lock file is left after recovery")
        if after.startswith("broken") or (after == "absent" and had_out):
            problems.append(f"after recovery: {after}")
        if kind == "resume" and after != "absent" and rng.random() < 0.3:   # what is left resumes
            r = subprocess.run(command("resume", base, text, out, False), capture_output=True, text=True,
                               env=env(), timeout=300)
            if r.returncode != 0 or (classify(out) != "new"):
                problems.append(f"resuming what was left: exit {r.returncode}, {classify(out)}: {r.stderr[-200:]!r}")
        outcome = state if not left else f"{state} + {len(left)} leftover(s) -> {after}"
        tally[f"{kind}: {outcome}"] += 1
        line = (f"run {i:3d} {kind:10s} {'--force' if force else '       '} {got or 'no signal':10s} at "
                f"{delay:5.2f}s  exit {code:4}  OUT {outcome}"
                + (f"  second writer {second[0]} exit {second[1]}" if second else "")
                + (f"  PROBLEM: {problems}" if problems else ""))
        print(line, flush=True)
        lines.append(line)
        if problems:
            failures.append((i, problems))
        shutil.rmtree(out, ignore_errors=True)

    summary = {"runs": a.runs, "seed": a.seed, "signals": dict(sent),
               "exit_codes": {str(k): v for k, v in codes.items() if v},
               "outcomes": dict(sorted(tally.items())), "failures": len(failures), "run_times_s": full}
    print("summary: " + json.dumps(summary), flush=True)
    if a.json:
        a.json.write_text(json.dumps({"summary": summary, "runs": lines, "failures": failures}, indent=2) + "\n")
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
