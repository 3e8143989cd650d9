"""The data formats fine-tuners bring (issue 30, item 4): {"prompt", "completion"} records with
the loss on the completion only (the mask reaches the GPU cross-entropy: checked against
torch), {"messages"} records rendered with the tokenizer's chat template exactly as
transformers' apply_chat_template renders them, a directory of train/valid/test splits,
and one error line for a record of none of these shapes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from memengine.engine.errors import MemengineError
from memengine.engine.io import tokens
from memengine.engine.io.data import Windows, make_batches
from memengine.engine.io.tokenizer import ByteTokenizer, HFTokenizer
from test_cli import assert_one_line_error, run

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CHATML = ("{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# the same rendering, with the assistant's part marked for transformers' return_assistant_tokens_mask
CHATML_TAGS = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}"
               "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>\\n' }}"
               "{% endgeneration %}{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
               "'<|im_end|>' + '\\n' }}{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world?"},
        {"role": "assistant", "content": "hello, the world answers."}, {"role": "user", "content": "and the user?"},
        {"role": "assistant", "content": "asks."}]


def sources(tmp_path, name, lines):
    p = tmp_path / name
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return tokens.resolve_sources([str(p)])


def make_tokenizer(d, template):
    """A small BPE tokenizer.json with a tokenizer_config.json holding `template` (built here:
    no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the user asks and the assistant answers. Be brief."] * 50, tr)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
        "chat_template": template}))
    return HFTokenizer(d / "tokenizer.json")


# ----------------------------------------------------------------------------- prompt / completion
def test_prompt_completion_masks_the_prompt_and_the_gpu_loss_matches_torch(rt, tmp_path):
    from memengine.engine.models.lm import LanguageModel
    from memengine.engine.models.mamba1.config import MambaConfig
    from test_oracle import hf_model, rel, tensors_of

    recs = [{"prompt": "Q: what is it? A:", "completion": " the best of times."},
            {"prompt": "Q: and then?", "completion": " the worst."},
            {"text": "plain text is trained on all of it."}]
    src = sources(tmp_path, "pc.jsonl", recs)
    tf = tokens.token_file(src, ByteTokenizer(), 256)
    # the expected mask, built from the records themselves: 0 on each prompt's bytes
    want_ids, want_mask = [], []
    for i, r in enumerate(recs):
        if i:
            want_ids.append(255)
            want_mask.append(1)
        p = list(r.get("prompt", "").encode())
        c = list((r.get("completion") or r.get("text")).encode())
        want_ids += p + c
        want_mask += [0] * len(p) + [1] * len(c)
    assert np.asarray(tf.ids).tolist() == want_ids
    assert np.asarray(tf.mask).tolist() == want_mask

    kw = dict(vocab_size=256, hidden_size=16, state_size=4, num_hidden_layers=1, expand=2, conv_kernel=4,
              time_step_rank=2, use_bias=False, use_conv_bias=True, tie_word_embeddings=True)
    m = hf_model(kw)
    ours = LanguageModel(rt, MambaConfig.from_dict(m.config.to_dict()), tensors_of(m))
    L = 24
    batch = make_batches(list(Windows(tf.ids, L, tf.mask)), 5, L)[0]
    assert (batch.targets == -1).sum() > sum(len(r.get("prompt", "")) for r in recs) - 5
    ids = torch.tensor(batch.ids, dtype=torch.long)
    labels = torch.tensor(batch.targets, dtype=torch.long)
    loss_ref = torch.nn.functional.cross_entropy(m(input_ids=ids).logits.reshape(-1, 256), labels.reshape(-1),
                                                 ignore_index=-1)
    loss_ref.backward()
    loss = ours.loss_and_grads(batch.ids, batch.targets)
    assert abs(loss - loss_ref.item()) / loss_ref.item() < 1e-4
    grads = ours.grad_dict()
    for n, p in m.named_parameters():
        assert rel(grads[n], p.grad.numpy()) < 1e-3, n
    # the unmasked loss differs: the prompt positions did count for nothing above
    unmasked = make_batches(list(Windows(tf.ids, L)), 5, L)[0]
    assert abs(ours.loss_and_grads(unmasked.ids, unmasked.targets) - loss) > 1e-3


