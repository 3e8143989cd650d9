"""GGUF files that llama.cpp runs: a Mamba-1 checkpoint (model types `mamba` and
`falcon_mamba`) written with the tensor names, shapes, types and metadata keys that
llama.cpp's own converter (convert_hf_to_gguf.py, class MambaModel) writes, through the
`gguf` package (llama.cpp's Python writer; the `gguf` extra).

What the converter does, and so this module:
- one architecture, "mamba", for both model types; falcon_mamba is `mamba.ssm.dt_b_c_rms`
  true (llama.cpp then RMS-normalises dt, B and C without weights, with
  `layer_norm_epsilon`: it has no key for the mixer's own epsilon);
- A is stored as `ssm_a` = -exp(A_log), conv1d's [Di, 1, K] as [Di, K], a tied or equal
  lm_head is left out (llama.cpp reads token_embd in its place);
- 1-D tensors, norms, conv1d and every tensor whose name does not end in ".weight"
  (ssm_a, ssm_d, the biases) stay F32; the others take the requested type, and fall back
  to F16 where their rows do not split into the type's blocks (32 values for q8_0, q4_0...);
- a tokenizer.json (byte-level BPE) becomes tokenizer.ggml.model "gpt2" with its tokens
  (padded to the embedding's rows with [PADi]), types, merges and special ids; the
  built-in byte-level tokenizer becomes tokenizer.ggml.model "none" with `mamba.vocab_size`
  (llama.cpp then takes token ids, not text).

What llama.cpp cannot run is refused before anything is written (`check_runnable`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
from memengine.engine.errors import MemengineError
from memengine.engine.models.mamba1.config import MambaConfig

ARCH = "mamba"
CONTEXT_LENGTH = 2**20  # the converter's value: a recurrent model has no context limit

# --type -> (GGMLQuantizationType name, LlamaFileType name)
TYPES = {
    "f32": ("F32", "ALL_F32"),
    "f16": ("F16", "MOSTLY_F16"),
    "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "q5_1": ("Q5_1", "MOSTLY_Q5_1"),
    "q5_0": ("Q5_0", "MOSTLY_Q5_0"),
    "q4_1": ("Q4_1", "MOSTLY_Q4_1"),
    "q4_0": ("Q4_0", "MOSTLY_Q4_0"),
}
_ALIASES = {"fp32": "f32", "float32": "f32", "fp16": "f16", "float16": "f16", "half": "f16",
            "bfloat16": "bf16"}

# llama.cpp's tensor names per HF name (gguf's TensorNameMap for MODEL_ARCH.MAMBA gives the same)
_LAYER = {
    "norm.weight": "attn_norm.weight",
    "mixer.in_proj.weight": "ssm_in.weight",
    "mixer.conv1d.weight": "ssm_conv1d.weight",
    "mixer.conv1d.bias": "ssm_conv1d.bias",
    "mixer.x_proj.weight": "ssm_x.weight",
    "mixer.dt_proj.weight": "ssm_dt.weight",
    "mixer.dt_proj.bias": "ssm_dt.bias",
    "mixer.A_log": "ssm_a",
    "mixer.D": "ssm_d",
    "mixer.out_proj.weight": "ssm_out.weight",
}
_GLOBAL = {"backbone.embeddings.weight": "token_embd.weight", "backbone.norm_f.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def gguf_module():
    """The `gguf` package, or one line saying how to get it."""
    try:
        import gguf
    except ImportError:
        raise MemengineError("export needs the 'gguf' package (llama.cpp's GGUF writer): "
                             "pip install 'memengine[gguf]'") from None
    return gguf


def normalize_type(value: str) -> str:
    """--type as a key of TYPES; anything else is one line naming what can be written."""
    t = _ALIASES.get(str(value).strip().lower(), str(value).strip().lower())
    if t in TYPES:
        return t
    known = ", ".join(TYPES)
    gguf = gguf_module()
    if t.upper() in gguf.GGMLQuantizationType.__members__:
        raise MemengineError(f"--type {value}: the gguf package has no quantizer for {t.upper()}; export writes "
                             f"{known} (for k-quants or i-quants, export f16 and run llama.cpp's llama-quantize)")
    raise MemengineError(f"--type {value}: not a type export writes (choose one of {known})")


def check_runnable(cfg: MambaConfig) -> list[str]:
    """Refuse, in one line, a model llama.cpp's Mamba-1 cannot run (llama-model.cpp,
    models/mamba.cpp and mamba-base.cpp); return notes on what is converted with a change."""
    where = "llama.cpp cannot run this model"
    if cfg.intermediate_size != 2 * cfg.hidden_size:
        raise MemengineError(f"{where}: its Mamba-1 takes only expand 2 (\"only an expansion factor of 2 is supported "
                             f"for now\"); this model has expand {cfg.expand}")
    if cfg.use_bias:
        raise MemengineError(f"{where}: use_bias=true (biases on in_proj and out_proj), which llama.cpp's Mamba-1 "
                             "has no tensors for")
    notes = []
    if not cfg.use_conv_bias:
        notes.append("use_conv_bias=false: written with a zero ssm_conv1d.bias (llama.cpp requires the tensor; "
                     "the model computes the same)")
    if cfg.is_falcon and cfg.mixer_rms_eps != cfg.layer_norm_epsilon:
        notes.append(f"falcon_mamba: llama.cpp normalises dt, B and C with layer_norm_epsilon "
                     f"({cfg.layer_norm_epsilon:g}), not mixer_rms_eps ({cfg.mixer_rms_eps:g}); its logits differ "
                     "from this model's by that much")
    return notes


def gguf_name(hf: str) -> str:
    """llama.cpp's name for a HF tensor name."""
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    parts = hf.split(".", 3)  # backbone.layers.<i>.<rest>
    if len(parts) == 4 and parts[:2] == ["backbone", "layers"] and parts[3] in _LAYER:
        return f"blk.{int(parts[2])}.{_LAYER[parts[3]]}"
    raise MemengineError(f"{hf}: no GGUF name for this tensor")


