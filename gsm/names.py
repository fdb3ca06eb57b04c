"""The one table of GSM tensor names (spec section 3) and their shapes.

Everything that reads or writes checkpoint tensors goes through these tables; no module builds
tensor names by string surgery of its own.
"""

from __future__ import annotations

from gsm.config import ModelConfig

# Model-level tensors.
EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"

# Per-layer tensors, `{i}` is the 0-based layer index. Keys are the short names used in code.
LAYER = "model.layers.{i}."
COMMON = {
    "input_norm": LAYER + "input_layernorm.weight",
    "q_proj": LAYER + "self_attn.q_proj.weight",
    "o_proj": LAYER + "self_attn.o_proj.weight",
    "post_norm": LAYER + "post_attention_layernorm.weight",
    "gate_proj": LAYER + "mlp.gate_proj.weight",
    "up_proj": LAYER + "mlp.up_proj.weight",
    "down_proj": LAYER + "mlp.down_proj.weight",
}
OWNING = {
    "k_U": LAYER + "self_attn.k_svd_U.weight",
    "k_S": LAYER + "self_attn.k_svd_S.weight",
    "k_Vt": LAYER + "self_attn.k_svd_Vt.weight",
    "v_U": LAYER + "self_attn.v_svd_U.weight",
    "v_S": LAYER + "self_attn.v_svd_S.weight",
    "v_Vt": LAYER + "self_attn.v_svd_Vt.weight",
    "idx_q": LAYER + "self_attn.sparse_mask_generator.q_proj.weight",
    "idx_k": LAYER + "self_attn.sparse_mask_generator.k_proj.weight",
    "idx_w": LAYER + "self_attn.sparse_mask_generator.w_proj.weight",
}
SHARING = {
    "proj_w": LAYER + "self_attn.kv_projector.weight",
    "proj_b": LAYER + "self_attn.kv_projector.bias",
}
# Optional dense K/V projections kept for dense-KV references; builders ignore them.
DENSE_KV = {
    "k_proj": LAYER + "self_attn.k_proj.weight",
    "v_proj": LAYER + "self_attn.v_proj.weight",
}

MASK_GENERATOR_MARK = "self_attn.sparse_mask_generator."


def layer_name(key: str, i: int) -> str:
    """Full tensor name of per-layer short name `key` for layer i."""
    for table in (COMMON, OWNING, SHARING, DENSE_KV):
        if key in table:
            return table[key].format(i=i)
    raise KeyError(f"unknown per-layer tensor key {key!r}")


def expected_shapes(cfg: ModelConfig, ranks: dict[int, tuple[int, int]]) -> dict[str, tuple[int, ...]]:
    """Every required tensor name -> shape, given the latent ranks (r_k, r_v) of owning layers.

    Ranks are not in config.json (spec 2: they come from tensor shapes); callers read them from
    the `k_svd_S`/`v_svd_S` shapes first.
    """
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    qd, kvd = cfg.q_dim, cfg.kv_dim
    nI, dI = cfg.gsm.indexer_heads, cfg.gsm.indexer_dim
    shapes: dict[str, tuple[int, ...]] = {EMBED: (V, H), FINAL_NORM: (H,)}
    if not cfg.tie_word_embeddings:
        shapes[LM_HEAD] = (V, H)
    for i in range(cfg.num_hidden_layers):
        f = {k: v.format(i=i) for k, v in {**COMMON, **OWNING, **SHARING}.items()}
        shapes.update({
            f["input_norm"]: (H,), f["q_proj"]: (qd, H), f["o_proj"]: (H, qd),
            f["post_norm"]: (H,), f["gate_proj"]: (I, H), f["up_proj"]: (I, H),
            f["down_proj"]: (H, I),
        })
        if cfg.is_owning(i):
            rk, rv = ranks[i]
            shapes.update({
                f["k_U"]: (kvd, rk), f["k_S"]: (rk,), f["k_Vt"]: (rk, H),
                f["v_U"]: (kvd, rv), f["v_S"]: (rv,), f["v_Vt"]: (rv, H),
                f["idx_q"]: (nI * dI, H), f["idx_k"]: (dI, H), f["idx_w"]: (nI, H),
            })
        else:
            rk, rv = ranks[cfg.gsm.kv_sharing[i]]
            shapes.update({f["proj_w"]: (2 * kvd, rk + rv), f["proj_b"]: (2 * kvd,)})
    return shapes


def optional_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Tensors a checkpoint may carry beyond the required ones (dense K/V of owning layers)."""
    kvd, H = cfg.kv_dim, cfg.hidden_size
    out: dict[str, tuple[int, ...]] = {}
    for i in cfg.owning_layers:
        out[layer_name("k_proj", i)] = (kvd, H)
        out[layer_name("v_proj", i)] = (kvd, H)
    return out


# kv_calibration.safetensors (spec 5; the INT4 pair is optional, decisions "A 4-bit tier")
CALIB_TENSORS = ("scale_int8", "scale_int12", "comp_int8", "scale_int4", "comp_int4")
CALIB_REQUIRED = ("scale_int8", "comp_int8")
def calib_name(i: int, kv: str, what: str) -> str:
    """`layers.{i}.{k,v}.{scale_int8,scale_int12,comp_int8,scale_int4,comp_int4}`."""
    assert kv in ("k", "v") and what in CALIB_TENSORS
    return f"layers.{i}.{kv}.{what}"


# [H, H] float32, optional: the mean of x x^T over calibration tokens of the LM head's input x (the final normed
# hidden state), which lets a build quantise the head by GPTQ (builder/gptq.py; decisions "INT4 heads by GPTQ on the
# head's input moment")
HEAD_INPUT_MOMENT = "head.input_moment"


def index_key_scale_name(i: int) -> str:
    """`layers.{i}.index_key.scale_int8` [dI]: per-channel scale of owning layer i's INT8 indexer keys
    (decisions "INT8 indexer keys"; required when kv_quantization.index_key_bits is 8)."""
    return f"layers.{i}.index_key.scale_int8"
