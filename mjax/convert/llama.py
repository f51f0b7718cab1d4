"""Llama 2/3/3.1/3.2, Mistral and Qwen2/2.5: one tensor table (torch Linear weights, unfused QKV and gate/up,
half-split RoPE as mjax, so no permutation), three config translations.

Differences: Mistral adds a sliding window; Qwen2 adds Q/K/V biases and per-layer window settings; small Llama 3.2
and Qwen2 models tie the output layer to the embedding (then `lm_head` is absent and the rule is skipped).
"""

from mjax.convert.spec import (EMBED, HEADS_BIAS, HEADS_IN, HEADS_OUT, IDENTITY, LINEAR, LM_HEAD, REQUIRED,
                               ConversionError, Family, check_fixed, check_values, read_keys, rule, write_keys)

L = "model.layers.{i}."


def attention_rules(stack: str) -> tuple:
    """The norms and attention of the blocks of one stack ("layers" or "moe_layers"), Llama's names."""
    s = stack + "/"
    return (
        rule(L + "input_layernorm.weight", s + "attn_norm/scale"),
        rule(L + "self_attn.q_proj.weight", s + "attn/q_proj/kernel", HEADS_OUT),
        rule(L + "self_attn.k_proj.weight", s + "attn/k_proj/kernel", HEADS_OUT),
        rule(L + "self_attn.v_proj.weight", s + "attn/v_proj/kernel", HEADS_OUT),
        rule(L + "self_attn.q_proj.bias", s + "attn/q_proj/bias", HEADS_BIAS),
        rule(L + "self_attn.k_proj.bias", s + "attn/k_proj/bias", HEADS_BIAS),
        rule(L + "self_attn.v_proj.bias", s + "attn/v_proj/bias", HEADS_BIAS),
        rule(L + "self_attn.o_proj.weight", s + "attn/o_proj/kernel", HEADS_IN),
        rule(L + "post_attention_layernorm.weight", s + "mlp_norm/scale"),
    )


def mlp_rules(hf_prefix: str, target: str, names=("gate_proj", "up_proj", "down_proj")) -> tuple:
    """A SwiGLU MLP: HF `{hf_prefix}{gate,up,down}.weight` -> mjax `{target}/{gate,up,down}_proj/kernel`."""
    return tuple(rule(f"{hf_prefix}{hf}.weight", f"{target}/{mj}/kernel", LINEAR)
                 for hf, mj in zip(names, ("gate_proj", "up_proj", "down_proj")))


EMBEDDING = rule("model.embed_tokens.weight", "embed/embedding", EMBED)
OUTPUT = (rule("model.norm.weight", "final_norm/scale", IDENTITY), rule("lm_head.weight", "lm_head/kernel", LM_HEAD))
RULES = (EMBEDDING, *attention_rules("layers"), *mlp_rules(L + "mlp.", "layers/mlp"), *OUTPUT)
IGNORE = ("rotary_emb.inv_freq",)  # a buffer some old checkpoints saved

KEYS = (  # (HF key, ModelConfig field, default)
    ("num_hidden_layers", "num_layers", REQUIRED),
    ("hidden_size", "hidden_size", REQUIRED),
    ("num_attention_heads", "num_attention_heads", REQUIRED),
    ("intermediate_size", "ffn_hidden_size", REQUIRED),
    ("vocab_size", "vocab_size", REQUIRED),
    ("max_position_embeddings", "max_position_embeddings", 2048),
    ("rms_norm_eps", "norm_epsilon", 1e-6),
)
FIXED = dict(normalization="rmsnorm", activation="swiglu", position_embedding_type="rope", add_bias_linear=False)
DENSE_ONLY = dict(num_experts=None, qk_layernorm=False)  # export: what the dense families' tables have no tensors for
CHECKS = (("hidden_act", ("silu",), "silu"), ("mlp_bias", (False,), False))


