"""`memengine generate` on the command line: output shapes, stdin, checkpoint kinds, exit codes."""

from __future__ import annotations

import json

import pytest
from conftest import make_checkpoint
from memengine.cli.main import app
from test_cli import assert_one_line_error, run_proc
from typer.testing import CliRunner

KEYS = {"prompt_tokens", "tokens", "text", "stop", "tokens_per_s", "ttft_s", "elapsed_s"}


def run(*args, input=None):
    return CliRunner().invoke(app, [str(a) for a in args], input=input, catch_exceptions=False)


def gen_json(*args, input=None) -> dict:
    r = run("generate", *args, "--json", input=input)
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1, r.stdout
    return json.loads(lines[0])


def test_json_object(tiny_ckpt_ro):
    out = gen_json(tiny_ckpt_ro, "--prompt", "It was the", "--max-new-tokens", "7", "--temperature", "0")
    assert set(out) == KEYS
    assert out["prompt_tokens"] == len("It was the".encode())
    assert len(out["tokens"]) == 7 and out["stop"] == "length"
    assert all(isinstance(t, int) and 0 <= t < 256 for t in out["tokens"])
    assert out["text"] == bytes(out["tokens"]).decode("utf-8", errors="replace")
    assert out["tokens_per_s"] > 0 and out["ttft_s"] > 0


def test_human_output_streams_text_to_stdout(tiny_ckpt_ro):
    want = gen_json(tiny_ckpt_ro, "-p", "It was", "-n", "9", "-t", "0")["text"]
    r = run("generate", tiny_ckpt_ro, "-p", "It was", "-n", "9", "-t", "0")
    assert r.exit_code == 0
    assert r.stdout == want + "\n"
    assert "tokens/s" in r.stderr and "stop: length" in r.stderr
    r = run("generate", tiny_ckpt_ro, "-p", "It was", "-n", "9", "-t", "0", "--quiet")
    assert r.stdout == want + "\n" and r.stderr == ""


def test_stdin_prompt_equals_argument(tiny_ckpt_ro):
    a = gen_json(tiny_ckpt_ro, "--prompt", "age of wisdom\n", "-n", "6", "-t", "0")
    b = gen_json(tiny_ckpt_ro, "--prompt", "-", "-n", "6", "-t", "0", input="age of wisdom\n")
    assert a == {**b, "tokens_per_s": a["tokens_per_s"], "ttft_s": a["ttft_s"], "elapsed_s": a["elapsed_s"]}
    assert b["prompt_tokens"] == 14


def test_seeded_sampling_and_stop(tiny_ckpt_ro):
    args = (tiny_ckpt_ro, "-p", "the", "-n", "24", "--temperature", "1.0", "--top-k", "50", "--top-p", "0.95")
    a, b = gen_json(*args, "--seed", "7"), gen_json(*args, "--seed", "7")
    c = gen_json(*args, "--seed", "8")
    assert a["tokens"] == b["tokens"] != c["tokens"]
    text = a["text"]
    stop = text[5:7]
    assert len(stop) == 2
    s = gen_json(*args, "--seed", "7", "--stop", stop, "--stop", "\u2603never")
    assert s["stop"] == "stop" and s["text"] == text[:text.find(stop)]


def test_f16_bf16_and_bare_file_checkpoints(tiny_ckpt, tmp_path):
    from memengine.engine.app.quantize import quantize_checkpoint

    base = gen_json(tiny_ckpt, "-p", "It", "-n", "5", "-t", "0")
    bare = gen_json(tiny_ckpt / "model.safetensors", "-p", "It", "-n", "5", "-t", "0")
    assert bare["tokens"] == base["tokens"]
    for dt in ("f16", "bf16"):
        quantize_checkpoint(tiny_ckpt, tmp_path / dt, dtype=dt, saturate=False, dry_run=False)
        out = gen_json(tmp_path / dt, "-p", "It", "-n", "5", "-t", "0")
        assert len(out["tokens"]) == 5


@pytest.mark.parametrize("args,needle", [
    (("--temperature", "-1"), "--temperature"),
    (("--top-p", "0"), "--top-p"),
    (("--max-new-tokens", "0"), "--max-new-tokens"),
    (("--stop", ""), "--stop"),
])
def test_bad_options_exit_2(tiny_ckpt_ro, args, needle):
    r = run("generate", tiny_ckpt_ro, "-p", "x", *args)
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, needle)
    assert r.stdout == ""


def test_bad_inputs_exit_2(tiny_ckpt_ro, tmp_path):
    r = run("generate", tiny_ckpt_ro, "--prompt", "")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "empty")
    r = run("generate", tmp_path / "nowhere", "--prompt", "x")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "nowhere")
    small = make_checkpoint(tmp_path / "v64", {"vocab_size": 64})
    r = run("generate", small, "--prompt", "~")  # byte 126 >= 64
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "vocabulary")


