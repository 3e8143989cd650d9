"""Recurrent decoding (engine/generate.py, shaders/decode.wgsl) against transformers.

* The step kernels' logits after every position equal transformers' full-sequence logits
  (float64) and our own sequence forward, for prompts that end inside, at and after the
  scan's first saved chunk, and shorter than the conv kernel.
* Greedy output equals `MambaForCausalLM.generate(do_sample=False)` token for token, or
  differs first where transformers' own top two logits are within float32 noise (a near
  tie, detected and reported explicitly; nothing after it is compared).
* The sampler draws from softmax(logits / T) restricted exactly as transformers' top-k /
  top-p warpers restrict it (checked against numpy on many draws), reproducibly per seed.
* Stop conditions: length, EOS id, stop strings (never shown, not even in part).
"""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import checked_limits  # noqa: E402
from memengine.engine.app import plan  # noqa: E402
from memengine.engine.app.generate import Decoder, _TextStream, eos_token_ids, generate  # noqa: E402
from memengine.engine.app.options import GenerateOptions, SamplingOptions  # noqa: E402
from memengine.engine.errors import MemengineError  # noqa: E402
from memengine.engine.io.tokenizer import ByteTokenizer  # noqa: E402
from memengine.engine.kernels import scan as scan_mod  # noqa: E402
from memengine.engine.kernels.decode import matvec, sample  # noqa: E402
from memengine.engine.models.mamba1.config import MambaConfig  # noqa: E402
from memengine.engine.models.lm import LanguageModel  # noqa: E402
from memengine.engine.runtime import Tensor  # noqa: E402

CASES = [
    ("tied-odd", dict(vocab_size=259, hidden_size=37, state_size=5, num_hidden_layers=2, expand=2,
                      conv_kernel=4, use_bias=False, use_conv_bias=True, tie_word_embeddings=True)),
    ("untied-bias", dict(vocab_size=67, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2,
                         conv_kernel=3, use_bias=True, use_conv_bias=False, tie_word_embeddings=False,
                         time_step_rank=3)),
    ("untied-both-biases-k2", dict(vocab_size=131, hidden_size=24, state_size=16, num_hidden_layers=1, expand=3,
                                   conv_kernel=2, use_bias=True, use_conv_bias=True, tie_word_embeddings=False)),
    ("falcon-untied-eps", dict(vocab_size=67, hidden_size=16, state_size=3, num_hidden_layers=2, expand=2,
                               conv_kernel=4, use_bias=True, use_conv_bias=True, tie_word_embeddings=False,
                               time_step_rank=3, mixer_rms_eps=0.05)),
]
STEP_CASES = [CASES[0], CASES[1], CASES[3]]


def hf_model(kwargs, seed=0):
    """A transformers model (FalconMambaForCausalLM when the config has mixer_rms_eps) whose
    weights are perturbed away from the symmetric init, so that greedy text is varied (the
    plain init repeats one token)."""
    torch.manual_seed(seed)
    if "mixer_rms_eps" in kwargs:
        m = transformers.FalconMambaForCausalLM(transformers.FalconMambaConfig(**kwargs))
    else:
        m = transformers.MambaForCausalLM(transformers.MambaConfig(**kwargs))
    m = m.double().eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.add_(0.15 * torch.randn_like(p))
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


def ours_of(rt, m) -> LanguageModel:
    sd = {k: v.detach().to(torch.float32).numpy().copy() for k, v in m.state_dict().items()}
    if m.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    cfg = MambaConfig.from_dict(m.config.to_dict())
    assert cfg.is_falcon == (m.config.model_type == "falcon_mamba")
    return LanguageModel(rt, cfg, sd)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


