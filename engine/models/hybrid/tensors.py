"""The hybrids' tensor tables, in the transformers modules' state_dict order, and the layer
fields the block reads (engine/models/hybrid/block.py)."""

from __future__ import annotations

from memengine.engine.models.hybrid.config import ATTENTION

GRANITE = {"embeddings": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
           "norm2": "post_attention_layernorm.weight", "mlp": "shared_mlp."}
BAMBA = {"embeddings": "model.embed_tokens.weight", "final_norm": "model.final_layernorm.weight",
         "norm2": "pre_ff_layernorm.weight", "mlp": "feed_forward."}

# tensor name after "model.layers.{i}." -> the field of the layer's parameter record
LAYER_FIELDS = {
    "input_layernorm.weight": "norm_weight",
    "post_attention_layernorm.weight": "norm2_weight",     # Granite
    "pre_ff_layernorm.weight": "norm2_weight",             # Bamba
    "mamba.dt_bias": "dt_bias", "mamba.A_log": "A_log", "mamba.D": "D",
    "mamba.conv1d.weight": "conv1d_weight", "mamba.conv1d.bias": "conv1d_bias",
    "mamba.in_proj.weight": "in_proj_weight", "mamba.in_proj.bias": "in_proj_bias",
    "mamba.norm.weight": "gnorm_weight",
    "mamba.out_proj.weight": "out_proj_weight", "mamba.out_proj.bias": "out_proj_bias",
    "self_attn.q_proj.weight": "q_weight", "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.weight": "k_weight", "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.weight": "v_weight", "self_attn.v_proj.bias": "v_bias",
    "self_attn.o_proj.weight": "o_weight", "self_attn.o_proj.bias": "o_bias",
    "shared_mlp.input_linear.weight": "gu_weight",         # Granite: [gate ; up]
    "shared_mlp.output_linear.weight": "down_weight",
    "feed_forward.gate_proj.weight": "gate_weight", "feed_forward.gate_proj.bias": "gate_bias",   # Bamba
    "feed_forward.up_proj.weight": "up_weight", "feed_forward.up_proj.bias": "up_bias",
    "feed_forward.down_proj.weight": "down_weight", "feed_forward.down_proj.bias": "down_bias",
}


def names(cfg) -> dict:
    return GRANITE if cfg.model_type == "granitemoehybrid" else BAMBA


def _mamba(cfg, m: str):
    c = cfg.mamba
    H, C, K, W, E, Di = c.num_heads, c.conv_dim, c.conv_kernel, c.in_proj_rows, c.hidden_size, c.intermediate_size
    yield m + "dt_bias", (H,)
    yield m + "A_log", (H,)
    yield m + "D", (H,)
    yield m + "conv1d.weight", (C, 1, K)
    if c.use_conv_bias:
        yield m + "conv1d.bias", (C,)
    yield m + "in_proj.weight", (W, E)
    if c.use_bias:
        yield m + "in_proj.bias", (W,)
    yield m + "norm.weight", (Di,)
    yield m + "out_proj.weight", (E, Di)
    if c.use_bias:
        yield m + "out_proj.bias", (E,)


def _attention(cfg, a: str):
    E, D, Hq, Hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    for proj, rows in (("q_proj", Hq * D), ("k_proj", Hkv * D), ("v_proj", Hkv * D)):
        yield f"{a}{proj}.weight", (rows, E)
        if cfg.attention_bias:
            yield f"{a}{proj}.bias", (rows,)
    yield a + "o_proj.weight", (E, Hq * D)
    if cfg.attention_bias:
        yield a + "o_proj.bias", (E,)


def _mlp(cfg, p: str):
    E, I = cfg.hidden_size, cfg.intermediate_size
    if cfg.model_type == "granitemoehybrid":
        yield p + "shared_mlp.input_linear.weight", (2 * I, E)
        yield p + "shared_mlp.output_linear.weight", (E, I)
        return
    for proj, shape in (("gate_proj", (I, E)), ("up_proj", (I, E)), ("down_proj", (E, I))):
        yield f"{p}feed_forward.{proj}.weight", shape
        if cfg.mlp_bias:
            yield f"{p}feed_forward.{proj}.bias", shape[:1]


def iter_expected_shapes(cfg):
    """(name, shape) of every tensor, in the transformers model's state_dict() order."""
    n = names(cfg)
    E, V = cfg.hidden_size, cfg.vocab_size
    yield n["embeddings"], (V, E)
    granite = cfg.model_type == "granitemoehybrid"
    for i, kind in enumerate(cfg.layer_kinds):
        p = f"model.layers.{i}."
        if not granite:
            yield from _mlp(cfg, p)
        yield p + "input_layernorm.weight", (E,)
        yield p + n["norm2"], (E,)
        if granite:
            yield from _mlp(cfg, p)
        if kind == ATTENTION:
            yield from _attention(cfg, p + "self_attn.")
        else:
            yield from _mamba(cfg, p + "mamba.")
    yield n["final_norm"], (E,)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", (V, E)
