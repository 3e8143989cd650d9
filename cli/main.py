"""The `memengine` command line (Typer).

Commands: init, info, eval, train, adapt, merge, quantize, export, generate, plot, demo.  Human output goes to stderr
through `cli.ui.UI`; `--json` puts JSON lines (and nothing else) on stdout.  Exit status:
0 ok, 1 internal error, 2 bad input or usage, 3 adapt rolled back, 130 interrupted.

info, eval, train, adapt and generate are built from the engine's option dataclasses (cli/params.py):
each is a few lines that take the resolved options, call the engine and render.
"""

from __future__ import annotations

import math
import re
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Optional

import typer
from memengine.engine.app.options import AdaptOptions, EvalOptions, GenerateOptions, InfoOptions, TrainOptions
from memengine.engine.errors import MemengineError
from memengine.engine.io import staging
from memengine.engine.io.shards import DEFAULT_MAX_SHARD_SIZE, parse_size

from . import generate as gen
from .common import EXIT_ROLLED_BACK, CommandGroup, engine_version, guard
from .params import JsonOpt, QuietOpt, VerboseOpt, param, run_command
from .ui import UI

app = typer.Typer(
    name="memengine",
    cls=CommandGroup,
    help="Fine-tune (train) and narrowly adapt (adapt, WSLA) Mamba-1, Falcon-Mamba and Mamba-2 models with WGSL compute "
         "shaders on any WebGPU adapter; convert checkpoints to fp16/bf16 (quantize) or to GGUF for llama.cpp (export).",
    epilog="Run 'memengine demo' for a short tour on built-in defaults. "
           "Exit status: 0 ok, 1 internal error, 2 bad input or usage, 3 adapt rolled back.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)

# options of non-run commands, made from the same fields as the run commands' ones
CkptArg = param(EvalOptions, "ckpt", str)[0]
RevisionOpt = param(EvalOptions, "revision")[0]
ModelTypeOpt = param(EvalOptions, "model_type")[0]
BaseOpt = param(EvalOptions, "base")[0]
MaxShardSizeOpt = param(TrainOptions, "max_shard_size")[0]
DeviceOpt = param(EvalOptions, "device")[0]
BackendOpt = param(EvalOptions, "backend")[0]
SeqLenOpt = param(TrainOptions, "seq_len")[0]
BatchOpt = param(TrainOptions, "batch_size")[0]
LrOpt = param(TrainOptions, "lr")[0]
ForceOpt = param(TrainOptions, "force")[0]
OutOpt = Annotated[Path, typer.Option("--output", "-o", rich_help_panel="Output", help="Output checkpoint directory.")]


HELP_WIDTH = 78   # an 80-column terminal less the help's one-column margins


def _example_lines(cmd: str, width: int = HELP_WIDTH) -> list[str]:
    """One example as --help prints it: `  $ cmd`, cut (with a trailing backslash, as a shell
    reads it) only before an option, a pipe or a redirection when it is wider than `width`, so
    that no terminal of `width` columns or more breaks it in the middle of a word or a value;
    a comment that does not fit beside it goes on the line above."""
    code, _, comment = cmd.partition("   # ")
    code, comment = code.rstrip(), comment.strip()
    one = f"  $ {code}" + (f"   # {comment}" if comment else "")
    if len(one) <= width:
        return [one]
    words = re.findall(r"""(?:[^\s'"]+|'[^']*'|"[^"]*")+""", code)
    groups: list[str] = []   # an option with its values, a pipe with its command
    for w in words:
        starts = (w.startswith("-") and w != "-") or w in ("|", ">", ">>", "<", "&&", "2>")
        if groups and not starts:
            groups[-1] += " " + w
        else:
            groups.append(w)
    lines, cur = [], "  $"
    for g in groups:
        if cur.strip() not in ("$", "") and len(cur) + 1 + len(g) + 2 > width:
            lines.append(cur + " \\")
            cur = "     "
        cur += " " + g
    lines.append(cur)
    if comment:
        lines.insert(0, f"  # {comment}")
    return lines


def _examples(*lines: str) -> str:
    """An epilog listing examples (one per paragraph in --help, none wider than 80 columns)."""
    return "[bold]Examples[/bold]\n\n" + "\n\n".join("\n".join(_example_lines(ln)) for ln in lines)


def _version_cb(value: bool):
    if value:
        typer.echo(f"memengine {engine_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version_cb, is_eager=True,
                                          help="Print the version and exit.")] = False,
):
    """memengine: Mamba-1 fine-tuning on WebGPU."""