def test_train_on_prompt_keeps_every_target(tmp_path):
    src = sources(tmp_path, "pc.jsonl", [{"prompt": "ab", "completion": "cd"}])
    assert tokens.token_file(src, ByteTokenizer(), 256).mask is not None
    tf = tokens.token_file(src, ByteTokenizer(), 256, prompt_loss=True)
    assert tf.mask is None and np.asarray(tf.ids).tolist() == list(b"abcd")


# ----------------------------------------------------------------------------- messages
@pytest.mark.parametrize("template", [CHATML, CHATML_TAGS], ids=["prefixes", "generation-tags"])
def test_messages_render_as_transformers_apply_chat_template(tmp_path, template):
    tok = make_tokenizer(tmp_path / "tok", template)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    src = sources(tmp_path, "chat.jsonl", [{"messages": CHAT}])
    tf = tokens.token_file(src, tok, tok.vocab_size, prompt_loss=True)
    want = hf.apply_chat_template(CHAT, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert np.asarray(tf.ids).tolist() == list(want)
    # the loss mask: the assistant's turns, as transformers finds them through {% generation %}
    tagged = make_tokenizer(tmp_path / "tagged", CHATML_TAGS)
    hf_tagged = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tagged"))
    out = hf_tagged.apply_chat_template(CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    masked = tokens.token_file(src, tok, tok.vocab_size)
    assert list(out["input_ids"]) == np.asarray(masked.ids).tolist()
    assert np.asarray(masked.mask).tolist() == list(out["assistant_masks"])
    assert 0 < sum(out["assistant_masks"]) < len(out["assistant_masks"])
    del tagged


def test_messages_need_a_chat_template(tmp_path):
    src = sources(tmp_path, "chat.jsonl", [{"messages": CHAT}])
    with pytest.raises(MemengineError, match="chat template"):
        tokens.token_file(src, ByteTokenizer(), 256)


# ----------------------------------------------------------------------------- records and directories
@pytest.mark.parametrize("record, needle", [
    ({"input": "x", "output": "y"}, '"input", "output"'),
    ({"prompt": "only a prompt"}, '"prompt"'),
    ([1, 2], "list"),
    ({"messages": "hi"}, "messages"),
])
def test_a_record_of_no_known_shape_is_one_error_line(tiny_ckpt_ro, tmp_path, record, needle):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps(record) + "\n")
    r = run("train", tiny_ckpt_ro, "--data", p, "-o", tmp_path / "o", "--seq-len", "16", "--max-steps", "1")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "bad.jsonl:2")
    assert needle in r.stderr
    assert not (tmp_path / "o").exists()


def test_a_directory_of_splits_trains_on_train_and_validates_on_valid(tiny_ckpt_ro, tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "train.jsonl").write_text("".join(json.dumps({"prompt": f"Q{i}:", "completion": " yes, the answer."}) + "\n"
                                           for i in range(20)))
    (d / "valid.jsonl").write_text(json.dumps({"text": "held-out text of the valid split."}) + "\n")
    (d / "test.jsonl").write_text(json.dumps({"text": "the test split: a few more bytes than valid."}) + "\n")
    r = run("train", tiny_ckpt_ro, "--data", d, "-o", tmp_path / "o", "--seq-len", "16", "--max-steps", "2",
            "--json")
    assert r.exit_code == 0, r.stderr
    evals = [e for e in map(json.loads, r.stdout.splitlines()) if e["event"] == "eval"]
    assert evals and evals[-1]["val_tokens"] == len("held-out text of the valid split.") - 1
    r = run("eval", tiny_ckpt_ro, "--data", d, "--seq-len", "16", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1])["tokens"] == len("the test split: a few more bytes than valid.") - 1
    # eval scores the completions only, unless --score-prompt
    (d / "test.jsonl").write_text(json.dumps({"prompt": "abcd", "completion": "efgh"}) + "\n")
    for flag, n in (((), 4), (("--score-prompt",), 7)):
        r = run("eval", tiny_ckpt_ro, "--data", d, "--seq-len", "16", "--json", *flag)
        assert r.exit_code == 0, r.stderr
        assert json.loads(r.stdout.splitlines()[-1])["tokens"] == n


def test_a_directory_without_train_jsonl_is_refused(tiny_ckpt_ro, tmp_path):
    (tmp_path / "data").mkdir()
    r = run("train", tiny_ckpt_ro, "--data", tmp_path / "data", "-o", tmp_path / "o")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "train.jsonl")