# ----------------------------------------------------------------------------- step vs sequence
@pytest.mark.parametrize("name,kw", STEP_CASES, ids=[c[0] for c in STEP_CASES])
def test_step_logits_equal_sequence_logits(rt, name, kw):
    """Prompt of p tokens, then the rest fed one token at a time through the step kernels:
    the logits after every position equal the sequence pass over all of it (ours and
    transformers'), with the state handed over inside, at the end of and after the scan's
    first chunk of saved states, and before the conv window is full."""
    m = hf_model(kw)
    ours = ours_of(rt, m)
    L = scan_mod.CHUNK + 12
    ids = np.random.default_rng(1).integers(0, kw["vocab_size"], L).astype(np.int32)
    ref = m(input_ids=torch.tensor(ids[None], dtype=torch.long)).logits[0].detach().numpy()
    seq = ours.logits(ids[None])[0]
    assert rel(seq, ref) < 1e-5
    dec = Decoder(ours)
    C = scan_mod.CHUNK
    prefixes = [1, 2, C - 1, C, C + 1]
    worst = 0.0
    for p in prefixes:
        got = [dec.prefill_logits(ids[:p])]
        for t in range(p, L):
            got.append(dec.push_logits(int(ids[t])))
        got = np.array(got)
        e_ref, e_seq = rel(got, ref[p - 1:]), rel(got, seq[p - 1:])
        worst = max(worst, e_ref)
        assert got.shape == (L - p + 1, kw["vocab_size"])
        assert e_ref < 1e-5, (p, e_ref)
        assert e_seq < 1e-5, (p, e_seq)
    dec.close()
    print(f"\n[{name}] step logits vs transformers: max rel err {worst:.2e}")


@contextlib.contextmanager
def forced_binding(rt, monkeypatch, binding):
    """conftest's checked_limits (every dispatch's bindings checked against the forced limit),
    the decoder's recorded step program included (it resolves its dispatches itself)."""
    from memengine.engine.runtime import Program

    seen = {"step_dispatches": 0}
    orig = Program.dispatch

    def checked(self, shader, entry, bindings, groups, constants=None):
        for i, r in bindings.items():
            if isinstance(r, Tensor):
                assert r.nbytes <= rt.max_binding, f"{shader}.{entry} binding {i} is {r.nbytes} bytes"
        seen["step_dispatches"] += 1
        return orig(self, shader, entry, bindings, groups, constants)

    with checked_limits(rt, monkeypatch, binding) as s:
        monkeypatch.setattr(Program, "dispatch", checked)
        seen["recorded"] = s
        yield seen


@pytest.mark.parametrize("lanes", ["1", "4", "32"])
def test_matvec_against_numpy(rt, monkeypatch, lanes):
    """Scalar and vec4 paths, bias and accumulate, and a weight split into row ranges when it
    exceeds a (here forced small) storage binding."""
    monkeypatch.setenv("MEMENGINE_MATVEC_LANES", lanes)
    rng = np.random.default_rng(int(lanes))
    for rows, K, small in ((37, 13, False), (40, 16, False), (300, 20, True)):
        W, x, b, o = (rng.standard_normal(s) for s in ((rows, K), K, rows, rows))
        tw, tx, tb, to = (rt.upload(a.astype(np.float32)) for a in (W, x, b, o))
        limits = checked_limits(rt, monkeypatch, 4 * K * 64 + rt.storage_align) if small else contextlib.nullcontext()
        with limits as seen:
            rec = rt.recorder()
            matvec(rec, to, tw, tx, tb, rows=rows, K=K, acc=True)
            rec.submit()
        if small:
            assert seen["dispatches"] >= 2   # the weight went in row ranges
        np.testing.assert_allclose(rt.read(to), o + W @ x + b, rtol=1e-5, atol=1e-5)
        for t in (tw, tx, tb, to):
            rt.free(t)


# ----------------------------------------------------------------------------- greedy vs transformers
def _first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def assert_greedy_matches(ours, m, name, vocab_size, prompt_lens=(1, 9, 70), n_new=30):
    """Our greedy tokens equal transformers' `generate(do_sample=False)` on `m`, or first
    differ where transformers' own top logits make our pick a near tie."""
    rng = np.random.default_rng(7)
    for p in prompt_lens:
        prompt = rng.integers(0, vocab_size, p).astype(np.int32)
        out = m.generate(torch.tensor(prompt[None], dtype=torch.long), max_new_tokens=n_new, do_sample=False,
                         output_scores=True, return_dict_in_generate=True)
        want = out.sequences[0, p:].tolist()
        scores = torch.stack(out.scores)[:, 0].numpy()           # float64 logits of each step
        res = generate(ours, prompt, SamplingOptions(max_new_tokens=n_new, temperature=0), decode=lambda x: "")
        got = res.tokens
        assert len(got) == n_new and res.stop == "length"
        j = _first_divergence(got, want)
        if j is None:
            assert len(set(want)) > 3, "degenerate text: the comparison would be weak"
            continue
        # allowed only where transformers' own logits make our pick a near tie
        s = scores[j]
        gap = float(s[want[j]] - s[got[j]])
        scale = float(np.abs(s).max())
        print(f"\n[{name} p={p}] diverges at new token {j}: ours {got[j]}, transformers {want[j]}, "
              f"logit gap {gap:.2e} (scale {scale:.2e})")
        assert gap <= 1e-5 * scale, f"not a near tie: {gap} at token {j}"
        assert j > 0 or p == 1


