"""The `memengine` command line (Typer).

Commands: init, info, eval, train, adapt, quantize, demo.  Human output goes to stderr
through `cli.ui.UI`; `--json` puts JSON lines (and nothing else) on stdout.  Exit status:
0 ok, 1 internal error, 2 bad input or usage, 3 adapt rolled back, 130 interrupted.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Optional

import typer

from memengine.engine.errors import MemengineError
from memengine.engine.shards import DEFAULT_MAX_SHARD_SIZE, parse_size

from .common import (
    EXIT_ROLLED_BACK,
    TRAIN_KEYS,
    BatchOpt,
    Beta1Opt,
    Beta2Opt,
    CkptArg,
    ConfigOpt,
    DataOpt,
    DeviceOpt,
    EpochsOpt,
    EpsOpt,
    ForceOpt,
    JsonOpt,
    LrOpt,
    MaxDeltaOpt,
    MaxGradNormOpt,
    MaxShardSizeOpt,
    ModelTypeOpt,
    OutOpt,
    QuietOpt,
    RevisionOpt,
    SeedOpt,
    SeqLenOpt,
    TokenizerOpt,
    VerboseOpt,
    WeightDecayOpt,
    all_finite,
    check_interrupt,
    check_output,
    deferred_interrupts,
    describe_sources,
    engine_version,
    guard,
    load_batches,
    load_ckpt,
    load_tok,
    make_runtime,
    resolve_ckpt,
    resolve_options,
    staged_output,
    validate_train_options,
    write_json,
)
from .ui import UI

OPTIMIZER_FILE = "optimizer.safetensors"
RUN_FILE = "memengine.json"

app = typer.Typer(
    name="memengine",
    help="Fine-tune (train) and narrowly adapt (adapt, WSLA) Mamba-1 models with WGSL compute "
         "shaders on any WebGPU adapter; convert checkpoints to fp16/bf16 (quantize).",
    epilog="Run 'memengine demo' for a two-minute tour on built-in defaults. "
           "Exit status: 0 ok, 1 internal error, 2 bad input or usage, 3 adapt rolled back.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _examples(*lines: str) -> str:
    """An epilog listing examples (one per line in --help)."""
    return "[bold]Examples[/bold]\n\n" + "\n\n".join(f"  $ {ln}" for ln in lines)


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


# =========================================================================== helpers
def _trainer_mod():
    from memengine.engine import trainer

    return trainer


def _load_optimizer_state(ckpt, ui: UI) -> dict | None:
    p = ckpt.extra.get("optimizer_path")
    if p is None:
        return None
    from safetensors.numpy import load_file

    try:
        state = load_file(str(p))
    except Exception as e:
        raise MemengineError(f"{p}: cannot read optimizer state ({str(e).splitlines()[0] if str(e) else e})") from e
    ui.note(f"resuming optimizer state from {p} ({sum(1 for k in state if k.endswith('.exp_avg'))} moments)")
    return state


def _save_optimizer_state(out_dir: Path, state: dict | None) -> None:
    if not state:
        return
    import numpy as np
    from safetensors.numpy import save_file

    arrays = {k: np.ascontiguousarray(v) for k, v in state.items()}
    save_file(arrays, str(out_dir / OPTIMIZER_FILE), metadata={"format": "memengine-adamw"})


def _tokenizer_file(tok) -> Optional[Path]:
    """The tokenizer.json actually used (copied into OUT), or None for byte-level."""
    p = getattr(tok, "path", None)
    return Path(p) if p else None


def _epoch_event(s) -> dict:
    return {"event": "epoch", "epoch": int(s.epoch), "loss": float(s.loss), "grad_norm": float(s.grad_norm),
            "tokens": int(s.tokens), "tokens_per_s": float(s.tokens_per_s), "elapsed_s": float(s.elapsed_s)}


def _fit_view(ui: UI, title: str, epochs: int):
    """The epoch table plus callbacks that also emit JSON epoch events."""
    view = ui.epochs(title, epochs)

    def on_epoch(s):
        view.on_epoch(s)
        ui.emit(_epoch_event(s))
        check_interrupt()

    def on_progress(step, total):
        view.on_progress(step, total)
        check_interrupt()

    return view, on_epoch, on_progress


def _write_model(out_tmp: Path, ckpt, tensors: dict, tokenizer: Optional[Path], max_shard_size: str,
                 metadata: dict | None = None) -> None:
    from memengine.engine.checkpoint import save_checkpoint, side_files

    bad = all_finite(tensors)
    if bad is not None:
        from memengine.engine.errors import NonFiniteError

        raise NonFiniteError(f"tensor {bad} holds NaN/Inf after training; nothing was written")
    save_checkpoint(out_tmp, ckpt.config, tensors, dtype="F32", tokenizer_path=tokenizer,
                    extra_files=side_files(ckpt.directory, tokenizer.parent if tokenizer else None),
                    metadata={"producer": f"memengine {engine_version()}", **(metadata or {})},
                    max_shard_size=max_shard_size)


def _run_record(command: str, ckpt_path, data: list[str], options: dict, rt, extra: dict) -> dict:
    from memengine.engine.resolve import public_path

    # no absolute local path in an output: a model id, a relative path as given, else a base name
    return {
        "memengine_version": engine_version(),
        "command": command,
        "input": resolve_ckpt(ckpt_path).public_name,
        "data": [public_path(d) for d in data],
        "options": options,
        "adapter": rt.describe(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **extra,
    }


# =========================================================================== init
@app.command(epilog=_examples(
    "memengine init tiny -o tiny-model",
    "memengine init small -o small-model --seed 3",
    "memengine init my-config.yaml -o model --force",
    "memengine init mamba-130m -o m130 --max-shard-size 200MB   # transformers-style shards",
))
def init(
    config: Annotated[str, typer.Argument(metavar="CONFIG", help="Built-in config name (tiny, small, mamba-130m) or a JSON/YAML file of MambaConfig keys.")],
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
        parse_size(max_shard_size)
        do_init(ui, config, output, seed, force, max_shard_size)


def do_init(ui: UI, config: str, output: Path, seed: int, force: bool,
            max_shard_size: str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    from memengine.engine.checkpoint import save_checkpoint
    from memengine.engine.config import expected_shapes, load_config
    from memengine.engine.init import init_weights

    check_output(output, force)
    cfg = load_config(config)
    tensors = init_weights(cfg, seed)
    n_params = int(sum(int(a.size) for a in tensors.values()))
    with staged_output(output, force) as tmp:
        save_checkpoint(tmp, cfg, tensors, dtype="F32", max_shard_size=max_shard_size,
                        metadata={"producer": f"memengine {engine_version()}", "seed": str(seed)})
    shapes = expected_shapes(cfg)
    ui.kv(f"initialised {output}", [
        ("config", config),
        ("layers", cfg.num_hidden_layers),
        ("hidden size", cfg.hidden_size),
        ("state size", cfg.state_size),
        ("vocabulary", cfg.vocab_size),
        ("tensors", len(shapes)),
        ("parameters", f"{n_params:,}"),
        ("seed", seed),
    ])
    ui.emit({"event": "summary", "output": str(output), "parameters": n_params, "tensors": len(tensors),
             "config": config, "seed": seed})
    return output


# =========================================================================== info
@app.command(epilog=_examples(
    "memengine info tiny-model",
    "memengine info model/model.safetensors --json | jq .parameters",
    "memengine info state-spaces/mamba-130m-hf                # a model id (local cache, else download)",
    "memengine info my-org/my-mamba --revision v1.0            # a tag, branch or commit",
    "memengine info weights.safetensors --model-type falcon_mamba",
))
def info(
    ckpt: CkptArg,
    revision: RevisionOpt = None,
    model_type: ModelTypeOpt = None,
    json_out: JsonOpt = False,
    device: DeviceOpt = None,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
):
    """Show a checkpoint's config, parameter count, dtypes and size, and the GPU adapter."""
    ui = UI(json_mode=json_out, quiet=quiet, verbose=verbose)
    with guard(ui):
        ref = resolve_ckpt(ckpt, revision, model_type)
        c = load_ckpt(ref, ui)
        cfg = c.config
        n_params = int(sum(int(a.size) for a in c.tensors.values()))
        dtypes: dict[str, int] = {}
        for name in c.tensors:
            dt = str(c.dtypes.get(name, "F32")) if getattr(c, "dtypes", None) else "F32"
            dtypes[dt] = dtypes.get(dt, 0) + 1
        weight_files = c.extra.get("weight_files", [])
        files = weight_files if ref.path.is_file() else sorted(p for p in ref.path.iterdir() if p.is_file())
        nbytes = int(sum(p.stat().st_size for p in files))
        try:
            from memengine.engine.gpu import get_runtime

            rt = get_runtime(device or None, verbose=verbose)
            adapter, caps = rt.describe(), rt.capabilities()
        except MemengineError as e:
            adapter, caps = f"none ({e})", None
        tok = getattr(c, "tokenizer_path", None)
        ui.kv(f"checkpoint {ckpt}", [
            ("model type", cfg.model_type),
            ("weights", weight_files[0].name if len(weight_files) == 1 else
             f"{len(weight_files)} shards ({c.extra['model_file'].name})"),
            *([("local path", str(ref.path))] if ref.repo_id else []),
            ("layers", cfg.num_hidden_layers),
            ("hidden size (E)", cfg.hidden_size),
            ("inner size (Di)", cfg.intermediate_size),
            ("state size (N)", cfg.state_size),
            ("conv kernel (K)", cfg.conv_kernel),
            ("dt rank (R)", cfg.dt_rank),
            ("vocabulary (V)", cfg.vocab_size),
            ("tied lm_head", cfg.tie_word_embeddings),
            ("biases", f"use_bias={cfg.use_bias} use_conv_bias={cfg.use_conv_bias}"),
            ("tensors", len(c.tensors)),
            ("parameters", f"{n_params:,}"),
            ("dtypes", ", ".join(f"{k}x{v}" for k, v in sorted(dtypes.items()))),
            ("size on disk", f"{nbytes:,} bytes"),
            ("tokenizer", str(tok) if tok else "byte-level (built-in)"),
            ("optimizer state", "yes" if c.extra.get("optimizer_path") else "no"),
            ("adapter", adapter),
            ("GPU features", "n/a" if caps is None else
             f"{', '.join(caps['features']) or 'none'}; largest binding "
             f"{caps['max_storage_binding_bytes'] / 2**20:,.0f} MiB"),
        ])
        if json_out:
            ui.emit({
                "path": str(ckpt),
                "local_path": str(ref.path),
                "model_type": cfg.model_type,
                "weight_files": [p.name for p in weight_files],
                "config": cfg.to_hf_dict(),
                "parameters": n_params,
                "tensors": {n: {"shape": list(a.shape), "dtype": str(c.dtypes.get(n, "F32")) if c.dtypes else "F32"}
                            for n, a in c.tensors.items()},
                "dtypes": dtypes,
                "bytes": nbytes,
                "tokenizer": str(tok) if tok else None,
                "adapter": adapter,
                "gpu": caps,
            })