def _stays_f32(name: str, data: np.ndarray) -> bool:
    """The converter's rule (TextModel.prepare_tensors): 1-D tensors, norms, conv1d and
    names not ending in .weight stay F32."""
    return (data.ndim <= 1 or name.endswith("_norm.weight") or ".ssm_conv1d." in name
            or not name.endswith(".weight"))


def gguf_tensors(cfg: MambaConfig, tensors: dict) -> Iterator[tuple[str, str, np.ndarray]]:
    """(gguf name, HF name, float32 array in llama.cpp's layout) in the converter's order."""
    emb = None
    for hf, x in tensors.items():
        name = gguf_name(hf)
        a = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
        if hf.endswith(".A_log"):
            a = -np.exp(a)
        elif hf.endswith("mixer.conv1d.weight"):
            a = a.reshape(a.shape[0], a.shape[-1])  # [Di, 1, K] -> [Di, K]
        if name == "token_embd.weight":
            emb = a
        elif name == "output.weight" and emb is not None and np.array_equal(emb, a):
            continue  # tied: llama.cpp reads token_embd in its place
        yield name, hf, a
        if hf.endswith("mixer.conv1d.weight") and not cfg.use_conv_bias:
            i = hf.split(".")[2]
            yield f"blk.{i}.ssm_conv1d.bias", f"backbone.layers.{i}.mixer.conv1d.bias", \
                np.zeros(a.shape[0], np.float32)


@dataclass
class GGUFTensor:
    name: str          # llama.cpp's
    source: str        # the HF tensor it comes from
    shape: tuple       # numpy order (ggml's ne reversed)
    type: str          # GGML type name
    nbytes: int


def _quantized(gguf, name: str, a: np.ndarray, qtype_name: str):
    Q = gguf.GGMLQuantizationType
    qt = Q.F32 if _stays_f32(name, a) else Q[qtype_name]
    try:
        return gguf.quants.quantize(a, qt), qt
    except gguf.QuantError:  # rows that do not split into blocks: F16, as the converter falls back
        return gguf.quants.quantize(a, Q.F16), Q.F16


def _pre_tokenizer(data: dict, where: str) -> str:
    """tokenizer.ggml.pre for a tokenizer.json: a byte-level BPE pre-tokenizer (GPT-2,
    GPT-NeoX: what Mamba models ship) is llama.cpp's "gpt-2"."""
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE":
        kind = model.get("type") if isinstance(model, dict) else None
        raise MemengineError(f"{where}: a {kind or 'non-BPE'} tokenizer; llama.cpp's converter maps a Mamba "
                             "tokenizer.json as byte-level BPE (gpt2) only")
    pre = data.get("pre_tokenizer")
    items = pre.get("pretokenizers", []) if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    for p in items:
        if isinstance(p, dict) and p.get("type") == "ByteLevel" and p.get("use_regex", True):
            return "gpt-2"
    raise MemengineError(f"{where}: its pre-tokenizer is not byte-level (GPT-2 style); llama.cpp's converter maps "
                         "a Mamba tokenizer.json as byte-level BPE (gpt2) only")