def test_process_exit_codes_and_stdout(tiny_ckpt_ro):
    r = run_proc("generate", tiny_ckpt_ro, "--prompt", "-", "-n", "4", "--json", input="It was")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["prompt_tokens"] == 6
    assert "Traceback" not in r.stderr
    r = run_proc("generate", tiny_ckpt_ro)           # --prompt is required
    assert r.returncode == 2 and r.stdout == "" and "--prompt" in r.stderr


def test_falcon_mamba_shards_saved_by_transformers(tmp_path):
    """A FalconMamba checkpoint written by transformers' save_pretrained in shards, or as a
    bare file with --model-type, goes through the shared loader: greedy tokens equal
    transformers' generate on it."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.FalconMambaConfig(vocab_size=256, hidden_size=16, state_size=4, num_hidden_layers=2,
                                         conv_kernel=3, mixer_rms_eps=0.02, tie_word_embeddings=False)
    m = transformers.FalconMambaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.15 * torch.randn_like(p))
    m.save_pretrained(tmp_path / "falcon", max_shard_size="20KB")
    assert (tmp_path / "falcon" / "model.safetensors.index.json").is_file()
    prompt = "It was the"
    ids = torch.tensor([list(prompt.encode())])
    want = m.double().generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, ids.shape[1]:]
    out = gen_json(tmp_path / "falcon", "-p", prompt, "-n", "12", "-t", "0")
    assert out["tokens"] == want.tolist()
    # the same weights as one bare file, whose model type only --model-type tells
    m.save_pretrained(tmp_path / "one")
    bare = tmp_path / "weights.safetensors"
    (tmp_path / "one" / "model.safetensors").rename(bare)
    out = gen_json(bare, "-p", prompt, "-n", "12", "-t", "0", "--model-type", "falcon_mamba")
    assert out["tokens"] == want.tolist()


def test_ctrl_c_stops_with_the_text_so_far(tiny_ckpt_ro):
    """SIGINT while generating: exit 130, the JSON object holds the tokens generated so far
    ("stop": "interrupted"), one error line says how many."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {k: v for k, v in os.environ.items() if k != "MEMENGINE_DEBUG"}
    p = subprocess.Popen([sys.executable, "-m", "memengine.cli.main", "generate", str(tiny_ckpt_ro), "-p", "It was",
                          "-n", "100000000", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env)
    try:
        line = p.stderr.readline()          # "adapter: ...": the model is being put on the GPU
        assert line.startswith("adapter:"), line
        time.sleep(2.0)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err
    res = json.loads(out)
    assert res["stop"] == "interrupted" and len(res["tokens"]) > 0
    assert f"interrupted after {len(res['tokens'])} tokens" in err and "Traceback" not in err


def test_config_file_sets_options_and_flags_win(tiny_ckpt_ro, tmp_path):
    cfg = tmp_path / "gen.yaml"
    cfg.write_text("max-new-tokens: 3\ntemperature: 0\nstop: [\"\\u2603\"]\n")
    a = gen_json(tiny_ckpt_ro, "-p", "It was", "--config", cfg)
    b = gen_json(tiny_ckpt_ro, "-p", "It was", "--config", cfg, "-n", "5")
    greedy = gen_json(tiny_ckpt_ro, "-p", "It was", "-n", "5", "-t", "0")
    assert len(a["tokens"]) == 3 and b["tokens"] == greedy["tokens"]
    cfg.write_text("prompt: It was\n")   # the prompt is an input, like CKPT
    r = run("generate", tiny_ckpt_ro, "-p", "x", "--config", cfg)
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, "unknown option 'prompt'")


def test_forced_binding_limit_splits_or_refuses_with_the_longest_prompt(tiny_ckpt_ro):
    """MEMENGINE_MAX_BINDING_BYTES lowers the binding limit: a short prompt generates what it
    generates without it; a prompt whose one sequence cannot fit one binding is refused
    before anything is uploaded, with one line saying how long a prompt may be."""
    want = gen_json(tiny_ckpt_ro, "-p", "It was", "-n", "6", "-t", "0")
    env = {"MEMENGINE_MAX_BINDING_BYTES": "8K"}
    r = run_proc("generate", tiny_ckpt_ro, "-p", "It was", "-n", "6", "-t", "0", "--json", env_extra=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] == want["tokens"]
    r = run_proc("generate", tiny_ckpt_ro, "-p", "x" * 400, "-n", "2", env_extra=env)
    assert r.returncode == 2 and r.stdout == ""
    assert_one_line_error(r.stderr, "prompt (400 tokens) is too long")
    assert "tokens fit" in r.stderr and "--seq-len" not in r.stderr