# =========================================================================== eval
@app.command(name="eval", epilog=_examples(
    "memengine eval tiny-model --data notes.txt",
    "cat notes.txt | memengine eval tiny-model --data - --json",
    "memengine eval model --data a.txt --data b.jsonl --seq-len 256 --batch-size 4",
    "memengine eval state-spaces/mamba-130m-hf --data notes.txt   # a model id",
    "memengine eval weights.safetensors --model-type falcon_mamba --data notes.txt",
))
def eval_cmd(
    ckpt: CkptArg,
    data: DataOpt = [],  # noqa: B006 (typer reads it)
    seq_len: SeqLenOpt = 512,
    batch_size: BatchOpt = 1,
    revision: RevisionOpt = None,
    model_type: ModelTypeOpt = None,
    json_out: JsonOpt = False,
    device: DeviceOpt = None,
    tokenizer: TokenizerOpt = None,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
):
    """Mean next-token loss and perplexity of a checkpoint on some text."""
    ui = UI(json_mode=json_out, quiet=quiet, verbose=verbose)
    with guard(ui):
        res = do_eval(ui, resolve_ckpt(ckpt, revision, model_type), list(data), seq_len, batch_size, device,
                      tokenizer, verbose)
        ui.emit({"loss": float(res.loss), "perplexity": float(res.perplexity), "tokens": int(res.tokens)})