# =========================================================================== init
@app.command(epilog=_examples(
    "memengine init tiny -o tiny-model",
    "memengine init small -o small-model --seed 3",
    "memengine init my-config.yaml -o model --force",
    "memengine init mamba-130m -o m130 --max-shard-size 200MB   # transformers-style shards",
))
def init(
    config: Annotated[str, typer.Argument(metavar="CONFIG", help="Built-in config name (tiny, small, mamba-130m, mamba-1.4b) or a JSON/YAML file of MambaConfig keys.")],
    output: OutOpt,
    seed: Annotated[int, typer.Option("--seed", help="Random seed (same seed, same weights).")] = 0,
    max_shard_size: MaxShardSizeOpt = DEFAULT_MAX_SHARD_SIZE,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
):
    """Create a new, randomly initialised checkpoint (initialised the way transformers does)."""
    ui = UI(json_mode=json_out, quiet=quiet, verbose=verbose)
    with guard(ui):
        do_init(ui, config, output, seed, force, parse_size(max_shard_size))


def do_init(ui: UI, config: str, output: Path, seed: int, force: bool,
            max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    from memengine.engine import models
    from memengine.engine.io.checkpoint import save_checkpoint

    cfg_path = Path(config) / "config.json" if Path(config).is_dir() else Path(config)  # as load_config reads it
    inputs = [("the config file", cfg_path)] if cfg_path.exists() else []
    staging.check_output(output, force, inputs=inputs, on_note=ui.note)
    cfg = models.load_config(config)
    arch = models.of(cfg)
    from memengine.engine.listener import TaskMeter

    with TaskMeter(ui.on_task, f"initialising {config}", None):
        tensors = arch.init_weights(cfg, seed)
    n_params = int(sum(int(a.size) for a in tensors.values()))
    with staging.staged_output(output, force) as tmp, TaskMeter(ui.on_task, f"writing {output}", None):
        save_checkpoint(tmp, cfg, tensors, dtype="F32", max_shard_size=max_shard_size,
                        metadata={"producer": f"memengine {engine_version()}", "seed": str(seed)})
    ui.kv(f"initialised {output}", [
        ("config", config),
        *arch.summary(cfg),
        ("tensors", len(tensors)),
        ("parameters", f"{n_params:,}"),
        ("seed", seed),
    ])
    ui.emit({"event": "summary", "output": str(output), "parameters": n_params, "tensors": len(tensors),
             "config": config, "seed": seed})
    return output


# =========================================================================== devices
@app.command("devices", help="""List the GPU adapters memengine can run on, through each backend (wgpu-native and Dawn), with the limits and features runs depend on.

The adapter marked * is the one --device auto takes (with --backend, default auto: wgpu-native, and Dawn for --precision mixed where the adapter has f16 subgroup matrices); --device NAME takes the first whose name contains NAME.""",
             epilog=_examples("memengine devices", "memengine devices --json | jq -r '.devices[].name'"))
def devices_cmd(
    backend: BackendOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
):
    from memengine.engine.app.devices import list_devices

    ui = UI(json_mode=json_out, quiet=quiet, verbose=verbose)
    with guard(ui):
        EvalOptions(backend=backend)   # --backend's check
        found = list_devices(verbose=verbose, backend=backend)
        rows, adapters, unavailable = [], [], []
        for d in found:
            if "error" in d:
                ui.note(f"backend {d['backend']}: {d['error']}")
                unavailable.append(d)
                continue
            adapters.append(d)
            lim = d["limits"]
            feats = [f for f in d["features"] if f in ("shader-f16", "subgroup", "subgroups", "timestamp-query")]
            if d.get("subgroup_matrices"):
                feats.append("f16 subgroup matrices")
            rows.append((("* " if d["auto"] else "  ") + d["name"], d["backend"], d["type"], d["api"],
                         f"{lim.get('max-storage-buffer-binding-size', 0) / 2**20:,.0f} MiB",
                         f"{lim.get('max-buffer-size', 0) / 2**20:,.0f} MiB", ", ".join(feats) or "-"))
        ui.table("GPU adapters (* = what --device auto takes)", ["adapter", "backend", "type", "api", "binding",
                                                                 "buffer", "features"], rows, result=True)
        ui.emit({"devices": adapters, "unavailable": unavailable})


# =========================================================================== info
def short_tensor_name(name: str) -> str:
    """A checkpoint tensor's name for an 80-column table: the layer number first, the
    prefixes every layer shares left out ("backbone.layers.3.mixer.in_proj.weight" ->
    "3.in_proj.weight", "backbone.embeddings.weight" -> "embeddings.weight")."""
    n = name[len("backbone."):] if name.startswith("backbone.") else name
    if n.startswith("layers."):
        n = n[len("layers."):]
    return n.replace(".mixer.", ".", 1)


def _info(o: InfoOptions, ui: UI) -> None:
    from memengine.engine import models
    from memengine.engine.app import plan as mplan
    from memengine.engine.app.info import info_report

    rep = info_report(o, ui.warn, verbose=ui.verbose)
    d = rep.data
    if rep.lora is not None:
        ui.kv(f"LoRA adapter {o.ckpt}", [(k.replace("_", " "), ", ".join(v) if isinstance(v, list) else v)
                                         for k, v in rep.lora.items()], result=True)
        ui.emit(d)
        return
    cfg, caps, plan = rep.config, d["gpu"], d["plan"]
    shape = d.get("shape") is not None   # a built-in shape of configs/: no files
    ui.kv(f"{'shape' if shape else 'checkpoint'} {o.ckpt}", [
        ("model type", cfg.model_type),
        ("weights", f"none (a built-in shape: `memengine init {o.ckpt} -o DIR` makes them)" if shape else
         rep.weight_files[0] if len(rep.weight_files) == 1 else f"{len(rep.weight_files)} shards ({rep.model_file})"),
        *([("local path", rep.local_path)] if rep.local_path is not None else []),
        *models.of(cfg).describe(cfg),
        ("tensors", len(d["tensors"])),
        ("parameters", f"{d['parameters']:,}"),
        ("dtypes", ", ".join(f"{k}x{v}" for k, v in sorted(d["dtypes"].items()))),
        *([] if shape else [
            ("size on disk", f"{d['bytes']:,} bytes" if not rep.remote else
             f"{d['bytes']:,} bytes (the weights' tensor data on the Hub; not downloaded)"),
            ("tokenizer", d["tokenizer"] or "byte-level (built-in)"),
            ("optimizer state", "yes" if rep.optimizer_state else
             "not looked for (not downloaded)" if rep.remote else "no")]),
        ("adapter", d["adapter"]),
        ("backend", d["backend"] or "n/a"),
        ("GPU features", "n/a" if caps is None else
         f"{', '.join(caps['features']) or 'none'}; largest binding "
         f"{caps['max_storage_binding_bytes'] / 2**20:,.0f} MiB"),
    ], result=True)
    if plan is not None:
        lim = plan["limits"]
        ui.table(f"memory plan for batch {o.batch_size} x {o.seq_len}"
                 + (", --precision mixed" if plan.get("precision") == "mixed" else "") + " (largest buffer "
                 f"{mplan.fmt_bytes(lim['max_buffer_bytes'])}, binding {mplan.fmt_bytes(lim['max_binding_bytes'])}"
                 f", memory {'unknown' if lim['memory_bytes'] is None else mplan.fmt_bytes(lim['memory_bytes'])})",
                 ["", *mplan.KINDS, *([f"lora (r {plan['lora_rank']})"] if "lora" in plan else [])],
                 mplan.report_rows(plan), right=[False, True, True, True, True], result=True)
        ui.note(f"memory budget: {lim['memory_source']}")
        for kind in (k for k in mplan.REPORT_KINDS if k in plan):
            if not plan[kind]["ok"]:
                ui.note(f"{kind}: {plan[kind]['problem']}; {plan[kind]['advice']}")
    ui.emit(d)


run_command(app, InfoOptions, _info, name="info", help="""Show a checkpoint's config, parameter count, dtypes and size, the GPU adapter, and the memory plan (or a LoRA adapter's rank, alpha, targets and base).

The plan estimates what eval, train and adapt need for --batch-size x --seq-len (parameters, gradients, moments, activations, logits chunk, scratch) and checks it against the adapter's largest buffer and binding and, where one is known, the memory budget.""", epilog=_examples(
    "memengine info tiny-model",
    "memengine info model/model.safetensors --json | jq .parameters",
    "memengine info state-spaces/mamba-1.4b-hf                # a model id: its weights' headers only, no download",
    "memengine info mamba-codestral-7b --seq-len 2048 --batch-size 1   # a built-in shape: its plan",
    "memengine info my-org/my-mamba --revision v1.0            # a tag, branch or commit",
    "memengine info weights.safetensors --model-type falcon_mamba",
    "memengine info mamba-130m --seq-len 2048 --batch-size 4    # will train fit this adapter?",
    "memengine info mamba2-130m --seq-len 2048 --batch-size 8 --precision mixed   # with the f16 copies",
    "MEMENGINE_MAX_MEMORY_BYTES=8G memengine info model --json | jq .plan.train",
    "memengine info my-adapter                                  # a LoRA adapter: rank, alpha, targets, base",
))


# =========================================================================== eval
def _eval_rows(r) -> list:
    return [("loss", r.loss), ("perplexity", r.perplexity), ("bits per token", r.bits_per_token),
            ("top-1 accuracy", r.top1_accuracy), ("top-5 accuracy", r.top5_accuracy), ("tokens", r.tokens)]


def _eval(o: EvalOptions, ui: UI) -> None:
    from memengine.engine.app.run import run_eval
    from memengine.engine.io.data import describe_sources

    with ui.run_view() as view:
        rep = run_eval(o, view, verbose=ui.verbose)
    on = describe_sources(o.data)
    if rep.other is None:
        ui.kv(f"eval {o.ckpt} on {on}", _eval_rows(rep.result) + [("elapsed", f"{rep.elapsed_s:.1f}s")],
              result=True)
    else:
        a, b = _eval_rows(rep.result), _eval_rows(rep.other)
        ui.table(f"eval on {on}: A = {o.ckpt}, B = {o.compare}", ["", "A", "B", "B - A"],
                 [(k, va, vb, vb - va) for (k, va), (_, vb) in zip(a, b)], right=[False, True, True, True],
                 result=True)
    ui.emit(rep.to_dict())


run_command(app, EvalOptions, _eval, name="eval", help="Loss, perplexity, bits per token and top-1/top-5 next-token accuracy of a checkpoint on some text; --compare B reports a second checkpoint beside it.", epilog=_examples(
    "memengine eval tiny-model --data notes.txt",
    "cat notes.txt | memengine eval tiny-model --data - --json",
    "memengine eval model --data a.txt --data b.jsonl --seq-len 256 --batch-size 4",
    "memengine eval base --compare tuned --data held-out.txt --seq-len 256   # A/B report",
    "memengine eval state-spaces/mamba-130m-hf --data notes.txt   # a model id",
    "memengine eval weights.safetensors --model-type falcon_mamba --data notes.txt",
    "memengine eval adapter --data notes.txt   # a LoRA adapter on its base (base_model_name_or_path)",
    "memengine eval model --compare adapter --data held-out.txt   # the base against base + adapter",
))


# =========================================================================== train
def _launch_ranks(o: TrainOptions, ui: UI) -> Optional[int]:
    """--nproc-per-node N > 1 (and not already a rank): run this command line on N ranks
    through torch's launcher and return its exit status; None: run here."""
    from memengine.engine.train import distributed

    if o.nproc_per_node <= 1 or distributed.is_rank():
        return None
    code, msg = distributed.launch(o.nproc_per_node, sys.argv[1:])
    if msg:
        ui.error(msg)
    return code


def _train(o: TrainOptions, ui: UI) -> Optional[int]:
    from memengine.engine.app.run import run_train

    launched = _launch_ranks(o, ui)
    if launched is not None:
        return launched
    with ui.run_view() as view:
        res = run_train(o, view, verbose=ui.verbose)
    if o.dry_run:
        return _show_dry_run(ui, res)
    s = res.summary()
    ui.note(f"wrote {res.output} (final loss {s['final_loss']:.4f}, {s['steps']} steps, {res.elapsed_s:.1f}s)")
    ui.emit(s)


run_command(app, TrainOptions, _train, name="train", help="""Fine-tune every parameter (full backprop on the GPU, AdamW, global grad-norm clipping), or with --lora-rank a LoRA adapter in PEFT's format (the base frozen).

Resumes the optimizer moments from optimizer.safetensors beside CKPT when present, and writes the new model, its optimizer state, trainer_state.json and memengine.json (options, version, adapter, the whole history) to OUT. --save-every writes OUT/checkpoints/step-K; --resume continues a run exactly. A --config file may set any option; flags given on the command line win.""", epilog=_examples(
    "memengine train tiny-model --data book.txt -o tiny-trained",
    "memengine train tiny-model --data book.txt -o out --epochs 20 --lr 3e-3 --seq-len 128",
    "cat notes.txt | memengine train model --data - -o out --json > log.jsonl",
    "memengine train model --data book.txt -o out --config train.yaml --lr 1e-3   # flag beats file",
    "memengine train model --data book.txt --val-fraction 0.05 -o out --save-every 200 --keep-last 3 "
    "--lr-schedule cosine --warmup-steps 100",
    "memengine train --resume out --epochs 10   # continue in place (after Ctrl-C, or for more epochs)",
    "memengine train state-spaces/mamba-130m-hf --data book.txt -o out --max-shard-size 200MB",
    "memengine train model --data book.txt -o adapter --lora-rank 8 --lora-alpha 16   # a PEFT LoRA adapter",
    "memengine train model --data more.txt -o adapter-2 --lora-from adapter   # continue an adapter",
    "memengine train model --data book.txt -o out --batch-size 4 --nproc-per-node 2   # 2 ranks: batch 8",
))


def _show_dry_run(ui: UI, d: dict) -> int:
    from memengine.engine.app.plan import fmt_bytes

    st, ck, mem = d["steps"], d["checkpoints"], d["memory"]
    ui.kv(f"dry run: {d['kind']} {d['input']} -> {d['output']} (nothing is trained or written)", [
        ("resumes", "no" if d["resume"] is None else f"{d['resume']['from']} at step {d['resume']['step']}"),
        ("data", f"{d['data']['tokens']:,} tokens, {d['data']['documents']:,} document(s), sha256 "
                 f"{d['data']['sha256'][:12]}"),
        ("windows", f"{d['windows']['train']:,} for training, {d['windows']['held_out']:,} held out"),
        ("steps", f"{st['total']:,} in all ({st['per_epoch']:,} an epoch), from step {st['from']:,}"),
        ("checkpoints", "none (no --save-every)" if not ck["every"] else
         f"every {ck['every']:,} steps" + (f", the last {ck['keep_last']} kept" if ck["keep_last"] else "")
         + (", the best kept" if ck["keep_best"] else "")),
        ("device", d["device"]),
        ("memory", f"{fmt_bytes(mem['total_bytes'])} ("
                   + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in mem["bytes"].items() if v) + "); fits"),
        ("options", " ".join(f"{k}={v}" for k, v in sorted(d["options"].items()) if v not in (None, [], False))),
    ])
    ui.emit(d)
    return 0


