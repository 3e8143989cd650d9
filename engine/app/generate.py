"""Text generation: recurrent decoding on the GPU, one O(1) step per layer and token.

The prompt runs once through the sequence kernels (`LanguageModel.record_forward`, B = 1),
which leaves every layer's activations; the architecture's block turns them into each
layer's recurrent state right after that layer (`Block.decode_prefill`; for Mamba-1 the
last K-1 conv inputs and the SSM state after the last position, engine/kernels/decode.py).
Every new token is then one step: embedding, per layer the block's `decode_step` (Mamba-1:
rmsnorm -> in_proj -> conv step -> x_proj -> selective state update -> out_proj onto the
residual), final norm, LM head, and the sampler, all on the GPU.  The sampled token
stays on the GPU (the next step embeds it from there); the host reads back 4 bytes per
token, one step behind the GPU (step t+1 is queued before token t is read), to stream the
text and check the stop conditions.

Nothing is allocated per token: the step's buffers, bind groups and uniforms are made once
(`Decoder`) and the step's dispatches are recorded once into a `Program` that each token
replays into a fresh command encoder (WebGPU has no reusable compute command buffers).

The engine reports through callbacks (`on_text` with text that is safe to show, `on_token`
with each id); it never prints.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from memengine.engine.app.options import SamplingOptions
from memengine.engine.errors import MemengineError
from memengine.engine.io.inputs import decode_utf8, read_json
from memengine.engine.kernels.decode import matvec, sample
from memengine.engine.kernels.embedding import embedding_forward
from memengine.engine.kernels.lora import scale_
from memengine.engine.kernels.rmsnorm import rmsnorm_forward
from memengine.engine.runtime import BindingError, Program, Tensor

STOP_LENGTH, STOP_EOS, STOP_TEXT, STOP_INTERRUPTED = "length", "eos", "stop", "interrupted"


@dataclass
class GenerateResult:
    prompt_tokens: int
    tokens: list           # new token ids (an EOS id that ended the text included)
    text: str              # their text (without the EOS token or the stop string and what follows it)
    stop: str              # "length" | "eos" | "stop" | "interrupted" (Ctrl-C: the tokens so far)
    ttft_s: float          # prompt submitted -> first new token on the host
    decode_s: float        # first token -> last token on the host
    elapsed_s: float

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: the tokens after the first, per second after the first (the first
        token's time, which includes the prompt, is `ttft_s`)."""
        n = len(self.tokens)
        if n > 1 and self.decode_s > 0:
            return (n - 1) / self.decode_s
        return n / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def summary(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "tokens": [int(t) for t in self.tokens], "text": self.text,
                "stop": self.stop, "tokens_per_s": self.tokens_per_s, "ttft_s": self.ttft_s,
                "elapsed_s": self.elapsed_s}


def eos_token_ids(tokenizer, config, checkpoint_dir=None) -> frozenset:
    """The ids that end a text, as transformers' generate takes them: generation_config.json's
    `eos_token_id` (an id or a list) beside the checkpoint, else config.json's; none with the
    built-in byte-level tokenizer, whose 256 ids are all text (the config's default eos id 0
    is the NUL byte there).  Ids outside the vocabulary are ignored."""
    if getattr(tokenizer, "name", "") == "bytes":
        return frozenset()
    eos = getattr(config, "eos_token_id", None)
    if checkpoint_dir is not None:
        gc = Path(checkpoint_dir) / "generation_config.json"
        if gc.is_file():
            try:
                eos = read_json(gc, "generation config").get("eos_token_id", eos)
            except (OSError, ValueError, AttributeError):
                pass  # an unreadable side file: the config's id stands
    ids = eos if isinstance(eos, (list, tuple)) else [eos]
    return frozenset(int(i) for i in ids
                     if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < config.vocab_size)


# ---------------------------------------------------------------------------- GPU side
def decodes(block) -> bool:
    """Whether an architecture's block has the recurrent decode step (Block.decode_*)."""
    from memengine.engine.models.base import Block

    return type(block).decode_state is not Block.decode_state