def do_eval(ui: UI, ckpt_path, data: list[str], seq_len: int, batch_size: int,
            device: Optional[str], tokenizer: Optional[str], verbose: bool, text: str | None = None,
            quiet_table: bool = False):
    from memengine.engine.model import MambaModel

    if not data and text is None:
        raise MemengineError("--data is required (a file, several files, or - for stdin)")
    c = load_ckpt(ckpt_path, ui)
    tok = load_tok(ckpt_path, tokenizer, c)
    batches, n_tokens = load_batches(data, tok, c.config.vocab_size, seq_len, batch_size, text=text)
    rt = make_runtime(device, verbose, ui)
    model = MambaModel.from_checkpoint(rt, c)
    t0 = time.perf_counter()
    with ui.eval_progress("eval") as prog, deferred_interrupts():
        def on_progress(step, total):
            prog(step, total)
            check_interrupt()

        res = _trainer_mod().evaluate(model, batches, on_progress=on_progress)
    dt = time.perf_counter() - t0
    if quiet_table:
        return res
    ui.kv(f"eval {ckpt_path} on {describe_sources(data) if data else 'text'}", [
        ("loss", float(res.loss)),
        ("perplexity", float(res.perplexity)),
        ("tokens", int(res.tokens)),
        ("elapsed", f"{dt:.1f}s"),
    ])
    return res