# =========================================================================== adapt
def _adapt(o: AdaptOptions, ui: UI) -> int:
    from memengine.engine.app.run import run_adapt

    launched = _launch_ranks(o, ui)
    if launched is not None:
        return launched
    with ui.run_view() as view:
        res = run_adapt(o, view, verbose=ui.verbose)
    if o.dry_run:
        return _show_dry_run(ui, res)
    a = res.adapt
    summary = res.summary()
    ui.kv("adapt summary", [
        ("perplexity before", a.perplexity_before),
        ("perplexity after", a.perplexity_after),
        ("mean grad norm", a.grad_norm),
        ("changed tensors", len(a.changed_tensors)),
        ("max |delta|", a.max_abs_delta),
        ("rolled back", a.rolled_back),
        ("reason", a.reason),
    ])
    ui.emit(summary)
    if a.rolled_back:
        left = (f"the model was not written (the run's checkpoints stay in {res.checkpoints})" if res.checkpoints
                else "nothing was written")
        ui.error(f"adaptation rolled back: {a.reason}; {left}")
        return EXIT_ROLLED_BACK
    ui.note(f"wrote {res.output} ({res.elapsed_s:.1f}s)")
    return 0


run_command(app, AdaptOptions, _adapt, name="adapt", help="""Adapt only the selection parameters (WSLA: Mamba-1's x_proj; Mamba-2's in_proj rows for B, C and dt, and dt_bias) with a trust region, rolling back on regression.

Perplexity on the adapt text is measured before and after. If a loss is non-finite or perplexity after exceeds before x --tolerance, the weights are restored, nothing is written, and the exit status is 3. Every other tensor (and, for Mamba-2, in_proj's z and x rows) is written bit-identical. Takes the long-run options of train too (checkpoints, resume, schedules, validation).""", epilog=_examples(
    "memengine adapt tiny-trained --data note.txt -o adapted",
    "echo 'The lighthouse keeper counts ships at dawn.' | memengine adapt tiny-trained --data - -o adapted",
    "memengine adapt model --data note.txt -o out --lr 1e-3 --tolerance 1.1 --json",
    "memengine adapt model --data note.txt -o out --no-rollback   # keep the result even if worse",
    "memengine adapt state-spaces/mamba-130m-hf --data note.txt -o out --max-shard-size 200MB",
    "memengine adapt my-adapter --data note.txt -o out   # a LoRA adapter applied; OUT has it merged",
))