class Decoder:
    """Recurrent decoding state and buffers for one model, batch 1, made once: the shell's
    (the residual, the final norm, the logits, the token slots) and the architecture's
    (`Block.decode_state`: every layer's recurrent state)."""

    RING = 4  # token slots the sampler writes in turn (the host reads one step behind)

    def __init__(self, model):
        rt, c = model.rt, model.cfg
        if not decodes(model.block):
            raise MemengineError(f"generate is not yet supported for {c.model_type}")
        self.model, self.rt, self.cfg = model, rt, c
        E, V = c.hidden_size, c.vocab_size
        e = rt.empty
        self._tensors = [e((E,), name="dec.h"), e((E,), name="dec.hf"), e((1,), name="dec.rstd_f"),
                         e((V,), name="dec.logits"), e((2 + self.RING,), "i32", "dec.io")]
        self.h, self.hf, self.rstd_f, self.logits, self.io = self._tensors
        self.state, made = model.block.decode_state(rt)
        self._tensors += made
        self._readback = [rt.readback_buffer(4, f"dec.readback{i}") for i in range(2)]
        self._readback_tensor = [Tensor(b, (1,), "i32", 0, b.label) for b in self._readback]
        self._step = None
        self._step_key = None

    def close(self) -> None:
        """Give the buffers back to the runtime's pool."""
        for t in self._tensors:
            self.rt.free(t)
        self._tensors = []

    # -- recording
    def _record_step(self, rec, sampling) -> None:
        """One token: embed io[1], every layer's step, final norm, LM head, and (when
        `sampling` is given) the sampler."""
        m, c, p = self.model, self.cfg, self.model.params
        E, V = c.hidden_size, c.vocab_size
        embedding_forward(rec, self.h, self.io.view((1,), 1), p.embeddings)
        if m.emb_scale != 1.0:   # the architecture's multipliers, as LanguageModel.record_forward
            scale_(rec, self.h, m.emb_scale)
        for i in range(c.num_hidden_layers):
            m.block.decode_step(rec, m, self.state, i, self.h)
        rmsnorm_forward(rec, self.hf, self.rstd_f, self.h, p.norm_f, c.layer_norm_epsilon)
        if m.logit_scale != 1.0:
            scale_(rec, self.hf, m.logit_scale)
        matvec(rec, self.logits, m.head(), self.hf, rows=V, K=E)
        if sampling is not None:
            sample(rec, self.io, self.logits, V=V, **sampling)

    def _record_prefill(self, rec, ids: np.ndarray, sampling) -> None:
        m = self.model
        E, V = self.cfg.hidden_size, self.cfg.vocab_size
        L = int(ids.size)
        try:  # without gradients: the layers share one set of activations (handed over per layer)
            ws = m.workspace(1, L, grad=False)
        except MemengineError as e:
            raise MemengineError(f"the prompt ({L} tokens) is too long for this adapter: {e}") from None
        m.write_batch(ws, ids.reshape(1, L))
        rec.clear(self.io)

        def handover(rec, i):  # layer i's recurrent state, from its activations in the workspace
            m.block.decode_prefill(rec, m, self.state, ws, i, L)

        try:
            m.record_forward(rec, ws, after_layer=handover)
        except BindingError as e:  # one sequence must fit a binding (conv1d, scan); their advice is train's
            raise MemengineError(f"the prompt ({L} tokens) is too long for this adapter: {e.plain}") from None
        matvec(rec, self.logits, m.head(), ws.hf.view((E,), (L - 1) * E), rows=V, K=E)
        if sampling is not None:
            sample(rec, self.io, self.logits, V=V, **sampling)

    # -- forced tokens (tests, scoring): logits after each position
    def prefill_logits(self, ids) -> np.ndarray:
        """Run the prompt; return the logits [V] that follow it."""
        ids = self._check_ids(ids)
        rec = self.rt.recorder()
        self._record_prefill(rec, ids, None)
        rec.submit()
        return self.rt.read(self.logits)

    def push_logits(self, token: int) -> np.ndarray:
        """Feed one token through the recurrent step; return the logits [V] that follow it."""
        self._check_ids([token])
        self.rt.write(self.io.view((1,), 1), np.array([token], np.int32))
        rec = self.rt.recorder()
        self._record_step(rec, None)
        rec.submit()
        return self.rt.read(self.logits)

    def _check_ids(self, ids) -> np.ndarray:
        a = np.ascontiguousarray(np.asarray(ids).reshape(-1), np.int32)
        if a.size == 0:
            raise MemengineError("the prompt is empty: at least one token is needed")
        V = self.cfg.vocab_size
        if a.min() < 0 or a.max() >= V:
            bad = int(a[(a < 0) | (a >= V)][0])
            raise MemengineError(f"prompt token id {bad} is outside the model's vocabulary (size {V})")
        return a

    # -- sampling loop
    def _program(self, sampling: dict) -> Program:
        key = tuple(sorted(sampling.items()))
        if self._step_key != key:
            prog = Program(self.rt)
            self._record_step(prog, sampling)
            self._step, self._step_key = prog, key
        return self._step

    def _submit_step(self, prog: Program, t: int) -> None:
        enc = self.rt.device.create_command_encoder()
        prog.encode(enc)
        self._fetch(enc, t)
        self.rt.device.queue.submit([enc.finish()])

    def _fetch(self, encoder, t: int) -> None:
        slot = 2 + t % self.RING
        encoder.copy_buffer_to_buffer(self.io.buffer, self.io.offset + 4 * slot, self._readback[t % 2], 0, 4)

    def _read(self, t: int) -> int:
        return int(np.frombuffer(self.rt.read_mapped(self._readback[t % 2]), dtype=np.int32)[0])

    def run(self, ids, n_max: int, sampling: dict, on_token) -> tuple[float, float]:
        """Prompt, then up to n_max tokens; `on_token(t, id)` gets each on the host in order
        and returns True to stop.  Returns (time to the first token, time after it)."""
        ids = self._check_ids(ids)
        n_max = int(n_max)
        cap = getattr(self.model.block, "decode_capacity", None)   # a KV cache's positions
        if cap is not None and ids.size + n_max > cap:
            raise MemengineError(f"the prompt ({ids.size} tokens) and --max-new-tokens {n_max} exceed the "
                                 f"{cap} positions of the attention layers' KV cache")
        prog = self._program(sampling)
        t0 = time.perf_counter()
        rec = self.rt.recorder()
        self._record_prefill(rec, ids, sampling)
        rec.copy(self.io.view((1,), 2), self._readback_tensor[0])
        rec.submit()
        t_first = None
        for t in range(n_max):
            if t + 1 < n_max:
                self._submit_step(prog, t + 1)   # queued before token t is read: the GPU keeps going
            tok = self._read(t)
            if t_first is None:
                t_first = time.perf_counter()
            if on_token(t, tok):
                break
        t_end = time.perf_counter()
        return t_first - t0, t_end - t_first