# =========================================================================== train
@app.command(epilog=_examples(
    "memengine train tiny-model --data book.txt -o tiny-trained",
    "memengine train tiny-model --data book.txt -o out --epochs 20 --lr 3e-3 --seq-len 128",
    "cat notes.txt | memengine train model --data - -o out --json > log.jsonl",
    "memengine train model --data book.txt -o out --config train.yaml --lr 1e-3   # flag beats file",
    "memengine train state-spaces/mamba-130m-hf --data book.txt -o out --max-shard-size 200MB",
))
def train(
    ctx: typer.Context,
    ckpt: CkptArg,
    output: OutOpt,
    data: DataOpt = [],  # noqa: B006
    epochs: EpochsOpt = 5,
    lr: LrOpt = 1e-4,
    batch_size: BatchOpt = 1,
    seq_len: SeqLenOpt = 512,
    max_grad_norm: MaxGradNormOpt = 1.0,
    weight_decay: WeightDecayOpt = 0.01,
    max_delta: MaxDeltaOpt = 0.0,
    beta1: Beta1Opt = 0.9,
    beta2: Beta2Opt = 0.999,
    eps: EpsOpt = 1e-8,
    seed: SeedOpt = 0,
    config: ConfigOpt = None,
    revision: RevisionOpt = None,
    model_type: ModelTypeOpt = None,
    max_shard_size: MaxShardSizeOpt = DEFAULT_MAX_SHARD_SIZE,
    json_out: JsonOpt = False,
    device: DeviceOpt = None,
    tokenizer: TokenizerOpt = None,
    force: ForceOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
):
    """Fine-tune every parameter (full backprop on the GPU, AdamW, global grad-norm clipping).

    Resumes the optimizer moments from optimizer.safetensors beside CKPT when present, and writes the new model, its optimizer state and memengine.json (resolved options, version, adapter) to OUT. A --config file may set any training option; flags given on the command line win.
    """
    ui = UI(json_mode=json_out, quiet=quiet, verbose=verbose)
    with guard(ui):
        values = dict(epochs=epochs, lr=lr, batch_size=batch_size, seq_len=seq_len, max_grad_norm=max_grad_norm,
                      weight_decay=weight_decay, max_delta=max_delta, beta1=beta1, beta2=beta2, eps=eps, seed=seed)
        opts = resolve_options(ctx, values, config, TRAIN_KEYS)
        validate_train_options(opts)
        parse_size(max_shard_size)
        do_train(ui, resolve_ckpt(ckpt, revision, model_type), list(data), output, opts, device, tokenizer, force,
                 verbose, max_shard_size=max_shard_size)