# =========================================================================== merge
@app.command(epilog=_examples(
    "memengine merge adapter -o merged",
    "memengine merge adapter -o merged --base ../models/base   # the base moved since training",
    "memengine merge adapter -o merged --max-shard-size 200MB --json",
))
def merge(
    adapter: Annotated[str, typer.Argument(metavar="ADAPTER", help="A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors).")],
    output: OutOpt,
    base: BaseOpt = None,
    revision: RevisionOpt = None,
    model_type: ModelTypeOpt = None,
    max_shard_size: MaxShardSizeOpt = DEFAULT_MAX_SHARD_SIZE,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
):
    """Fold a LoRA adapter into its base (W + alpha/r x B A) and write the full checkpoint, in the base's dtype."""
    ui = UI(json_mode=json_out, quiet=quiet, verbose=verbose)
    with guard(ui):
        from memengine.engine.lora import merge as merge_adapter

        rep = merge_adapter(adapter, output, base=base, revision=revision, model_type=model_type,
                            max_shard_size=parse_size(max_shard_size), force=force, warn=ui.warn)
        ui.kv(f"merge {adapter} -> {output}", [("base", rep.base), ("rank", rep.r), ("scaling", rep.scaling),
                                               ("merged tensors", len(rep.merged)), ("dtype", rep.dtype)])
        ui.emit({"event": "summary", "output": str(output), "base": rep.base, "r": rep.r, "scaling": rep.scaling,
                 "merged": rep.merged, "dtype": rep.dtype})


