"""`memengine generate`: option parsing and rendering; the work is engine/generate.py.

Human mode: the new text streams to stdout as it is produced (it is the result), followed
by a newline; tokens/s, time to the first token and the stop reason go to stderr.
`--json`: one object on stdout, {"prompt_tokens", "tokens", "text", "stop", "tokens_per_s",
"ttft_s", "elapsed_s"}.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from memengine.engine.generate import GenerateOptions

from .common import (
    CkptArg,
    DeviceOpt,
    JsonOpt,
    ModelTypeOpt,
    QuietOpt,
    RevisionOpt,
    TokenizerOpt,
    VerboseOpt,
    check_interrupt,
    deferred_interrupts,
    guard,
    load_ckpt,
    load_tok,
    make_runtime,
    resolve_ckpt,
)
from .ui import UI

_H = GenerateOptions.help
_D = GenerateOptions.default
_PANEL = "Generation"

EXAMPLES = (
    'memengine generate tiny-trained --prompt "The lighthouse keeper"',
    'memengine generate model --prompt "Once upon a time" --temperature 0 --max-new-tokens 100',
    'echo "Q: what is a ledger?" | memengine generate model --prompt - --stop "Q:" --json | jq -r .text',
    'memengine generate model -p "It was" --temperature 0.7 --top-k 40 --top-p 0.9 --seed 3',
)


def generate_command(
    ckpt: CkptArg,
    prompt: Annotated[str, typer.Option("--prompt", "-p", show_default=False, rich_help_panel=_PANEL,
                                        help="The text to continue, or - to read it from stdin. It is tokenized "
                                             "as eval tokenizes data (no special tokens).")],
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", rich_help_panel=_PANEL,
                                                help=_H("max_new_tokens"))] = _D("max_new_tokens"),
    temperature: Annotated[float, typer.Option("--temperature", "-t", rich_help_panel=_PANEL,
                                               help=_H("temperature"))] = _D("temperature"),
    top_k: Annotated[int, typer.Option("--top-k", rich_help_panel=_PANEL, help=_H("top_k"))] = _D("top_k"),
    top_p: Annotated[float, typer.Option("--top-p", rich_help_panel=_PANEL, help=_H("top_p"))] = _D("top_p"),
    seed: Annotated[int, typer.Option("--seed", rich_help_panel=_PANEL, help=_H("seed"))] = _D("seed"),
    stop: Annotated[Optional[list[str]], typer.Option("--stop", metavar="TEXT", rich_help_panel=_PANEL,
                                                      show_default=False, help=_H("stop"))] = None,
    revision: RevisionOpt = None,
    model_type: ModelTypeOpt = None,
    json_out: JsonOpt = False,
    device: DeviceOpt = None,
    tokenizer: TokenizerOpt = None,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
):
    """Continue a prompt with the model: recurrent decoding on the GPU, the text streamed to stdout.

    Generation stops after --max-new-tokens, at the tokenizer's end-of-text token, or at a --stop string. --temperature 0 is greedy; sampling is reproducible with --seed on the same adapter.
    """
    ui = UI(json_mode=json_out, quiet=quiet, verbose=verbose)
    with guard(ui):
        opts = GenerateOptions(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                               seed=seed, stop=tuple(stop or ()))
        do_generate(ui, resolve_ckpt(ckpt, revision, model_type), prompt, opts, device, tokenizer, verbose)


def do_generate(ui: UI, ckpt_path, prompt: str, opts: GenerateOptions, device: Optional[str],
                tokenizer: Optional[str], verbose: bool, stream: bool = True):
    """Load, generate, render.  stream=False: nothing on stdout, no summary line (the demo)."""
    from memengine.engine.generate import generate_text, read_prompt
    from memengine.engine.model import MambaModel

    text = read_prompt(prompt)
    c = load_ckpt(ckpt_path, ui)
    tok = load_tok(ckpt_path, tokenizer, c)
    rt = make_runtime(device, verbose, ui)
    model = MambaModel.from_checkpoint(rt, c)
    out = ui.stdout
    show = stream and not ui.json_mode

    def on_text(piece: str) -> None:
        out.write(piece)
        out.flush()

    with deferred_interrupts():
        res = generate_text(model, tok, text, opts, checkpoint_dir=c.directory, on_text=on_text if show else None,
                            on_token=lambda _tok: check_interrupt())
    if show:
        out.write("\n")
        out.flush()
    if stream:
        ui.note(f"{len(res.tokens)} tokens, {res.tokens_per_s:,.1f} tokens/s, first token after "
                f"{res.ttft_s:.2f}s ({res.prompt_tokens} prompt tokens), stop: {res.stop}")
        ui.emit(res.summary())
    return res