def _prepare_run(ui: UI, ckpt_path, data: list[str], output: Path, opts: dict, device, tokenizer,
                 force: bool, verbose: bool, text: str | None):
    """What train and adapt share: check OUT, load checkpoint, tokenizer, data, optimizer
    state, and put the model on the GPU."""
    from memengine.engine.model import MambaModel

    if not data and text is None:
        raise MemengineError("--data is required (a file, several files, or - for stdin)")
    ckpt_path = resolve_ckpt(ckpt_path)
    check_output(output, force, inputs=(ckpt_path.path,))
    c = load_ckpt(ckpt_path, ui)
    tok = load_tok(ckpt_path, tokenizer, c)
    batches, n_tokens = load_batches(data, tok, c.config.vocab_size, opts["seq_len"], opts["batch_size"], text=text)
    opt_state = _load_optimizer_state(c, ui)
    rt = make_runtime(device, verbose, ui)
    model = MambaModel.from_checkpoint(rt, c)
    return c, tok, batches, n_tokens, opt_state, rt, model


def do_train(ui: UI, ckpt_path, data: list[str], output: Path, opts: dict, device, tokenizer,
             force: bool, verbose: bool, text: str | None = None,
             max_shard_size: str = DEFAULT_MAX_SHARD_SIZE) -> dict:
    tr = _trainer_mod()
    c, tok, batches, n_tokens, opt_state, rt, model = _prepare_run(
        ui, ckpt_path, data, output, opts, device, tokenizer, force, verbose, text)
    options = tr.TrainOptions(**opts, wsla=False)
    ui.note(f"training {len(model.trainable_names(False))} tensors on {n_tokens:,} tokens "
            f"({len(batches)} step(s)/epoch) for {options.epochs} epoch(s)")
    trainer = tr.Trainer(model, options, opt_state)
    view, on_epoch, on_progress = _fit_view(ui, f"train {ckpt_path} -> {output}", options.epochs)
    t0 = time.perf_counter()
    with view, deferred_interrupts():
        stats = trainer.fit(batches, on_epoch=on_epoch, on_progress=on_progress)
    elapsed = time.perf_counter() - t0
    state = model.state_dict()
    new_opt = trainer.optimizer_state()
    final_loss = float(stats[-1].loss) if stats else float("nan")
    record = _run_record("train", ckpt_path, data, dict(opts), rt, {
        "final_loss": final_loss,
        "epochs": [_epoch_event(s) for s in stats],
    })
    with staged_output(output, force) as tmp:
        _write_model(tmp, c, state, _tokenizer_file(tok), max_shard_size)
        _save_optimizer_state(tmp, new_opt)
        write_json(tmp / "memengine.json", record)
    summary = {"event": "summary", "output": str(output), "final_loss": final_loss,
               "first_loss": float(stats[0].loss) if stats else float("nan"),
               "epochs": len(stats), "tokens": int(sum(s.tokens for s in stats)),
               "elapsed_s": elapsed, "adapter": rt.describe()}
    ui.note(f"wrote {output} (final loss {final_loss:.4f}, {elapsed:.1f}s)")
    ui.emit(summary)
    return summary