# =========================================================================== plot
@app.command(epilog=_examples(
    "memengine plot out                      # writes out/loss.png",
    "memengine plot run-a run-b -o both.png  # two runs in one picture",
    "memengine plot out/checkpoints/step-200",
))
def plot(
    runs: Annotated[list[Path], typer.Argument(metavar="OUT...", help="Run directories (OUT of train or adapt) or "
                                               "their checkpoints.")],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", rich_help_panel="Output", dir_okay=False,
                                                   help="The PNG to write (default: OUT/loss.png of the first "
                                                        "run).")] = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
):
    """Draw the training and validation loss, learning rate and gradient norm of one or several runs against the step (a PNG; matplotlib, the 'plot' extra)."""
    ui = UI(json_mode=json_out, quiet=quiet, verbose=verbose)
    with guard(ui):
        from memengine.engine.app import curves

        hist = []
        for r in runs:
            h = curves.history_of(r)
            if not any(e.get("event") in ("step", "epoch") for e in h):
                raise MemengineError(f"{r}: its history holds no step yet")
            hist.append((str(r), h))
        path = output if output is not None else Path(runs[0]) / curves.PNG_FILE
        curves.plot(hist, path, title=None if len(runs) > 1 else f"{runs[0]}")
        ui.note(f"wrote {path} ({curves.SIZE[0]}x{curves.SIZE[1]}, {len(runs)} run(s))")
        ui.emit({"event": "summary", "output": str(path), "runs": [str(r) for r in runs]})