# ---------------------------------------------------------------------------- text side
class _TextStream:
    """Token ids in, text out: what can be shown so far (no half UTF-8 character, nothing
    that may turn out to be the start of a stop string) and where a stop string begins."""

    def __init__(self, decode, stops: tuple):
        self.decode = decode
        self.stops = tuple(stops)
        self.ids: list = []
        self.shown = 0          # characters handed out so far
        self.text = ""
        self.stopped = False

    def push(self, tok: int) -> str:
        self.ids.append(int(tok))
        prev = len(self.text)
        self.text = self.decode(self.ids)
        if self.stops:
            start = max(0, prev - max(len(s) for s in self.stops))
            hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                self.stopped = True
                return self._take(len(self.text))
        end = len(self.text)
        while end > self.shown and self.text[end - 1] == "\ufffd":   # maybe a character cut in half
            end -= 1
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, end), 0, -1):
                if self.text.endswith(s[:k], 0, end):
                    hold = max(hold, k)
                    break
        return self._take(end - hold)

    def finish(self) -> str:
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self.shown:
            return ""
        out = self.text[self.shown:end]
        self.shown = end
        return out


PROMPT_MAX_BYTES = 64 << 20   # --prompt - : stdin read at most this far (a prompt's pass fits far less)


def read_prompt(value: str, stdin=None) -> str:
    """--prompt TEXT as given, or '-' for all of stdin (UTF-8, a leading BOM dropped; the
    text is kept exactly, a final newline included, as eval reads data): read in pieces,
    an interrupt check between two, at most PROMPT_MAX_BYTES (`< /dev/zero` took all the
    host's memory)."""
    if value != "-":
        return value
    import contextlib
    import sys

    from memengine.engine.io import tokens

    stream = stdin if stdin is not None else getattr(sys.stdin, "buffer", sys.stdin)
    fd = None
    if stdin is None:
        with contextlib.suppress(AttributeError, OSError, ValueError):
            fd = stream.fileno()
    parts = list(tokens.stream_pieces(fd if fd is not None else stream, PROMPT_MAX_BYTES, lambda: (
        f"--prompt -: more than {PROMPT_MAX_BYTES:,} bytes on stdin; a prompt is text, and a model's prompt pass "
        "holds far less")))
    return decode_utf8(b"".join(parts), "--prompt -: stdin")