# =========================================================================== adapt
@app.command(epilog=_examples(
    "memengine adapt tiny-trained --data note.txt -o adapted",
    "echo 'The lighthouse keeper counts ships at dawn.' | memengine adapt tiny-trained --data - -o adapted",
    "memengine adapt model --data note.txt -o out --lr 1e-3 --tolerance 1.1 --json",
    "memengine adapt model --data note.txt -o out --no-rollback   # keep the result even if worse",
    "memengine adapt state-spaces/mamba-130m-hf --data note.txt -o out --max-shard-size 200MB",
))
def adapt(
    ctx: typer.Context,
    ckpt: CkptArg,
    output: OutOpt,
    data: DataOpt = [],  # noqa: B006
    max_delta: MaxDeltaOpt = 0.05,
    epochs: EpochsOpt = 3,
    lr: LrOpt = 1e-4,
    tolerance: Annotated[float, typer.Option(
        "--tolerance", rich_help_panel="Training",
        help="Roll back when perplexity after > before x this.")] = 1.25,
    no_rollback: Annotated[bool, typer.Option(
        "--no-rollback", rich_help_panel="Training",
        help="Keep (and write) the adapted weights even when perplexity regressed.")] = False,
    seq_len: SeqLenOpt = 512,
    weight_decay: WeightDecayOpt = 0.01,
    batch_size: BatchOpt = 1,
    max_grad_norm: MaxGradNormOpt = 1.0,
    beta1: Beta1Opt = 0.9,
    beta2: Beta2Opt = 0.999,
    eps: EpsOpt = 1e-8,
    seed: SeedOpt = 0,
    config: ConfigOpt = None,
    revision: RevisionOpt = None,
    model_type: ModelTypeOpt = None,
    max_shard_size: MaxShardSizeOpt = DEFAULT_MAX_SHARD_SIZE,
    json_out: JsonOpt = False,
    device: DeviceOpt = None,
    tokenizer: TokenizerOpt = None,
    force: ForceOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
):
    """Adapt only each layer's x_proj (WSLA) with a trust region, rolling back on regression.

    Perplexity on the adapt text is measured before and after. If a loss is non-finite or perplexity after exceeds before x --tolerance, the weights are restored, nothing is written, and the exit status is 3. Every tensor except x_proj is written bit-identical.
    """
    ui = UI(json_mode=json_out, quiet=quiet, verbose=verbose)
    with guard(ui):
        values = dict(epochs=epochs, lr=lr, batch_size=batch_size, seq_len=seq_len, max_grad_norm=max_grad_norm,
                      weight_decay=weight_decay, max_delta=max_delta, beta1=beta1, beta2=beta2, eps=eps, seed=seed,
                      tolerance=tolerance)
        opts = resolve_options(ctx, values, config, TRAIN_KEYS + ("tolerance",))
        validate_train_options(opts)
        parse_size(max_shard_size)
        code = do_adapt(ui, resolve_ckpt(ckpt, revision, model_type), list(data), output, opts, not no_rollback,
                        device, tokenizer, force, verbose, max_shard_size=max_shard_size)
    if code:
        raise typer.Exit(code)


