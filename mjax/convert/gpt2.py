"""GPT-2: LayerNorm, learned positions, gelu_new (tanh approximation), biases everywhere, tied output layer.

Its Conv1D weights are stored [in, out] (no transpose) and `c_attn` fuses Q, K and V along the output axis.
Files saved from the bare GPT2Model lack the `transformer.` prefix; both spellings are read.
"""

from mjax.convert.spec import (CONV_HEADS_IN, CONV_HEADS_OUT, EMBED, HEADS_BIAS, IDENTITY, LM_HEAD, REQUIRED,
                               ConversionError, Family, check_fixed, check_values, fused, read_keys, rule, write_keys)

H = "transformer.h.{i}."
ATTN = ("layers/attn/q_proj", "layers/attn/k_proj", "layers/attn/v_proj")


def _qkv_sizes(d):  # extents of Q, K, V along the fused axis
    return (d.n * d.h, d.k * d.h, d.k * d.h)


RULES = (
    rule("transformer.wte.weight", "embed/embedding", EMBED),
    rule("transformer.wpe.weight", "pos_embed", IDENTITY),
    rule(H + "ln_1.weight", "layers/attn_norm/scale"),
    rule(H + "ln_1.bias", "layers/attn_norm/bias"),
    rule(H + "attn.c_attn.weight", tuple(p + "/kernel" for p in ATTN), fused((CONV_HEADS_OUT,) * 3, 1, _qkv_sizes)),
    rule(H + "attn.c_attn.bias", tuple(p + "/bias" for p in ATTN), fused((HEADS_BIAS,) * 3, 0, _qkv_sizes)),
    rule(H + "attn.c_proj.weight", "layers/attn/o_proj/kernel", CONV_HEADS_IN),
    rule(H + "attn.c_proj.bias", "layers/attn/o_proj/bias"),
    rule(H + "ln_2.weight", "layers/mlp_norm/scale"),
    rule(H + "ln_2.bias", "layers/mlp_norm/bias"),
    rule(H + "mlp.c_fc.weight", "layers/mlp/up_proj/kernel"),
    rule(H + "mlp.c_fc.bias", "layers/mlp/up_proj/bias"),
    rule(H + "mlp.c_proj.weight", "layers/mlp/down_proj/kernel"),
    rule(H + "mlp.c_proj.bias", "layers/mlp/down_proj/bias"),
    rule("transformer.ln_f.weight", "final_norm/scale"),
    rule("transformer.ln_f.bias", "final_norm/bias"),
    rule("lm_head.weight", "lm_head/kernel", LM_HEAD),
)
IGNORE = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers in old checkpoints

KEYS = (
    ("n_layer", "num_layers", REQUIRED),
    ("n_embd", "hidden_size", REQUIRED),
    ("n_head", "num_attention_heads", REQUIRED),
    ("vocab_size", "vocab_size", REQUIRED),
    ("n_positions", "max_position_embeddings", REQUIRED),
    ("layer_norm_epsilon", "norm_epsilon", 1e-5),
)
FIXED = dict(normalization="layernorm", activation="gelu", position_embedding_type="learned", add_bias_linear=True,
             num_query_groups=None, kv_channels=None, window_size=None)
CHECKS = (
    ("activation_function", ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"), "gelu_new"),
    ("scale_attn_weights", (True,), True),
    ("scale_attn_by_inverse_layer_idx", (False,), False),
    ("add_cross_attention", (False,), False),
)


def gpt2_from_hf(hf: dict) -> dict:
    check_values(hf, CHECKS, "GPT-2")
    out = read_keys(hf, KEYS, "GPT-2")
    out["ffn_hidden_size"] = hf.get("n_inner") or 4 * out["hidden_size"]
    out["untie_embeddings_and_output_weights"] = not hf.get("tie_word_embeddings", True)
    return dict(out, name="gpt2", **FIXED)


def gpt2_to_hf(m, original=None) -> dict:
    check_fixed(m, {k: v for k, v in FIXED.items() if k not in ("num_query_groups", "kv_channels")}, "GPT2LMHeadModel")
    if m.num_kv_heads != m.num_attention_heads or m.head_dim * m.num_attention_heads != m.hidden_size:
        raise ConversionError("GPT2LMHeadModel needs multi-head attention with head dim = hidden / heads")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **write_keys(m, KEYS),
            "n_inner": m.ffn_hidden_size, "activation_function": "gelu_new",
            "tie_word_embeddings": not m.untie_embeddings_and_output_weights}


GPT2 = Family("gpt2", ("GPT2LMHeadModel",), RULES, gpt2_from_hf, gpt2_to_hf, IGNORE,
              strip_prefixes=("transformer.",))