def prompt_ids(tokenizer, text: str, vocab_size: int) -> np.ndarray:
    """The prompt's token ids, tokenized as eval tokenizes data (no special tokens)."""
    from memengine.engine.io.data import check_vocab

    ids = np.asarray(tokenizer.encode(text)).reshape(-1)
    if ids.size == 0:
        raise MemengineError("--prompt: empty; at least one token is needed")
    check_vocab(ids, vocab_size, "--prompt")
    return ids


def check_prompt_fits(rt, cfg, n_tokens: int) -> None:
    """The memory plan of the prompt's pass (an evaluation of one sequence, engine/plan.py),
    before anything is uploaded: one MemengineError line when it cannot work, saying how
    long a prompt can be (the plan names the sequence by its tokens; its advice, which
    names eval's flags, is not used)."""
    from memengine.engine.app.plan import Limits, estimate

    lim = Limits.of(rt)

    def plan(n):  # a sequence named by its tokens (the plan's default names eval's --seq-len)
        return estimate(cfg, 1, n, "eval", lim, eval_passes=(), sequence="of {} tokens")

    p = plan(n_tokens)
    if p.ok:
        return
    what = p.problems[0][0]
    if any(not grows for _, grows in p.problems):
        raise MemengineError(f"{what}; no prompt length can help on this adapter")
    lo, hi = 0, n_tokens - 1                     # the longest prompt that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if plan(mid).ok else (lo, mid - 1)
    raise MemengineError(f"the prompt ({n_tokens} tokens) is too long for this adapter: {what}; "
                         + (f"at most {lo} tokens fit" if lo else "no prompt length can help"))


def generate(model, prompt_ids, opts: SamplingOptions, *, decode, eos_id=None,
             on_text=None, on_token=None, decoder: Decoder | None = None) -> GenerateResult:
    """Continue `prompt_ids` (a 1-D sequence of ids) with up to opts.max_new_tokens tokens.

    `decode(ids) -> str` is the tokenizer's decode.  Stops at max_new_tokens ("length"), at
    `eos_id` (an id or a collection of ids: "eos"), or when the text contains one of
    opts.stop ("stop").  `on_text(str)` receives the text as it becomes final; `on_token(id)`
    every new id, after its text went to `on_text`: a KeyboardInterrupt raised there (or
    while the GPU works) ends the text there, "interrupted", with the tokens so far.  A
    `decoder` made for this model may be passed to reuse its buffers."""
    ids = np.asarray(prompt_ids).reshape(-1)
    own = decoder is None
    dec = decoder if decoder is not None else Decoder(model)
    sampling = dict(temperature=float(opts.temperature), top_k=int(opts.top_k), top_p=float(opts.top_p),
                    seed=int(opts.seed))
    eos = frozenset() if eos_id is None else frozenset([eos_id] if isinstance(eos_id, (int, np.integer)) else eos_id)
    stream = _TextStream(decode, opts.stop)
    tokens: list = []
    arrivals: list = []
    reason = [STOP_LENGTH]

    def on_tok(t: int, tok: int) -> bool:
        tokens.append(tok)
        arrivals.append(time.perf_counter())
        done = False
        if tok in eos:
            reason[0], done = STOP_EOS, True
        else:
            piece = stream.push(tok)
            if piece and on_text is not None:
                on_text(piece)
            if stream.stopped:
                reason[0], done = STOP_TEXT, True
        if on_token is not None:
            on_token(tok)
        return done

    t0 = time.perf_counter()
    try:
        dec.run(ids, opts.max_new_tokens, sampling, on_tok)
    except KeyboardInterrupt:
        reason[0] = STOP_INTERRUPTED
    finally:
        if own:
            dec.close()
    rest = stream.finish()
    if rest and on_text is not None:
        on_text(rest)
    ttft = arrivals[0] - t0 if arrivals else time.perf_counter() - t0
    decode_s = arrivals[-1] - arrivals[0] if arrivals else 0.0
    return GenerateResult(prompt_tokens=int(ids.size), tokens=tokens, text=stream.text, stop=reason[0],
                          ttft_s=ttft, decode_s=decode_s, elapsed_s=time.perf_counter() - t0)