def do_adapt(ui: UI, ckpt_path, data: list[str], output: Path, opts: dict, rollback: bool, device,
             tokenizer, force: bool, verbose: bool, text: str | None = None,
             max_shard_size: str = DEFAULT_MAX_SHARD_SIZE) -> int:
    """Returns the exit status (0, or 3 when rolled back)."""
    from memengine.engine.adapt import adapt as run_adapt

    tr = _trainer_mod()
    opts = dict(opts)
    tolerance = float(opts.pop("tolerance", 1.25))
    c, tok, batches, n_tokens, opt_state, rt, model = _prepare_run(
        ui, ckpt_path, data, output, opts, device, tokenizer, force, verbose, text)
    trainable = model.trainable_names(True)
    options = tr.TrainOptions(**opts, wsla=True)
    ui.note(f"adapting {len(trainable)} x_proj tensor(s) on {n_tokens:,} tokens, max delta {options.max_delta:g}, "
            f"tolerance x{tolerance:g}")
    view, on_epoch, on_progress = _fit_view(ui, f"adapt (WSLA) {ckpt_path} -> {output}", options.epochs)
    eval_prog = {}

    def on_eval(phase, step, total):
        if phase not in eval_prog:
            for p in eval_prog.values():
                p.__exit__(None, None, None)
            eval_prog[phase] = ui.eval_progress(f"perplexity {phase}").__enter__()
        eval_prog[phase](step, total)
        check_interrupt()

    t0 = time.perf_counter()
    try:
        with view, deferred_interrupts():
            res = run_adapt(model, batches, options, opt_state, tolerance=tolerance, rollback=rollback,
                            on_epoch=on_epoch, on_progress=on_progress, on_eval=on_eval)
    finally:
        for p in eval_prog.values():
            p.__exit__(None, None, None)
    elapsed = time.perf_counter() - t0
    summary = {"event": "summary", **res.summary(), "output": None if res.rolled_back else str(output),
               "epochs": len(res.epochs), "tokens": n_tokens, "elapsed_s": elapsed, "adapter": rt.describe()}
    ui.kv("adapt summary", [
        ("perplexity before", res.perplexity_before),
        ("perplexity after", res.perplexity_after),
        ("mean grad norm", res.grad_norm),
        ("changed tensors", len(res.changed_tensors)),
        ("max |delta|", res.max_abs_delta),
        ("rolled back", res.rolled_back),
        ("reason", res.reason),
    ])
    if res.rolled_back:
        ui.emit(summary)
        ui.error(f"adaptation rolled back: {res.reason}; nothing was written")
        return EXIT_ROLLED_BACK
    # Frozen tensors are taken from the model, which adapt() has checked are bit-identical
    # to what was loaded; x_proj tensors carry the adaptation.
    state = model.state_dict()
    record = _run_record("adapt", ckpt_path, data, {**opts, "tolerance": tolerance, "rollback": rollback}, rt,
                         {"result": res.summary(), "epochs": [_epoch_event(s) for s in res.epochs]})
    with staged_output(output, force) as tmp:
        _write_model(tmp, c, state, _tokenizer_file(tok), max_shard_size)
        _save_optimizer_state(tmp, res.optimizer_state)
        write_json(tmp / "memengine.json", record)
    ui.note(f"wrote {output} ({elapsed:.1f}s)")
    ui.emit(summary)
    return 0


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
    dtype: Annotated[str, typer.Option("--dtype", help="Target dtype: f16 or bf16.")] = "f16",
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
        d = dtype.lower()
        if d not in ("f16", "bf16"):
            raise MemengineError(f"--dtype {dtype}: must be f16 or bf16")
        parse_size(max_shard_size)
        do_quantize(ui, resolve_ckpt(ckpt, revision, model_type), output, d, saturate, dry_run, force,
                    max_shard_size=max_shard_size)


def do_quantize(ui: UI, ckpt_path, output: Optional[Path], dtype: str, saturate: bool, dry_run: bool,
                force: bool, max_shard_size: str = DEFAULT_MAX_SHARD_SIZE) -> dict:
    from memengine.engine.quantize import quantize_checkpoint

    ref = resolve_ckpt(ckpt_path)
    src = ref.spec
    if output is None and not dry_run:
        raise MemengineError("--output is required (or use --dry-run)")
    if not dry_run:
        check_output(output, force, inputs=(ref.path,))
    c = load_ckpt(ref, ui)
    if dry_run:
        report = quantize_checkpoint(c, None if output is None else Path(output), dtype=dtype,
                                     saturate=saturate, dry_run=True)
    else:
        with staged_output(output, force) as tmp:
            report = quantize_checkpoint(c, tmp, dtype=dtype, saturate=saturate, dry_run=False,
                                         source_name=ref.public_name, max_shard_size=max_shard_size)
    table = [(t.name, t.dtype_before, t.dtype_after, f"{t.bytes_before:,}", f"{t.bytes_after:,}",
              f"{8 * t.bytes_after / max(1, math.prod(t.shape)):.1f}", t.max_abs_error,
              "yes" if t.saturated else "") for t in report.tensors]
    tot_before, tot_after, worst = report.bytes_before, report.bytes_after, report.max_abs_error
    ui.table(f"quantize {src} -> {'(dry run)' if dry_run else output} ({dtype})",
             ["tensor", "from", "to", "bytes before", "bytes after", "bits/weight", "max abs error", "saturated"],
             table, right=[False, False, False, True, True, True, True, False])
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