@pytest.mark.parametrize("name,kw", CASES, ids=[c[0] for c in CASES])
def test_greedy_equals_transformers_generate(rt, name, kw):
    m = hf_model(kw, seed=4)
    assert_greedy_matches(ours_of(rt, m), m, name, kw["vocab_size"])


def test_generate_under_a_forced_small_binding_limit(rt, monkeypatch):
    """The binding limit forced down to what one prompt sequence needs (6 KiB here): the
    embedding, in_proj, out_proj and the LM head are bound in row ranges by the prompt pass
    and by every step, every binding is checked against the limit, and the step logits and
    greedy tokens still equal transformers'."""
    name, kw = CASES[0]                                   # V 259 x E 37: a 38 KB LM head
    m = hf_model(kw, seed=4)
    cfg = MambaConfig.from_dict(m.config.to_dict())
    L = 9
    binding = max(4096, -(-plan.min_binding(cfg, 1, L, "eval") // 1024) * 1024)
    assert 4 * cfg.vocab_size * cfg.hidden_size > 4 * binding
    ids = np.random.default_rng(3).integers(0, kw["vocab_size"], L + 6).astype(np.int32)
    ref = m(input_ids=torch.tensor(ids[None], dtype=torch.long)).logits[0].detach().numpy()
    with forced_binding(rt, monkeypatch, binding) as seen:
        ours = ours_of(rt, m)
        dec = Decoder(ours)
        got = [dec.prefill_logits(ids[:L])] + [dec.push_logits(int(t)) for t in ids[L:]]
        assert rel(np.array(got), ref[L - 1:]) < 1e-5
        dec.close()
        assert_greedy_matches(ours, m, f"{name} forced binding {binding}", kw["vocab_size"], prompt_lens=(L,),
                              n_new=12)
    unforced = Decoder(ours_of(rt, m))
    unforced._program(dict(temperature=0.0, top_k=0, top_p=1.0, seed=0))
    assert seen["step_dispatches"] > unforced._step.dispatches    # the step itself went in ranges
    unforced.close()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_greedy_from_a_half_precision_checkpoint(rt, tmp_path, dtype):
    """A checkpoint that transformers saved in f16 or bf16, read by the shared loader:
    greedy tokens equal transformers' generate on the same (rounded) weights."""
    from memengine.engine.io.checkpoint import load_checkpoint

    name, kw = CASES[1]
    m = hf_model(kw, seed=4).to(getattr(torch, dtype))
    m.save_pretrained(tmp_path / dtype)
    c = load_checkpoint(tmp_path / dtype)
    assert {str(d) for d in c.dtypes.values()} == {"F16" if dtype == "float16" else "BF16"}
    assert_greedy_matches(LanguageModel.from_checkpoint(rt, c), m.double(), f"{name} {dtype}", kw["vocab_size"],
                          prompt_lens=(9,))


def test_generate_does_not_rerun_the_prompt(rt):
    """Each new token is one recorded step (same dispatch count whatever the prompt length)."""
    m = hf_model(CASES[1][1])
    ours = ours_of(rt, m)
    dec = Decoder(ours)
    counts = []
    for p in (3, 90):
        generate(ours, np.arange(p) % 60, SamplingOptions(max_new_tokens=4, temperature=0), decode=lambda x: "",
                 decoder=dec)
        counts.append(dec._step.dispatches)
    assert counts[0] == counts[1] == 1 + 6 * ours.cfg.num_hidden_layers + 3
    dec.close()


# ----------------------------------------------------------------------------- sampler
def _draw(rt, logits, n, **kw):
    """n tokens drawn from the same logits (one dispatch each, one submission)."""
    V = logits.size
    lt = rt.upload(logits.astype(np.float32))
    io = rt.zeros((2 + n,), "i32")
    rec = rt.recorder()
    for _ in range(n):
        sample(rec, io, lt, V=V, **kw)
    rec.submit()
    out = rt.read(io)
    rt.free(lt)
    rt.free(io)
    assert out[0] == n
    return out[2:]


def _kept_reference(logits, T, top_k, top_p):
    """transformers' TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper, in numpy
    float64: the renormalised probabilities of the tokens they keep."""
    s = logits.astype(np.float64) / T
    if 0 < top_k < s.size:
        kth = np.sort(s)[-top_k]
        s = np.where(s < kth, -np.inf, s)
    p = np.exp(s - s.max())
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(p, kind="stable")      # ascending, as transformers sorts
        cum = np.cumsum(p[order])
        remove = cum <= 1 - top_p
        remove[-1] = False
        p[order[remove]] = 0
        p /= p.sum()
    return p


@pytest.mark.parametrize("T,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 12, 0.6)])
def test_sampler_draws_from_the_warped_distribution(rt, T, top_k, top_p):
    rng = np.random.default_rng(0)
    V = 41
    logits = rng.standard_normal(V) * 1.5
    logits[[3, 17]] = logits.max() + 0.5                  # a tie at the top
    n = 2000
    draws = _draw(rt, logits, n, temperature=T, top_k=top_k, top_p=top_p, seed=11)
    p = _kept_reference(logits, T, top_k, top_p)
    freq = np.bincount(draws, minlength=V) / n
    assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(p)), "drew a token the warpers remove"
    assert set(np.flatnonzero(p > 0.01)) <= set(np.flatnonzero(freq)), "never drew a likely kept token"
    # every frequency within 5 standard errors of its probability
    se = np.sqrt(np.maximum(p * (1 - p), 1e-12) / n)
    assert np.all(np.abs(freq - p) <= 5 * se + 1e-9), np.abs(freq - p).max()


def test_greedy_sampler_is_torch_argmax(rt):
    logits = np.array([0.5, 2.0, -1.0, 2.0, 1.9], np.float32)    # tie: the lowest index wins
    assert _draw(rt, logits, 3, temperature=0, top_k=0, top_p=1.0, seed=0).tolist() == [1, 1, 1]
    big = np.random.default_rng(3).standard_normal(5000).astype(np.float32)
    assert _draw(rt, big, 1, temperature=0, top_k=0, top_p=1.0, seed=0)[0] == int(np.argmax(big))


def test_sampling_reproducible_with_seed(rt):
    m = hf_model(CASES[0][1])
    ours = ours_of(rt, m)
    prompt = np.arange(1, 12)

    def run(seed, **kw):
        o = SamplingOptions(max_new_tokens=30, temperature=1.0, seed=seed, **kw)
        return generate(ours, prompt, o, decode=lambda x: "").tokens

    a, b, c = run(5), run(5), run(6)
    assert a == b
    assert a != c
    assert run(5, top_k=3, top_p=0.9) == run(5, top_k=3, top_p=0.9)


# ----------------------------------------------------------------------------- stop conditions
def test_stop_at_eos_length_and_string(rt):
    m = hf_model(CASES[0][1], seed=2)
    ours = ours_of(rt, m)
    prompt = np.array([72, 101, 108, 108, 111])
    greedy = SamplingOptions(max_new_tokens=24, temperature=0)
    full = generate(ours, prompt, greedy, decode=lambda x: "")
    assert full.stop == "length" and len(full.tokens) == 24
    # EOS: the first id that occurs for the first time at position >= 3
    k = next(i for i in range(3, 24) if full.tokens[i] not in full.tokens[:i])
    eos = full.tokens[k]
    r = generate(ours, prompt, greedy, decode=lambda x: "", eos_id=eos)
    assert r.stop == "eos" and r.tokens == full.tokens[:k + 1]
    # stop string: the text of tokens k..k+1 (byte tokenizer on ids < 256), never shown
    tok = ByteTokenizer()
    text = tok.decode(full.tokens)
    stop = tok.decode(full.tokens[k:k + 2])
    cut = text.find(stop)
    pieces = []
    r = generate(ours, prompt, SamplingOptions(max_new_tokens=24, temperature=0, stop=["\x00never", stop]),
                 decode=tok.decode, on_text=pieces.append)
    assert r.stop == "stop"
    assert r.text == text[:cut] == "".join(pieces)
    assert len(r.tokens) <= k + 2


def test_text_stream_holds_back_partial_characters_and_stop_prefixes():
    tok = ByteTokenizer()
    ids = list("héllo wörld".encode())
    s = _TextStream(tok.decode, ())
    out = [s.push(i) for i in ids]
    assert "".join(out) + s.finish() == "héllo wörld"
    assert all("\ufffd" not in o for o in out)
    s = _TextStream(tok.decode, ("wör", "lo!"))
    shown = ""
    for i in ids:
        shown += s.push(i)
        assert "héllo ".startswith(shown)       # nothing shown is ever taken back
        if s.stopped:
            break
    shown += s.finish()
    assert s.stopped and shown == s.text == "héllo "


def test_options_are_validated():
    for bad, flag in ((dict(max_new_tokens=0), "--max-new-tokens"), (dict(temperature=-1), "--temperature"),
                      (dict(top_k=-2), "--top-k"), (dict(top_p=0), "--top-p"), (dict(top_p=1.5), "--top-p"),
                      (dict(seed=-1), "--seed"), (dict(seed=2 ** 64), "--seed"), (dict(stop=[""]), "--stop"),
                      (dict(temperature=float("nan")), "--temperature")):
        with pytest.raises(MemengineError, match=flag):
            SamplingOptions(**bad).validate()
    SamplingOptions(temperature=0, top_k=5, top_p=1.0, seed=2 ** 64 - 1, stop=["x"]).validate()
    with pytest.raises(MemengineError, match="CKPT"):
        GenerateOptions(prompt="x").validate()
    with pytest.raises(MemengineError, match="--prompt"):
        GenerateOptions(ckpt="m").validate()


def test_prompt_errors(rt):
    m = hf_model(CASES[1][1])
    ours = ours_of(rt, m)
    with pytest.raises(MemengineError, match="empty"):
        generate(ours, [], SamplingOptions(), decode=lambda x: "")
    with pytest.raises(MemengineError, match="vocabulary"):
        generate(ours, [1, 67], SamplingOptions(), decode=lambda x: "")


def test_prompt_beyond_the_binding_limit_is_a_clear_error(rt):
    ours = ours_of(rt, hf_model(CASES[1][1]))
    with rt.forced_limits(20000):      # one prompt sequence [L, 2Di] must fit a binding; 300 x 64 do not
        with pytest.raises(MemengineError, match=r"prompt \(300 tokens\) is too long") as e:
            generate(ours, np.arange(300) % 60, SamplingOptions(), decode=lambda x: "")
    assert "--seq-len" not in str(e.value)


def test_eos_ids_of_tokenizers_and_generation_config(tmp_path):
    cfg = MambaConfig.from_dict(dict(CASES[0][1], eos_token_id=7))
    assert eos_token_ids(ByteTokenizer(), cfg) == frozenset()

    class Named:
        name = "tokenizer.json"

    assert eos_token_ids(Named(), cfg) == {7}
    assert eos_token_ids(Named(), cfg, tmp_path) == {7}
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 9, 100000]}')
    assert eos_token_ids(Named(), cfg, tmp_path) == {2, 9}     # beyond the vocabulary: ignored