def rope_from_hf(hf: dict, family: str) -> dict:
    """RoPE base and scaling from transformers-5 `rope_parameters` or the older `rope_theta` + `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or params)
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    out = dict(rotary_base=float(theta), rope_scaling="none")
    if kind in (None, "default"):
        return out
    if kind != "llama3":
        raise ConversionError(f"{family}: rope scaling type {kind!r} is not supported (mjax supports default, llama3)")
    return dict(out, rope_scaling="llama3", rope_scaling_factor=float(scaling["factor"]),
                rope_low_freq_factor=float(scaling["low_freq_factor"]),
                rope_high_freq_factor=float(scaling["high_freq_factor"]),
                rope_original_max_positions=int(scaling["original_max_position_embeddings"]))


def rope_to_hf(m, original: dict | None) -> dict:
    """Legacy keys (read by transformers 4 and 5) unless the original config used `rope_parameters`."""
    scaling = None
    if m.rope_scaling == "llama3":
        scaling = dict(rope_type="llama3", factor=m.rope_scaling_factor, low_freq_factor=m.rope_low_freq_factor,
                       high_freq_factor=m.rope_high_freq_factor,
                       original_max_position_embeddings=m.rope_original_max_positions)
    if original and "rope_parameters" in original:
        return {"rope_parameters": dict(scaling or {"rope_type": "default"}, rope_theta=m.rotary_base)}
    return {"rope_theta": m.rotary_base, "rope_scaling": scaling}


def common_from_hf(hf: dict, family: str) -> dict:
    check_values(hf, CHECKS, family)
    out = read_keys(hf, KEYS, family)
    heads = out["num_attention_heads"]
    out["num_query_groups"] = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim")
    out["kv_channels"] = head_dim if head_dim and head_dim != out["hidden_size"] // heads else None
    out["untie_embeddings_and_output_weights"] = not hf.get("tie_word_embeddings", False)
    out.update(FIXED, add_qkv_bias=False, window_size=None, **rope_from_hf(hf, family))
    return out


def common_to_hf(m, arch: str, model_type: str, original) -> dict:
    check_fixed(m, FIXED, arch)
    out = {"architectures": [arch], "model_type": model_type, **write_keys(m, KEYS), "hidden_act": "silu",
           "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim,
           "tie_word_embeddings": not m.untie_embeddings_and_output_weights}
    return {**out, **rope_to_hf(m, original)}


def llama_from_hf(hf: dict) -> dict:
    check_values(hf, (("attention_bias", (False,), False),), "Llama")
    return dict(common_from_hf(hf, "Llama"), name="llama")


def llama_to_hf(m, original=None) -> dict:
    check_fixed(m, dict(DENSE_ONLY, add_qkv_bias=False, window_size=None), "LlamaForCausalLM")
    return dict(common_to_hf(m, "LlamaForCausalLM", "llama", original), attention_bias=False, mlp_bias=False)


def mistral_from_hf(hf: dict) -> dict:
    return dict(common_from_hf(hf, "Mistral"), name="mistral", window_size=hf.get("sliding_window"))


def mistral_to_hf(m, original=None) -> dict:
    check_fixed(m, dict(DENSE_ONLY, add_qkv_bias=False), "MistralForCausalLM")
    return dict(common_to_hf(m, "MistralForCausalLM", "mistral", original), sliding_window=m.window_size)


def qwen2_window(hf: dict, family: str = "Qwen2") -> int | None:
    """Qwen2 windows only layers >= max_window_layers when use_sliding_window; mjax has one window for all."""
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        first = hf.get("max_window_layers", layers) if hf.get("use_sliding_window") else layers
        types = ["full_attention" if i < first else "sliding_attention" for i in range(layers)]
    if all(t == "full_attention" for t in types):
        return None
    if all(t == "sliding_attention" for t in types) and hf.get("sliding_window"):
        return hf["sliding_window"]
    raise ConversionError(f"{family}: layer_types {types} mix full and sliding-window attention; mjax supports one "
                          "window for every layer")


def qwen2_from_hf(hf: dict) -> dict:
    return dict(common_from_hf(hf, "Qwen2"), name="qwen2", add_qkv_bias=True, window_size=qwen2_window(hf))


def qwen2_window_to_hf(m) -> dict:
    """Qwen2's keys for mjax's one window (or none) over every layer."""
    window = m.window_size
    return dict(use_sliding_window=window is not None, sliding_window=window,
                max_window_layers=0 if window else m.num_layers,
                layer_types=["sliding_attention" if window else "full_attention"] * m.num_layers)


def qwen2_to_hf(m, original=None) -> dict:
    check_fixed(m, dict(DENSE_ONLY, add_qkv_bias=True), "Qwen2ForCausalLM")
    return dict(common_to_hf(m, "Qwen2ForCausalLM", "qwen2", original), **qwen2_window_to_hf(m))


LLAMA = Family("llama", ("LlamaForCausalLM",), RULES, llama_from_hf, llama_to_hf, IGNORE)
MISTRAL = Family("mistral", ("MistralForCausalLM",), RULES, mistral_from_hf, mistral_to_hf, IGNORE)
QWEN2 = Family("qwen2", ("Qwen2ForCausalLM",), RULES, qwen2_from_hf, qwen2_to_hf, IGNORE)
