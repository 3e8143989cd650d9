"""The README's tour of the command line, run top to bottom as typed (one bash session in an
empty directory, the text files it names made from the bundled demo text): every line exits
0, except `adapt`, whose status 3 (rolled back) the tour itself explains."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def tour_lines() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    body = text.split("## A tour of the command line", 1)[1]
    block = re.search(r"```sh\n(.*?)```", body, re.S).group(1)
    return [ln for ln in block.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def test_the_readme_tour_runs_as_typed(tmp_path):
    assert shutil.which("jq"), "the tour pipes into jq"
    lines = tour_lines()
    assert len(lines) > 20 and lines[0].startswith("memengine ")
    demo = (ROOT / "engine" / "data" / "demo.txt").read_text(encoding="utf-8")
    (tmp_path / "book.txt").write_text(demo, encoding="utf-8")
    for name, part in (("held-out.txt", demo[-1500:]), ("note.txt", demo[:800]), ("notes.txt", demo[800:2400])):
        (tmp_path / name).write_text(part, encoding="utf-8")
    (tmp_path / "train.yaml").write_text("epochs: 1\nseq-len: 64\nbatch-size: 2\n", encoding="utf-8")
    bindir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}", "HOME": str(tmp_path / "home"),
           "HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "SHELL": "/bin/bash"}
    (tmp_path / "home").mkdir()
    # one session, each line's status recorded; `echo $?` prints the status of the line before
    script = ["cd " + str(tmp_path)]
    for i, ln in enumerate(lines):
        if ln.strip().startswith("echo $?"):
            script.append(f'echo "{i} $last" >> status.txt')
            continue
        script.append(f'{{ {ln}\n}} > out.{i} 2> err.{i} < /dev/null; last=$?; echo "{i} $last" >> status.txt'
                      if "| memengine" not in ln and "--prompt -" not in ln else
                      f'{{ {ln}\n}} > out.{i} 2> err.{i}; last=$?; echo "{i} $last" >> status.txt')
    r = subprocess.run(["bash", "-c", "\n".join(script)], env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stderr
    status = dict(ln.split() for ln in (tmp_path / "status.txt").read_text().splitlines())
    bad = []
    for i, ln in enumerate(lines):
        code = int(status[str(i)])
        ok = {0, 3} if ln.startswith(("memengine adapt", "echo $?")) else {0}
        if code not in ok:
            err = (tmp_path / f"err.{i}").read_text(errors="replace").strip().splitlines()[-3:] \
                if (tmp_path / f"err.{i}").exists() else []
            bad.append((ln, code, err))
    assert not bad, "\n".join(f"{ln!r} exited {code}: {err}" for ln, code, err in bad)
    # what the lines say they do
    assert (tmp_path / "tiny-trained" / "model.safetensors").is_file()
    assert (tmp_path / "tiny-q8.gguf").is_file() and (tmp_path / "tiny-noted").is_dir()
    assert (tmp_path / "tiny-f16").is_dir()
    jq_line = next(i for i, ln in enumerate(lines) if "jq -r .text" in ln)
    assert (tmp_path / f"out.{jq_line}").read_text().strip()   # the generated text


if __name__ == "__main__":   # pragma: no cover
    pytest.main([__file__, "-q"])