# =========================================================================== quantize
@app.command(epilog=_examples(
    "memengine quantize tiny-trained -o tiny-f16",
    "memengine quantize model -o model-bf16 --dtype bf16",
    "memengine quantize model --dry-run            # report sizes and errors, write nothing",
    "memengine quantize model -o out --saturate    # clamp values beyond fp16's range",
    "memengine quantize saved-by-hf/model.safetensors.index.json -o out --max-shard-size 500MB",
))
def quantize(
    ckpt: CkptArg,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output checkpoint directory (not needed with --dry-run).")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="Target dtype: f16 (also fp16, float16, half) or bf16 (also bfloat16).")] = "f16",
    saturate: Annotated[bool, typer.Option("--saturate", help="Clamp values beyond the target's finite range instead of failing.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Report what would be written; write nothing.")] = False,
    revision: RevisionOpt = None,
    model_type: ModelTypeOpt = None,
    max_shard_size: MaxShardSizeOpt = DEFAULT_MAX_SHARD_SIZE,
    json_out: JsonOpt = False,
    force: ForceOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
):
    """Convert every floating tensor to fp16 or bf16 (IEEE round-to-nearest-even, bit-exact)."""
    ui = UI(json_mode=json_out, quiet=quiet, verbose=verbose)
    with guard(ui):
        from memengine.engine.io.codec import quantize_target

        d = quantize_target(dtype)
        limit = parse_size(max_shard_size)
        from memengine.engine.io.resolve import resolve_checkpoint

        do_quantize(ui, resolve_checkpoint(ckpt, revision, model_type), output, d, saturate, dry_run, force,
                    max_shard_size=limit)