def check_tokenizer(tokenizer_path: Optional[Path], cfg: MambaConfig) -> Optional[str]:
    """The pre-tokenizer name of a tokenizer.json (None: the byte-level tokenizer); refuses
    one llama.cpp cannot take before anything is written."""
    if tokenizer_path is None:
        return None
    from memengine.engine.io.inputs import read_json

    data = read_json(tokenizer_path, "tokenizer file")
    pre = _pre_tokenizer(data, str(tokenizer_path))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    n = tok.get_vocab_size(with_added_tokens=True)
    ids = tok.get_vocab(with_added_tokens=True).values()
    if ids and max(ids) >= cfg.vocab_size:
        raise MemengineError(f"{tokenizer_path}: token id {max(ids):,} is beyond the model's {cfg.vocab_size:,} "
                             f"embedding rows ({n:,} tokens); llama.cpp needs one row per token")
    return pre


def _write_vocab(gguf, w, cfg: MambaConfig, tokenizer_path: Optional[Path], pre: Optional[str]) -> str:
    V = cfg.vocab_size
    if tokenizer_path is None:
        w.add_tokenizer_model("none")
        w.add_vocab_size(V)
        return "none (token ids: the built-in byte-level tokenizer)"
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    added = tok.get_added_tokens_decoder()
    TT = gguf.TokenType
    tokens, types = [], []
    for i in range(V):
        t = by_id.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(TT.UNUSED)
        elif i in added:
            special = added[i].special or (t.startswith("<|") and t.endswith("|>"))
            tokens.append(t if special else t.replace("\u2581", " "))
            types.append(TT.CONTROL if special else TT.USER_DEFINED)
        else:
            tokens.append(t)
            types.append(TT.NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(tokenizer_path.parent, load_merges=True, n_vocab=V).add_to_gguf(w, quiet=True)
    return f"gpt2 ({pre}), {len(by_id):,} tokens"


@contextlib.contextmanager
def _temp_beside(out: Path) -> Iterator[Path]:
    """A file in a hidden staging directory beside OUT, moved over OUT on success (fsynced
    first); the directory goes on any failure, a Ctrl-C, or a second signal's emergency exit
    (interrupts.staging_dir): OUT is never half written."""
    import shutil

    from memengine.engine import interrupts
    from memengine.engine.io.staging import fsync_dir

    tmp_dir = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.mkdir(tmp_dir, 0o777)
    except OSError as e:
        raise MemengineError(f"--output {out}: cannot write in {out.parent} ({e.strerror or e})") from None
    with interrupts.staging_dir(tmp_dir):
        try:
            tmp = tmp_dir / out.name
            yield tmp
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            with interrupts.critical():
                os.replace(tmp, out)
                fsync_dir(out.parent)
                interrupts.completed(out)
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)


def write_gguf(out: Path, cfg: MambaConfig, tensors: dict, type_: str, *, tokenizer_path: Optional[Path] = None,
               name: str = "", on_tensor: Optional[Callable[[int, int, str], None]] = None) -> tuple[list, str]:
    """Write `tensors` (HF names, float32) of a model `cfg` to the GGUF file `out` as
    --type `type_`, atomically. Returns the tensors written and the vocabulary's description.
    Call check_runnable and check_tokenizer first."""
    gguf = gguf_module()
    qname, ftype = TYPES[normalize_type(type_)]
    pre = check_tokenizer(tokenizer_path, cfg)
    w = gguf.GGUFWriter(None, ARCH)
    w.add_type(gguf.GGUFType.MODEL)
    if name:
        w.add_name(name)
    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_ssm_conv_kernel(cfg.conv_kernel)
    w.add_ssm_inner_size(cfg.intermediate_size)
    w.add_ssm_state_size(cfg.state_size)
    w.add_ssm_time_step_rank(cfg.dt_rank)
    w.add_layer_norm_rms_eps(cfg.layer_norm_epsilon)
    w.add_ssm_dt_b_c_rms(cfg.is_falcon)
    w.add_file_type(gguf.LlamaFileType[ftype])
    vocab = _write_vocab(gguf, w, cfg, tokenizer_path, pre)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    written = []
    items = list(gguf_tensors(cfg, tensors))
    for k, (gname, hf, a) in enumerate(items):
        data, qt = _quantized(gguf, gname, a, qname)
        w.add_tensor(gname, data, raw_dtype=qt)
        written.append(GGUFTensor(gname, hf, tuple(a.shape), qt.name, int(data.nbytes)))
        if on_tensor is not None:
            on_tensor(k + 1, len(items), gname)
    out = Path(out)
    with _temp_beside(out) as tmp:
        try:
            w.write_header_to_file(path=tmp)
            w.write_kv_data_to_file()
            w.write_tensors_to_file(progress=False)
        finally:
            w.close()
    return written, vocab
