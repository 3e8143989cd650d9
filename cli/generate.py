"""`memengine generate`: rendering; the options are engine/options.py's GenerateOptions and
the work is engine/run.py's `run_generate`.

Human mode: the new text streams to stdout as it is produced (it is the result), followed
by a newline; tokens/s, time to the first token and the stop reason go to stderr.
`--json`: one object on stdout, {"prompt_tokens", "tokens", "text", "stop", "tokens_per_s",
"ttft_s", "elapsed_s"}.  Ctrl-C ends the text where it is (what was generated stays
shown, the JSON object says "stop": "interrupted") with exit status 130 (143 for SIGTERM).
"""

from __future__ import annotations

from memengine.engine.app.options import GenerateOptions

from memengine.engine import interrupts

from .common import interrupt_reported
from .ui import UI

HELP = """Continue a prompt with the model: recurrent decoding on the GPU, the text streamed to stdout.

Generation stops after --max-new-tokens, at the tokenizer's end-of-text token, or at a --stop string. --temperature 0 is greedy; sampling is reproducible with --seed on the same adapter. Ctrl-C stops it, keeping what was generated (exit status 130)."""

EXAMPLES = (
    'memengine generate tiny-trained --prompt "The lighthouse keeper"',
    'memengine generate model --prompt "Once upon a time" --temperature 0 --max-new-tokens 100',
    'echo "Q: what is a ledger?" | memengine generate model --prompt - --stop "Q:" --json | jq -r .text',
    'memengine generate model -p "It was" --temperature 0.7 --top-k 40 --top-p 0.9 --seed 3',
    'memengine generate state-spaces/mamba-130m-hf -p "Mamba is" -n 40   # a model id',
    'memengine generate weights.safetensors --model-type falcon_mamba -p "Hello" -t 0',
    'memengine generate my-adapter -p "Once" -n 40   # a LoRA adapter on its base, not merged',
)


def run(o: GenerateOptions, ui: UI, *, stream: bool = True):
    """Generate and render; returns the result.  stream=False: nothing on stdout and no
    summary (the demo shows the text itself)."""
    from memengine.engine.app.generate import STOP_INTERRUPTED
    from memengine.engine.app.run import run_generate

    show = stream and not ui.json_mode
    out = ui.stdout

    def on_text(piece: str) -> None:
        out.write(piece)
        out.flush()

    with ui.run_view() as view:
        res = run_generate(o, view, verbose=ui.verbose, on_text=on_text if show else None)
    if show:
        out.write("\n")
        out.flush()
    if stream:
        if res.stop != STOP_INTERRUPTED:   # an interrupted one says it in its one error line (`command`)
            ui.note(f"{len(res.tokens)} tokens, {res.tokens_per_s:,.1f} tokens/s, first token after "
                    f"{res.ttft_s:.2f}s ({res.prompt_tokens} prompt tokens), stop: {res.stop}")
        ui.emit(res.summary())
    return res


def command(o: GenerateOptions, ui: UI) -> int:
    from memengine.engine.app.generate import STOP_INTERRUPTED

    res = run(o, ui)
    if res.stop == STOP_INTERRUPTED:
        # one line, and the status of the signal (130 Ctrl-C, 143 SIGTERM)
        ui.error(f"{interrupts.signal_name()} after {len(res.tokens)} tokens ({res.tokens_per_s:,.1f} tokens/s)")
        interrupt_reported()
        return interrupts.signal_exit_code()
    return 0