# =========================================================================== demo
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
    force: ForceOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
):
    """Run the whole pipeline on built-in defaults (about 1-3 minutes on a software GPU).

    Initialises a tiny model, trains it on bundled public-domain text, adapts it to a new sentence (perplexity before and after), quantizes it to fp16 and evaluates the fp16 model.
    """
    ui = UI(json_mode=False, quiet=quiet, verbose=verbose)
    with guard(ui):
        do_demo(ui, workdir, shape, epochs, chars, seq_len, batch_size, lr, device, force, verbose)


def demo_text(chars: int) -> str:
    from importlib import resources

    try:
        text = resources.files("memengine.engine").joinpath("data/demo.txt").read_text(encoding="utf-8")
    except (FileNotFoundError, OSError) as e:
        raise MemengineError("the bundled demo text (memengine/engine/data/demo.txt) is missing") from e
    return text[:chars]


def do_demo(ui: UI, workdir: Optional[Path], config: str, epochs: int, chars: int, seq_len: int,
            batch_size: int, lr: float, device, force: bool, verbose: bool) -> None:
    text = demo_text(chars)
    cleanup = None
    if workdir is None:
        cleanup = tempfile.mkdtemp(prefix="memengine-demo-")
        root = Path(cleanup)
    else:
        root = Path(workdir)
        if root.exists() and root.is_dir() and any(root.iterdir()) and not force:
            raise MemengineError(f"--workdir {root}: directory exists and is not empty (use --force to reuse it)")
        root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        base, trained, adapted, f16 = (root / n for n in ("base", "trained", "adapted", "model-f16"))
        sample = root / "text.txt"
        sample.write_text(text, encoding="utf-8")
        note = root / "new-sentence.txt"
        note.write_text(DEMO_SENTENCE, encoding="utf-8")

        ui.step(f"1/5  init a '{config}' model -> {base}")
        do_init(ui, config, base, seed=0, force=True)

        ui.step(f"2/5  train on {len(text):,} characters of the bundled text")
        topts = dict(epochs=epochs, lr=lr, batch_size=batch_size, seq_len=seq_len, max_grad_norm=1.0,
                     weight_decay=0.01, max_delta=0.0, beta1=0.9, beta2=0.999, eps=1e-8, seed=0)
        do_train(ui, base, [str(sample)], trained, topts, device, None, True, verbose)

        ui.step("3/5  adapt (WSLA: x_proj only) on a new sentence")
        ui.note(f"  \"{DEMO_SENTENCE.split('. ')[0]}.\"")
        aopts = dict(topts, epochs=3, lr=lr, max_delta=0.05, tolerance=1.25, batch_size=1)
        code = do_adapt(ui, trained, [str(note)], adapted, aopts, True, device, None, True, verbose)
        if code:
            ui.warn("the demo's adaptation rolled back (the trained model is kept); continuing")

        final = trained
        if code == 0:
            final = adapted
        ui.step(f"4/5  quantize the {final.name} model to fp16")
        do_quantize(ui, final, f16, "f16", False, False, True)

        ui.step("5/5  evaluate the fp16 model against the fp32 one")
        rows = []
        for label, path in ((f"{final.name} (fp32)", final), (f"{final.name} (fp16)", f16)):
            for what, src in (("bundled text", sample), ("new sentence", note)):
                r = do_eval(ui, path, [str(src)], seq_len, 1, device, None, verbose, quiet_table=True)
                rows.append((label, what, float(r.loss), float(r.perplexity), int(r.tokens)))
        ui.table("fp32 vs fp16", ["model", "data", "loss", "perplexity", "tokens"], rows,
                 right=[False, False, True, True, True])
        ui.note(f"demo finished in {time.perf_counter() - t0:.1f}s"
                + ("" if cleanup else f"; checkpoints in {root}"))
    finally:
        if cleanup:
            shutil.rmtree(cleanup, ignore_errors=True)


def main() -> None:  # pragma: no cover - `python -m memengine.cli.main`
    app(prog_name="memengine")


if __name__ == "__main__":  # pragma: no cover
    main()