def test_any_of_several_eos_ids_stops(rt):
    m = hf_model(CASES[1][1], seed=2)
    ours = ours_of(rt, m)
    greedy = SamplingOptions(max_new_tokens=12, temperature=0)
    full = generate(ours, [5, 6, 7], greedy, decode=lambda x: "").tokens
    k = next(i for i in range(2, 12) if full[i] not in full[:i])
    other = next(i for i in range(67) if i not in full)
    r = generate(ours, [5, 6, 7], greedy, decode=lambda x: "", eos_id={other, full[k]})
    assert r.stop == "eos" and r.tokens == full[:k + 1]


def test_interrupt_keeps_the_tokens_so_far_and_the_decoder_usable(rt):
    """A KeyboardInterrupt from on_token (what Ctrl-C raises at a token boundary) ends the
    text there: "interrupted", the tokens and text so far; the decoder runs the next text
    as a fresh one would."""
    m = hf_model(CASES[1][1], seed=2)
    ours = ours_of(rt, m)
    greedy = SamplingOptions(max_new_tokens=12, temperature=0)
    decode = ByteTokenizer().decode
    full = generate(ours, [5, 6, 7], greedy, decode=decode)
    dec = Decoder(ours)
    seen, shown = [], []

    def on_token(tok):
        seen.append(tok)
        if len(seen) == 5:
            raise KeyboardInterrupt

    r = generate(ours, [5, 6, 7], greedy, decode=decode, on_text=shown.append, on_token=on_token, decoder=dec)
    assert r.stop == "interrupted" and r.tokens == full.tokens[:5] == seen
    assert "".join(shown) == r.text == decode(full.tokens[:5])
    again = generate(ours, [5, 6, 7], greedy, decode=decode, decoder=dec)
    assert again.tokens == full.tokens and again.stop == "length"
    dec.close()