def do_quantize(ui: UI, ckpt_path, output: Optional[Path], dtype: str, saturate: bool, dry_run: bool,
                force: bool, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> dict:
    from memengine.engine.app.quantize import quantize_checkpoint
    from memengine.engine.app.setup import open_checkpoint
    from memengine.engine.io.resolve import resolve_checkpoint

    ref = resolve_checkpoint(ckpt_path)
    src = ref.spec
    if output is None and not dry_run:
        raise MemengineError("--output is required (or use --dry-run)")
    if not dry_run:
        staging.check_output(output, force, inputs=[("the input checkpoint", ref.path)], on_note=ui.note)
    from memengine.engine.listener import TaskMeter

    with TaskMeter(ui.on_task, f"reading {src}", None):
        c = open_checkpoint(ref, ui.warn)
    if dry_run:
        report = quantize_checkpoint(c, None if output is None else Path(output), dtype=dtype,
                                     saturate=saturate, dry_run=True, on_task=ui.on_task)
    else:
        with staging.staged_output(output, force) as tmp:
            report = quantize_checkpoint(c, tmp, dtype=dtype, saturate=saturate, dry_run=False,
                                         source_name=ref.public_name, max_shard_size=max_shard_size,
                                         on_task=ui.on_task)
    from memengine.engine.runtime import fmt_bytes

    table = [(short_tensor_name(t.name), t.dtype_before, fmt_bytes(t.bytes_before), fmt_bytes(t.bytes_after),
              f"{8 * t.bytes_after / max(1, math.prod(t.shape)):.1f}", f"{t.max_abs_error:.3g}",
              "yes" if t.saturated else "") for t in report.tensors]
    tot_before, tot_after, worst = report.bytes_before, report.bytes_after, report.max_abs_error
    ui.table(f"quantize {src} -> {'(dry run)' if dry_run else output} ({dtype}; tensors as layer.name, "
             "--json for the full names)",
             ["tensor", "from", "before", "after", "bits", "max error", "sat."],
             table, right=[False, False, True, True, True, True, False], result=True)
    ratio = (tot_after / tot_before) if tot_before else float("nan")
    ui.note(f"total {tot_before:,} -> {tot_after:,} bytes ({ratio:.2%}); largest abs error {worst:.3g}"
            + ("; dry run, nothing written" if dry_run else f"; wrote {output}"))
    summary = {"event": "summary", "output": None if dry_run else str(output), "dtype": dtype, "dry_run": dry_run,
               "saturate": saturate, "bytes_before": tot_before, "bytes_after": tot_after,
               "max_abs_error": worst,
               "bits_per_weight": report.bits_per_weight,
               "tensors": [{**asdict(t), "shape": list(t.shape)} for t in report.tensors]}
    ui.emit(summary)
    return summary


# =========================================================================== export
@app.command(epilog=_examples(
    "memengine export tiny-trained -o tiny.gguf                 # f16, as llama.cpp's converter writes by default",
    "memengine export tiny-trained -o tiny-q8.gguf --type q8_0",
    "memengine export note-adapter -o noted.gguf --type f32    # a LoRA adapter: merged into its base first",
    "memengine export model -o model.gguf --force --json | jq .bytes",
))
def export(
    ckpt: CkptArg,
    output: Annotated[Path, typer.Option("--output", "-o", help="The .gguf file to write (replaced only with --force).")],
    type_: Annotated[str, typer.Option("--type", "-t", help="Weight type: f32, f16, bf16, q8_0, q5_1, q5_0, q4_1 or q4_0. "
                                                            "1-D tensors, norms, conv1d, A and D stay f32, as llama.cpp's converter keeps them.")] = "f16",
    revision: RevisionOpt = None,
    model_type: ModelTypeOpt = None,
    base: BaseOpt = None,
    json_out: JsonOpt = False,
    force: ForceOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
):
    """Write a GGUF file that llama.cpp runs (architecture 'mamba', the names and keys of llama.cpp's converter).

    A tokenizer.json beside the checkpoint becomes llama.cpp's gpt2 (byte-level BPE) vocabulary; the built-in byte-level tokenizer is written as vocabulary 'none' (llama.cpp then takes token ids). Models llama.cpp cannot run (expand other than 2, in/out projection biases) are refused before anything is written.
    """
    ui = UI(json_mode=json_out, quiet=quiet, verbose=verbose)
    with guard(ui):
        from memengine.engine.app.export import export_gguf

        last = [time.monotonic()]

        def tensor(k: int, n: int, name: str) -> None:
            ui.debug(f"  [{k}/{n}] {name}")
            if not verbose and time.monotonic() - last[0] > 2.0:  # a large model: a line every few seconds
                ui.note(f"  {k}/{n} tensors converted")
                last[0] = time.monotonic()

        r = export_gguf(ckpt, output, type_, revision=revision, model_type=model_type, base=base, force=force,
                        warn=ui.warn, step=ui.note, on_tensor=tensor)
        counts: dict = {}
        for t in r.tensors:
            counts[t.type] = counts.get(t.type, 0) + 1
        ui.note(f"wrote {r.output}: {len(r.tensors)} tensors ("
                + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + f"), {r.bytes:,} bytes, "
                f"{r.n_params:,} parameters; vocabulary {r.vocab}")
        ui.emit(r.to_dict())


# =========================================================================== generate
run_command(app, GenerateOptions, gen.command, name="generate", help=gen.HELP, epilog=_examples(*gen.EXAMPLES))


# =========================================================================== demo
DEMO_PROMPT = "The lighthouse keeper"
DEMO_SENTENCE = ("The lighthouse keeper of Mirrow Point counted seventeen ships at dawn, "
                 "and wrote each name in the blue ledger. ") * 4


@app.command(epilog=_examples(
    "memengine demo",
    "memengine demo --workdir ./demo-run --epochs 8",
    "memengine demo --device cpu --quiet",
))
def demo(
    workdir: Annotated[Optional[Path], typer.Option("--workdir", "-w", help="Keep the demo's checkpoints here (default: a temporary directory, removed afterwards).")] = None,
    shape: Annotated[str, typer.Option("--shape", help="Model shape to initialise (a built-in config name or file, as for init).")] = "tiny",
    epochs: Annotated[int, typer.Option("--epochs", min=1, help="Training epochs.")] = 6,
    chars: Annotated[int, typer.Option("--chars", min=64, help="How many characters of the bundled text to train on.")] = 4096,
    seq_len: SeqLenOpt = 128,
    batch_size: BatchOpt = 4,
    lr: LrOpt = 3e-3,
    device: DeviceOpt = None,
    backend: BackendOpt = None,
    force: ForceOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
):
    """Run the whole pipeline on built-in defaults (about 10 seconds on a 2-core machine's software GPU).

    Initialises a tiny model, trains it on bundled public-domain text, adapts it to a new sentence (perplexity before and after), quantizes it to fp16, evaluates the fp16 model, and generates a line from the trained and the adapted model side by side.
    """
    ui = UI(json_mode=False, quiet=quiet, verbose=verbose, stdout=sys.stderr)   # a tour: all of it on stderr
    with guard(ui):
        EvalOptions(backend=backend)   # --backend's check, before any work
        do_demo(ui, workdir, shape, epochs, chars, seq_len, batch_size, lr, device, force, verbose, backend)


def demo_text(chars: int) -> str:
    from importlib import resources

    try:
        text = resources.files("memengine.engine").joinpath("data/demo.txt").read_text(encoding="utf-8")
    except (FileNotFoundError, OSError) as e:
        raise MemengineError("the bundled demo text (memengine/engine/data/demo.txt) is missing") from e
    return text[:chars]


DEMO_OUTPUTS = ("base", "trained", "adapted", "model-f16")
DEMO_FILES = ("text.txt", "new-sentence.txt")


def _check_demo_workdir(root: Path) -> None:
    """--force reuses a demo's work directory: it may hold only what the demo writes (its
    four checkpoints, each only memengine's files, and its two text files)."""
    foreign = []
    for e in sorted(root.iterdir(), key=lambda p: p.name):
        if e.name in DEMO_OUTPUTS and e.is_dir() and not e.is_symlink():
            foreign += [f"{e.name}/{f}" for f in staging.foreign_entries(e)]
        elif e.name in DEMO_FILES and e.is_file() and not e.is_symlink():
            continue
        elif not e.name.startswith("."):   # the hidden staging of a killed demo is cleaned by its next run
            foreign.append(e.name + ("/" if e.is_dir() else ""))
        elif not any(e.name.startswith(f".{n}.") for n in DEMO_OUTPUTS):
            foreign.append(e.name + ("/" if e.is_dir() else ""))
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise MemengineError(f"--workdir {root}: holds files the demo did not write ({shown}); --force reuses only "
                             "a demo's own directory: move them away or choose another --workdir")


def do_demo(ui: UI, workdir: Optional[Path], config: str, epochs: int, chars: int, seq_len: int,
            batch_size: int, lr: float, device, force: bool, verbose: bool, backend=None) -> None:
    text = demo_text(chars)
    cleanup = None
    if workdir is None:
        cleanup = tempfile.mkdtemp(prefix="memengine-demo-")
        root = Path(cleanup)
    else:
        root = Path(workdir)
        if root.exists() and not root.is_dir():
            raise MemengineError(f"--workdir {root}: exists and is not a directory")
        if root.exists() and root.is_dir() and any(root.iterdir()):
            if not force:
                raise MemengineError(f"--workdir {root}: directory exists and is not empty (use --force to reuse it)")
            _check_demo_workdir(root)
        root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        base, trained, adapted, f16 = (root / n for n in ("base", "trained", "adapted", "model-f16"))
        sample = root / "text.txt"
        sample.write_text(text, encoding="utf-8")
        note = root / "new-sentence.txt"
        note.write_text(DEMO_SENTENCE, encoding="utf-8")

        ui.step(f"1/6  init a '{config}' model -> {base}")
        do_init(ui, config, base, seed=0, force=True)

        ui.step(f"2/6  train on {len(text):,} characters of the bundled text")
        _train(TrainOptions(ckpt=base, data=[str(sample)], output=trained, epochs=epochs, lr=lr,
                            batch_size=batch_size, seq_len=seq_len, device=device, backend=backend, force=True), ui)

        ui.step("3/6  adapt (WSLA: x_proj only) on a new sentence")
        ui.note(f"  \"{DEMO_SENTENCE.split('. ')[0]}.\"")
        code = _adapt(AdaptOptions(ckpt=trained, data=[str(note)], output=adapted, lr=lr, batch_size=1,
                                   seq_len=seq_len, device=device, backend=backend, force=True), ui)
        if code:
            ui.warn("the demo's adaptation rolled back (the trained model is kept); continuing")

        final = trained
        if code == 0:
            final = adapted
        ui.step(f"4/6  quantize the {final.name} model to fp16")
        do_quantize(ui, final, f16, "f16", False, False, True)

        ui.step("5/6  evaluate the fp16 model against the fp32 one")
        from memengine.engine.app.run import run_eval

        rows = []
        for label, path in ((f"{final.name} (fp32)", final), (f"{final.name} (fp16)", f16)):
            for what, src in (("bundled text", sample), ("new sentence", note)):
                with ui.run_view() as view:
                    r = run_eval(EvalOptions(ckpt=path, data=[str(src)], seq_len=seq_len, device=device,
                                             backend=backend),
                                 view, verbose=verbose).result
                rows.append((label, what, float(r.loss), float(r.perplexity), int(r.tokens)))
        ui.table("fp32 vs fp16", ["model", "data", "loss", "perplexity", "tokens"], rows,
                 right=[False, False, True, True, True])

        ui.step("6/6  generate a line from the trained and the adapted model (greedy, on the GPU)")
        rows = []
        for label, path in ((trained.name, trained), (adapted.name, adapted))[:2 if code == 0 else 1]:
            res = gen.run(GenerateOptions(ckpt=path, prompt=DEMO_PROMPT, max_new_tokens=80, temperature=0,
                                          stop=["\n"], device=device, backend=backend), ui, stream=False)
            rows.append((label, DEMO_PROMPT + res.text, f"{res.tokens_per_s:,.0f}"))
        ui.table(f"continuations of \"{DEMO_PROMPT}\"", ["model", "text", "tokens/s"], rows,
                 right=[False, False, True])
        ui.note(f"demo finished in {time.perf_counter() - t0:.1f}s"
                + ("; its checkpoints were in a temporary directory, now removed (--workdir DIR keeps them)"
                   if cleanup else f"; checkpoints in {root}"))
    finally:
        if cleanup:
            shutil.rmtree(cleanup, ignore_errors=True)


if __name__ == "__main__":  # pragma: no cover - `python -m memengine.cli.main`
    from memengine.cli import main

    main()
