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


def segment(device: str, resumed_from: str | None, first_step: int, backend: str | None = None) -> dict:
    """One invocation of a run (appended to the trainer state's segments when it starts);
    `device`: the GPU adapter it runs on (the record's "adapter"), `backend` the WebGPU
    implementation (wgpu, dawn)."""
    return {"started": now(), "finished": None, "memengine_version": version(), "adapter": device,
            "backend": backend, "resumed_from": resumed_from, "first_step": first_step, "last_step": None}


def run_record(kind: str, options: dict, *, input_path: str | None, device: str, segments: list,
               history: list, result: dict, extra: dict | None = None, backend: str | None = None) -> dict:
    return {
        "memengine_version": version(),
        "command": kind,
        "input": input_path,
        "data": options.get("data"),
        "options": options,
        "adapter": device,   # the GPU adapter
        "backend": backend,  # the WebGPU implementation it was reached through (wgpu, dawn)
        "created": now(),
        "result": result,
        **(extra or {}),
        "segments": segments,
        "history": history,
    }


CARD_FILE = "README.md"


def model_card(kind: str, *, base: str | None, model_type: str, options: dict, data: dict, result: dict,
               lora: dict | None = None) -> str:
    """OUT's README.md, as transformers' Trainer and PEFT write one: front matter a hub
    reads (base_model, library_name, tags), then what was run, on what data, and what came
    of it."""
    lines = ["---", f"base_model: {base}" if base else "base_model: null",
             f"library_name: {'peft' if lora else 'transformers'}", "tags:", "- memengine", f"- {model_type}",
             f"- {kind}"] + (["- lora"] if lora else []) + ["---", ""]
    title = {"train": "LoRA adapter" if lora else "Fine-tuned model", "adapt": "WSLA-adapted model"}.get(kind, kind)
    lines += [f"# {title}", "",
              f"Made with memengine {version()} (`memengine {kind}`) from `{base}` ({model_type}) on {now()}.", ""]
    if lora:
        lines += [f"A LoRA adapter in PEFT's format: r {lora['r']}, alpha {lora['alpha']:g}, dropout "
                  f"{lora['dropout']:g}, on {', '.join(lora['targets'])}.", ""]
    files = options.get("data") or []
    lines += ["## Data", "", *[f"- `{f}`" for f in files],
              f"- {data.get('tokens', 0):,} tokens, {data.get('documents', 0):,} document(s), token stream sha256 "
              f"`{data.get('sha256', '')}`", ""]
    shown = {k: v for k, v in result.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)
             and k not in ("output", "adapter")}
    lines += ["## Result", "", "| | |", "| --- | --- |",
              *[f"| {k} | {v:.6g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in shown.items()], ""]
    opts = {k: v for k, v in sorted(options.items()) if v not in (None, [], False) and k != "data"}
    lines += ["## Options", "", "```", *[f"{k.replace('_', '-')}: {v}" for k, v in opts.items()], "```", "",
              "The whole run (every event, each invocation) is in `memengine.json`.", ""]
    return "\n".join(lines)
