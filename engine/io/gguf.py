"""GGUF files that llama.cpp runs, through the `gguf` package (llama.cpp's Python writer;
the `gguf` extra): the types it quantizes, the tokenizer as llama.cpp's converter maps it,
and the staged, atomic write.  What is the architecture's own (llama.cpp's architecture
name, tensor names and layouts, metadata keys, which tensors stay F32, what llama.cpp cannot
run) comes from its mapping, `Architecture.gguf()` (engine/models/mamba1/gguf.py,
engine/models/mamba2/gguf.py).

- 1-D tensors, norms, conv1d and every tensor whose name does not end in ".weight" stay F32
  (the converter's rule), a tied or equal lm_head is left out (llama.cpp reads token_embd
  in its place);
- the requested type for every other tensor, with a fall back
  to F16 where its rows do not split into the type's blocks (32 values for q8_0, q4_0...);
- a tokenizer.json (byte-level BPE) becomes tokenizer.ggml.model "gpt2" with its tokens
  (padded to the embedding's rows with [PADi]), types, merges and special ids; the
  built-in byte-level tokenizer becomes tokenizer.ggml.model "none" with the vocabulary
  size (llama.cpp then takes token ids, not text).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
from memengine.engine import models
from memengine.engine.errors import MemengineError

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


CONTEXT_LENGTH = 2**20  # the converter's value for a recurrent model: it has no context limit


def stays_f32(name: str, data: np.ndarray) -> bool:
    """The converter's rule (TextModel.prepare_tensors): 1-D tensors, norms, conv1d and
    names not ending in .weight stay F32."""
    return (data.ndim <= 1 or name.endswith("_norm.weight") or ".ssm_conv1d." in name
            or not name.endswith(".weight"))


def tensor_name(hf: str, global_names: dict, layer_names: dict, prefix: str = "backbone.layers") -> str:
    """llama.cpp's name for a HF tensor: `global_names[hf]`, or blk.<i>.<layer_names[rest]>
    for `<prefix>.<i>.<rest>`."""
    if hf in global_names:
        return global_names[hf]
    head, _, rest = hf.partition(f"{prefix}.")
    i, _, suffix = rest.partition(".")
    if not head and i.isdigit() and suffix in layer_names:
        return f"blk.{int(i)}.{layer_names[suffix]}"
    raise MemengineError(f"{hf}: no GGUF name for this tensor")


def add_recurrent_shape(w, cfg, *, inner: int, state: int, rank: int) -> None:
    """The converter's keys of a recurrent model's shape (Mamba-1 and Mamba-2 alike)."""
    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(0)   # unused, but llama.cpp's loader wants them
    w.add_head_count(0)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_ssm_conv_kernel(cfg.conv_kernel)
    w.add_ssm_inner_size(inner)
    w.add_ssm_state_size(state)
    w.add_ssm_time_step_rank(rank)
    w.add_layer_norm_rms_eps(cfg.layer_norm_epsilon)


@dataclass
class GGUFTensor:
    name: str          # llama.cpp's
    source: str        # the HF tensor it comes from
    shape: tuple       # numpy order (ggml's ne reversed)
    type: str          # GGML type name
    nbytes: int


def _quantized(gguf, name: str, a: np.ndarray, qtype_name: str, keep_f32: bool):
    Q = gguf.GGMLQuantizationType
    qt = Q.F32 if keep_f32 else Q[qtype_name]
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


def check_tokenizer(tokenizer_path: Optional[Path], cfg) -> Optional[str]:
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


def _write_vocab(gguf, w, cfg, tokenizer_path: Optional[Path], pre: Optional[str]) -> str:
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


def write_gguf(out: Path, cfg, tensors: dict, type_: str, *, tokenizer_path: Optional[Path] = None,
               name: str = "", on_tensor: Optional[Callable[[int, int, str], None]] = None) -> tuple[list, str]:
    """Write `tensors` (HF names, float32) of a model `cfg` to the GGUF file `out` as
    --type `type_`, atomically. Returns the tensors written and the vocabulary's description.
    The architecture's GGUF mapping (`Architecture.gguf()`) names the tensors and writes its
    metadata keys.  Call the mapping's check_runnable and check_tokenizer first."""
    gguf = gguf_module()
    qname, ftype = TYPES[normalize_type(type_)]
    pre = check_tokenizer(tokenizer_path, cfg)
    mapping = models.of(cfg).gguf()
    w = gguf.GGUFWriter(None, mapping.ARCH)
    w.add_type(gguf.GGUFType.MODEL)
    if name:
        w.add_name(name)
    mapping.add_metadata(w, cfg)
    w.add_file_type(gguf.LlamaFileType[ftype])
    vocab = _write_vocab(gguf, w, cfg, tokenizer_path, pre)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    written = []
    items, emb = [], None
    for gname, hf, a in mapping.gguf_tensors(cfg, tensors):
        if gname == "token_embd.weight":
            emb = a
        elif gname == "output.weight" and emb is not None and np.array_equal(emb, a):
            continue  # tied: llama.cpp reads token_embd in its place
        items.append((gname, hf, a))
    for k, (gname, hf, a) in enumerate(items):
        data, qt = _quantized(gguf, gname, a, qname, stays_f32(gname, a))
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
