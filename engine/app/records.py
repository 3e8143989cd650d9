"""The run record, OUT/memengine.json: what was run, with which options, where, and what
came of it.  `history` holds every event of the run (step, eval, epoch) across resumes,
so step numbers continue; `segments` lists each invocation (a resume adds one).
"""

from __future__ import annotations

import time


def version() -> str:
    from memengine.engine import __version__

    return __version__


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def segment(device: str, resumed_from: str | None, first_step: int) -> dict:
    """One invocation of a run (appended to the trainer state's segments when it starts);
    `device`: the GPU adapter it runs on (the record's "adapter")."""
    return {"started": now(), "finished": None, "memengine_version": version(), "adapter": device,
            "resumed_from": resumed_from, "first_step": first_step, "last_step": None}


def run_record(kind: str, options: dict, *, input_path: str | None, device: str, segments: list,
               history: list, result: dict, extra: dict | None = None) -> dict:
    return {
        "memengine_version": version(),
        "command": kind,
        "input": input_path,
        "data": options.get("data"),
        "options": options,
        "adapter": device,   # the GPU adapter
        "created": now(),
        "result": result,
        **(extra or {}),
        "segments": segments,
        "history": history,
    }
