"""Soak test (not run in CI): train / adapt / quantize on a tiny model, with and without
--force onto an existing OUT, each sent SIGINT, SIGTERM or SIGKILL at a random instant
(or left alone), then checked: OUT is absent (only without --force), the old OUT or the new
one, complete and loadable by transformers; after the next run's recovery
(`staging.check_output`) no hidden leftover remains; exit statuses are 0 / 3 (adapt rolled
back) / 130 / 143 / killed, and every message is one line without a traceback.

    python benchmarks/soak_signals.py --runs 80 [--seed 0] [--workdir DIR] [--json]

Prints one line per run and a summary: runs, signals sent, outcomes.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = {"vocab_size": 256, "hidden_size": 16, "state_size": 4, "num_hidden_layers": 1, "expand": 2,
        "conv_kernel": 4, "time_step_rank": "auto", "tie_word_embeddings": True}
TEXT = ("The lighthouse keeper of Mirrow Point counted seventeen ships at dawn, and wrote each name in the "
        "blue ledger. ") * 20
OLD_MARKER = "OLD-OUT-MARKER"
SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM, "SIGKILL": signal.SIGKILL, "none": None}


def cli(*args) -> list[str]:
    return [sys.executable, "-m", "memengine.cli", *[str(a) for a in args]]


def command(kind: str, base: Path, text: Path, out: Path, force: bool) -> list[str]:
    f = ["--force"] if force else []
    if kind == "quantize":
        return cli("quantize", base, "-o", out, *f)
    extra = ["--tolerance", "100"] if kind == "adapt" else []
    return cli(kind, base, "--data", text, "-o", out, "--epochs", "3", "--seq-len", "32", "--batch-size", "2",
               *extra, *f)


def env() -> dict:
    e = dict(os.environ)
    e.pop("MEMENGINE_DEBUG", None)
    e.setdefault("HF_HUB_OFFLINE", "1")
    return e


def classify(out: Path) -> str:
    """'absent', 'old', 'new' (complete and loadable) or 'broken: ...'."""
    import transformers

    if not os.path.lexists(out):
        return "absent"
    if not out.is_dir():
        return "broken: not a directory"
    tag = "old" if (out / OLD_MARKER).is_file() else "new"
    try:
        transformers.MambaForCausalLM.from_pretrained(str(out))
    except Exception as e:  # noqa: BLE001 - any failure to load is the finding
        return f"broken: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    if not (out / "memengine.json").is_file() and not (out / "config.json").is_file():
        return "broken: no config"
    return tag


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=80)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", action="store_true", help="a JSON summary on stdout")
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
    for kind in ("train", "adapt", "quantize"):
        out = work / f"ref-{kind}"
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.monotonic()
        subprocess.run(command(kind, base, text, out, False), check=True, env=env(), capture_output=True)
        full[kind] = time.monotonic() - t0
    print("undisturbed run times: " + ", ".join(f"{k} {v:.1f}s" for k, v in full.items()), flush=True)

    tally = collections.Counter()
    sent = collections.Counter()
    codes = collections.Counter()
    failures = []
    for i in range(a.runs):
        kind = rng.choice(("train", "adapt", "quantize"))
        force = rng.random() < 0.5
        sig_name = rng.choice(("SIGINT", "SIGTERM", "SIGKILL", "SIGINT", "SIGTERM", "SIGKILL", "none"))
        delay = rng.uniform(0.0, full[kind] * 1.1)
        out = work / f"out-{i}"
        if force:  # an existing, complete OUT to replace: a reference output with a marker
            shutil.copytree(work / f"ref-{kind}", out)
            (out / OLD_MARKER).write_text("old")
        p = subprocess.Popen(command(kind, base, text, out, force), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, env=env())
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
            failures.append((i, "did not end within 300 s of the signal"))
        if sig_name == "none":
            sent["none"] += 1
        else:
            sent[got or f"{sig_name} not sent (finished first)"] += 1
        code = p.returncode
        codes[code] += 1
        state = classify(out)
        left = leftovers(out)
        problems = []
        if state.startswith("broken"):
            problems.append(state)
        if state == "absent" and force:
            problems.append("OUT absent after a --force run (neither old nor new)")
        if state == "old" and code == 0 and kind != "adapt":
            problems.append("exit 0 but OUT is still the old one")
        early = code in (-signal.SIGINT, -signal.SIGTERM) and not (err or "").strip()
        if early:  # ended by the signal's default action before the interpreter ran memengine's first line
            codes[f"{code} (before memengine's first line ran)"] += 1
            codes[code] -= 1
        elif code in (130, 143) or code not in (0, 3, -signal.SIGKILL):
            lines = [ln for ln in (err or "").splitlines() if ln.startswith("error:")]
            if "Traceback" in (err or "") or len(lines) != 1:
                problems.append(f"exit {code} without exactly one error line: {err[-300:]!r}")
        if code not in (0, 3, 130, 143, -signal.SIGKILL) and not early:
            problems.append(f"exit status {code}: {err[-300:]!r}")
        # the next run recognises what a killed one left
        staging.check_output(out, force=True)
        after = classify(out)
        if leftovers(out):
            problems.append(f"leftovers after recovery: {leftovers(out)}")
        if after.startswith("broken") or (after == "absent" and force):
            problems.append(f"after recovery: {after}")
        outcome = state if not left else f"{state} + {len(left)} leftover(s) -> {after}"
        tally[outcome] += 1
        print(f"run {i:3d} {kind:8s} {'--force' if force else '       '} {got or 'no signal':10s} at "
              f"{delay:5.2f}s  exit {code:4}  OUT {outcome}" + (f"  PROBLEM: {problems}" if problems else ""),
              flush=True)
        if problems:
            failures.append((i, problems))
        shutil.rmtree(out, ignore_errors=True)

    summary = {"runs": a.runs, "signals": dict(sent), "exit_codes": {str(k): v for k, v in codes.items() if v},
               "outcomes": dict(tally), "failures": len(failures), "run_times_s": full}
    print("summary: " + json.dumps(summary), flush=True)
    if a.json:
        json.dump(summary, sys.stdout)
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
