"""DeepSeek-V2 and DeepSeek-V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM): multi-head latent attention
(mjax/model/mla.py) and DeepSeek-MoE's experts (moe.py's names), in both directions.

HF tensors of a block's attention ([out, in]) and their mjax parameters (x @ W layout, stacked [layers, ...]):

    self_attn.q_proj [N (dn + dr), D]             -> attn/q_proj/kernel [D, N, dn + dr]       (no q LoRA: V2-Lite)
    self_attn.q_a_proj [Rq, D]                    -> attn/q_down_proj/kernel [D, Rq]
    self_attn.q_a_layernorm [Rq]                  -> attn/q_norm/scale
    self_attn.q_b_proj [N (dn + dr), Rq]          -> attn/q_up_proj/kernel [Rq, N, dn + dr]
    self_attn.kv_a_proj_with_mqa [C + dr, D]      -> attn/kv_down_proj/kernel [D, C + dr]
    self_attn.kv_a_layernorm [C]                  -> attn/kv_norm/scale
    self_attn.kv_b_proj [N (dn + dv), C]          -> attn/kv_up_proj/kernel [C, N, dn + dv]
    self_attn.o_proj [D, N dv]                    -> attn/o_proj/kernel [N, dv, D]
    mlp.gate.e_score_correction_bias [E] (V3)     -> moe_layers/mlp/router/expert_bias [E]

RoPE layout: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... of the dr RoPE dims (V2 always, V3 with
rope_interleave, its default); mjax rotates the two halves. The RoPE outputs of the query and key projections are
reordered evens-then-odds on import (and back on export): a half-split rotation of the reordered dims is the
interleaved rotation reordered, and q k^T sums over the dims, so the attention is unchanged and the round trip
exact.

Routing. V2: softmax over the experts, the top-k weights not renormalised (--moe_router_pre_softmax), times
routed_scaling_factor; topk_method group_limited_greedy ranks n_group groups by their best score
(--moe_router_group_score_topk=1) and keeps topk_group. V3: sigmoid scores, e_score_correction_bias moving the
choice only (--moe_router_enable_expert_bias), groups ranked by the sum of their best 2 scores, the top-k weights
renormalised (norm_topk_prob), times routed_scaling_factor. Layers before first_k_dense_replace are dense.

Multi-token prediction (V3's num_nextn_predict_layers -> --mtp_num_layers): HF layer num_hidden_layers + k - 1 is
depth k (mjax/model/mtp.py; its params stacked [depths, ...] under mtp/layers/):

    enorm, hnorm [D]                 -> mtp/layers/enorm/scale, hnorm/scale
    eh_proj [D, 2D]                  -> mtp/layers/eh_proj/kernel [2D, D]   (input: the embedding's half first)
    shared_head.norm [D]             -> mtp/layers/final_norm/scale
    the block's tensors (as above)   -> mtp/layers/block/...                (MoE, like V3's last layers)
    embed_tokens, shared_head.head   -> copies of model.embed_tokens and lm_head: mjax shares those, so import
                                        checks each copy equals its original and export writes them.
"""

import numpy as np

from mjax.convert.llama import CHECKS, EMBEDDING, IGNORE, KEYS, OUTPUT, L, mlp_rules
from mjax.convert.moe import ROUTER, SHARED, deepseek_layers, expert_rules
from mjax.convert.spec import (EMBED, IDENTITY, LINEAR, LM_HEAD, REQUIRED, ConversionError, Family, _single,
                               check_fixed, check_values, read_keys, rule, write_keys)


def _rope_order(width: int, rope: int) -> np.ndarray:
    """Indices that reorder the last `rope` of `width` dims from interleaved pairs to halves (evens, then odds)."""
    tail = np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)])
    return np.concatenate([np.arange(width - rope), width - rope + tail])


def _to_halves(y, d):  # [..., width] with the RoPE dims last, interleaved -> halves
    return y[..., _rope_order(y.shape[-1], d.rope)]


def _to_pairs(y, d):  # the inverse of _to_halves
    return y[..., np.argsort(_rope_order(y.shape[-1], d.rope))]


# q_proj / q_b_proj: [N (dn + dr), in] <-> [in, N, dn + dr], RoPE dims reordered per head
ROPE_HEADS_OUT = _single("rope_heads_out", lambda x, d: _to_halves(x.T.reshape(x.shape[1], d.n, -1), d),
                         lambda y, d: _to_pairs(y, d).reshape(y.shape[0], -1).T, lambda s, d: (s[1] * s[2], s[0]))
# kv_a_proj_with_mqa: [C + dr, D] <-> [D, C + dr], the shared key's RoPE dims reordered
ROPE_LATENT = _single("rope_latent", lambda x, d: _to_halves(x.T, d), lambda y, d: _to_pairs(y, d).T,
                      lambda s, d: s[::-1])
# kv_b_proj: [N (dn + dv), C] <-> [C, N, dn + dv]
LATENT_HEADS_OUT = _single("latent_heads_out", lambda x, d: x.T.reshape(x.shape[1], d.n, -1),
                           lambda y, d: y.reshape(y.shape[0], -1).T, lambda s, d: (s[1] * s[2], s[0]))
# o_proj: [D, N dv] <-> [N, dv, D]
VALUE_HEADS_IN = _single("value_heads_in", lambda x, d: x.T.reshape(d.n, -1, x.shape[0]),
                         lambda y, d: y.reshape(-1, y.shape[-1]).T, lambda s, d: (s[2], s[0] * s[1]))


def mla_rules(stack: str) -> tuple:
    """The norms and multi-latent attention of one stack's blocks (q_proj or the q LoRA pair, as the model has)."""
    s, a = stack + "/", L + "self_attn."
    return (rule(L + "input_layernorm.weight", s + "attn_norm/scale"),
            rule(a + "q_proj.weight", s + "attn/q_proj/kernel", ROPE_HEADS_OUT),
            rule(a + "q_a_proj.weight", s + "attn/q_down_proj/kernel", LINEAR),
            rule(a + "q_a_layernorm.weight", s + "attn/q_norm/scale", IDENTITY),
            rule(a + "q_b_proj.weight", s + "attn/q_up_proj/kernel", ROPE_HEADS_OUT),
            rule(a + "kv_a_proj_with_mqa.weight", s + "attn/kv_down_proj/kernel", ROPE_LATENT),
            rule(a + "kv_a_layernorm.weight", s + "attn/kv_norm/scale", IDENTITY),
            rule(a + "kv_b_proj.weight", s + "attn/kv_up_proj/kernel", LATENT_HEADS_OUT),
            rule(a + "o_proj.weight", s + "attn/o_proj/kernel", VALUE_HEADS_IN),
            rule(L + "post_attention_layernorm.weight", s + "mlp_norm/scale"))


M = L + "mlp."
DEEPSEEK_V2_RULES = (EMBEDDING, *mla_rules("layers"), *mlp_rules(M, "layers/mlp"), *mla_rules("moe_layers"),
                     rule(M + "gate.weight", ROUTER, LINEAR), *expert_rules(M),
                     *mlp_rules(M + "shared_experts.", SHARED), *OUTPUT)
MTP, MTP_BLOCK = "mtp/layers/", "mtp/layers/block"
MTP_RULES = (rule(L + "enorm.weight", MTP + "enorm/scale"), rule(L + "hnorm.weight", MTP + "hnorm/scale"),
             rule(L + "eh_proj.weight", MTP + "eh_proj/kernel", LINEAR),
             rule(L + "shared_head.norm.weight", MTP + "final_norm/scale"),
             *mla_rules(MTP_BLOCK), *mlp_rules(M, MTP_BLOCK + "/mlp"),  # the dense MLP when the last layer is dense
             rule(M + "gate.weight", MTP_BLOCK + "/mlp/router/kernel", LINEAR),
             *expert_rules(M, block=MTP_BLOCK), *mlp_rules(M + "shared_experts.", MTP_BLOCK + "/mlp/shared_experts"),
             rule(M + "gate.e_score_correction_bias", MTP_BLOCK + "/mlp/router/expert_bias", IDENTITY),
             rule(L + "embed_tokens.weight", "embed/embedding", EMBED, repeated_in="mtp"),
             rule(L + "shared_head.head.weight", "lm_head/kernel", LM_HEAD, repeated_in="mtp"))
DEEPSEEK_V3_RULES = (*DEEPSEEK_V2_RULES,
                     rule(M + "gate.e_score_correction_bias", "moe_layers/mlp/router/expert_bias", IDENTITY),
                     *MTP_RULES)

MLA_KEYS = (("q_lora_rank", "q_lora_rank", None), ("kv_lora_rank", "kv_lora_rank", REQUIRED),
            ("qk_nope_head_dim", "qk_head_dim", REQUIRED), ("qk_rope_head_dim", "qk_pos_emb_head_dim", REQUIRED),
            ("v_head_dim", "v_head_dim", REQUIRED))
YARN_KEYS = (("factor", "rope_scaling_factor", REQUIRED),
             ("original_max_position_embeddings", "rope_original_max_positions", REQUIRED),
             ("beta_fast", "rope_yarn_beta_fast", 32.0), ("beta_slow", "rope_yarn_beta_slow", 1.0),
             # absent mscale: HF's YaRN then uses mscale(factor, 1) for cos/sin, which mjax's 0 reproduces
             ("mscale", "rope_yarn_mscale", 0.0), ("mscale_all_dim", "rope_yarn_mscale_all_dim", 0.0))
GROUP_SCORE_TOPK = {"DeepseekV2ForCausalLM": 1, "DeepseekV3ForCausalLM": 2}  # fixed in each model's code


def _rope_from_hf(hf: dict, family: str) -> dict:
    """RoPE base and scaling (none or YaRN) from `rope_parameters` or the legacy `rope_theta` + `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or params)
    out = dict(rotary_base=float(params.get("rope_theta", hf.get("rope_theta", 10000.0))), rope_scaling="none")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return out
    if kind != "yarn":
        raise ConversionError(f"{family}: rope scaling type {kind!r} is not supported (mjax supports default, yarn)")
    check_values(scaling, (("attention_factor", (None,), None), ("truncate", (True,), True)), family + " rope_scaling")
    yarn = {k: float(v) for k, v in read_keys(scaling, YARN_KEYS, family + " rope_scaling").items()}
    yarn["rope_original_max_positions"] = int(yarn["rope_original_max_positions"])
    return dict(out, rope_scaling="yarn", **yarn)


def _rope_to_hf(m, original: dict | None) -> dict:
    scaling = None
    if m.rope_scaling == "yarn":
        scaling = dict(rope_type="yarn", **{k: getattr(m, f) for k, f, _ in YARN_KEYS})
    if original and "rope_parameters" in original:
        return {"rope_parameters": dict(scaling or {"rope_type": "default"}, rope_theta=m.rotary_base)}
    return {"rope_theta": m.rotary_base, "rope_scaling": scaling}


def _from_hf(hf: dict, family: str, default_scaling: float) -> dict:
    """The fields V2 and V3 share: sizes, MLA, RoPE, experts and the dense/MoE layer split."""
    check_values(hf, (*CHECKS, ("attention_bias", (False,), False)), family)
    out = read_keys(hf, KEYS, family)
    heads = out["num_attention_heads"]
    if hf.get("num_key_value_heads", heads) != heads:
        raise ConversionError(f"{family}: config.json num_key_value_heads={hf['num_key_value_heads']} differs from "
                              f"num_attention_heads={heads}; multi-latent attention expands keys for every head")
    moe = read_keys(hf, (("n_routed_experts", "num_experts", REQUIRED), ("num_experts_per_tok", "moe_router_topk",
                                                                          REQUIRED),
                         ("moe_intermediate_size", "moe_ffn_hidden_size", REQUIRED)), family)
    first, shared = hf.get("first_k_dense_replace") or 0, hf.get("n_shared_experts")
    if first >= out["num_layers"]:
        raise ConversionError(f"{family}: config.json first_k_dense_replace={first} makes every layer dense; mjax "
                              "converts mixture-of-experts models only with an MoE layer")
    scaling = float(hf.get("routed_scaling_factor", default_scaling))  # absent: the HF config class's default
    return dict(out, **read_keys(hf, MLA_KEYS, family), **_rope_from_hf(hf, family), **moe,
                multi_latent_attention=True, untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings"),
                normalization="rmsnorm", activation="swiglu", position_embedding_type="rope",
                moe_shared_expert_intermediate_size=shared * moe["moe_ffn_hidden_size"] if shared else None,
                moe_layer_freq="1", moe_first_dense_layers=first,
                moe_router_topk_scaling_factor=None if scaling == 1.0 else scaling)


def _groups(n_group, topk_group, arch: str) -> dict:
    """Group-limited routing fields (none for a single group, where it limits nothing)."""
    if not n_group or n_group == 1:
        return dict(moe_router_num_groups=None, moe_router_group_topk=None, moe_router_group_score_topk=None)
    return dict(moe_router_num_groups=n_group, moe_router_group_topk=topk_group,
                moe_router_group_score_topk=GROUP_SCORE_TOPK[arch])


def deepseek_v2_from_hf(hf: dict) -> dict:
    family, arch = "DeepSeek-V2", "DeepseekV2ForCausalLM"
    check_values(hf, (("topk_method", ("greedy", "group_limited_greedy"), "greedy"),), family)
    out = _from_hf(hf, family, 1.0)
    limited = hf.get("topk_method", "greedy") == "group_limited_greedy"
    return dict(out, name="deepseek_v2", moe_router_score_function="softmax", moe_router_pre_softmax=True,
                **_groups(hf.get("n_group") if limited else None, hf.get("topk_group"), arch))


def deepseek_v3_from_hf(hf: dict) -> dict:
    family, arch = "DeepSeek-V3", "DeepseekV3ForCausalLM"
    check_values(hf, (("rope_interleave", (True,), True),), family)
    out = _from_hf(hf, family, 2.5)
    k = out["moe_router_topk"]
    if hf.get("norm_topk_prob", True) != (k > 1):  # mjax renormalises sigmoid weights exactly when k > 1
        raise ConversionError(f"{family}: config.json norm_topk_prob={hf.get('norm_topk_prob')} with "
                              f"num_experts_per_tok={k} is not supported (mjax renormalises the weights iff k > 1)")
    return dict(out, name="deepseek_v3", moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                mtp_num_layers=hf.get("num_nextn_predict_layers") or None,
                **_groups(hf.get("n_group", 8), hf.get("topk_group", 4), arch))


def _to_hf(m, arch: str, model_type: str, original, fixed: dict) -> dict:
    check_fixed(m, dict(multi_latent_attention=True, normalization="rmsnorm", activation="swiglu",
                        add_bias_linear=False, window_size=None, moe_shared_expert_gate=False, **fixed), arch)
    if not m.num_experts:
        raise ConversionError(f"cannot write a dense model (no --num_experts) as {arch}; choose another --architecture")
    first, freq = deepseek_layers(m, arch)
    if freq != 1:
        raise ConversionError(f"cannot write --moe_layer_freq={m.moe_layer_freq} as {arch}: every layer from "
                              "first_k_dense_replace on is MoE")
    ffn, shared = m.moe_ffn_hidden_size or m.ffn_hidden_size, m.moe_shared_expert_intermediate_size
    if shared and shared % ffn:
        raise ConversionError(f"cannot write model.moe_shared_expert_intermediate_size={shared} as {arch}: its shared "
                              f"experts are n_shared_experts * moe_intermediate_size ({ffn})")
    groups = m.moe_router_num_groups
    if groups and m.moe_router_group_score_topk != GROUP_SCORE_TOPK[arch]:
        raise ConversionError(f"cannot write --moe_router_group_score_topk={m.moe_router_group_score_topk} as {arch}: "
                              f"its code ranks a group by its best {GROUP_SCORE_TOPK[arch]} score(s)")
    return {"architectures": [arch], "model_type": model_type, **write_keys(m, KEYS), "hidden_act": "silu",
            "num_key_value_heads": m.num_attention_heads, "head_dim": m.qk_pos_emb_head_dim,
            "tie_word_embeddings": not m.untie_embeddings_and_output_weights, "attention_bias": False,
            **write_keys(m, MLA_KEYS), **_rope_to_hf(m, original), "n_routed_experts": m.num_experts,
            "num_experts_per_tok": m.moe_router_topk, "moe_intermediate_size": ffn,
            "n_shared_experts": shared // ffn if shared else None, "first_k_dense_replace": first,
            "routed_scaling_factor": m.moe_router_topk_scaling_factor or 1.0,
            "n_group": groups or 1, "topk_group": m.moe_router_group_topk or 1}


def deepseek_v2_to_hf(m, original=None) -> dict:
    arch = "DeepseekV2ForCausalLM"
    if m.mtp_depth:
        raise ConversionError(f"cannot write --mtp_num_layers={m.mtp_depth} as {arch}, which has no multi-token "
                              "prediction layers; export as DeepseekV3ForCausalLM")
    out = _to_hf(m, arch, "deepseek_v2", original, dict(moe_router_score_function="softmax",
                                                         moe_router_pre_softmax=True,
                                                         moe_router_enable_expert_bias=False))
    return dict(out, topk_method="group_limited_greedy" if m.moe_router_num_groups else "greedy",
                norm_topk_prob=False)


def deepseek_v3_to_hf(m, original=None) -> dict:
    arch = "DeepseekV3ForCausalLM"
    out = _to_hf(m, arch, "deepseek_v3", original, dict(moe_router_score_function="sigmoid",
                                                         moe_router_enable_expert_bias=True))
    if m.mtp_depth and not m.untie_embeddings_and_output_weights:
        raise ConversionError(f"cannot write --mtp_num_layers={m.mtp_depth} with tied embeddings as {arch}: its MTP "
                              "layers hold a copy of the output layer (shared_head.head), which a tied model lacks")
    return dict(out, topk_method="noaux_tc", norm_topk_prob=m.moe_router_topk > 1, rope_interleave=True,
                num_nextn_predict_layers=m.mtp_depth)


DEEPSEEK_V2 = Family("deepseek_v2", ("DeepseekV2ForCausalLM",), DEEPSEEK_V2_RULES, deepseek_v2_from_hf,
                     deepseek_v2_to_hf, IGNORE)
DEEPSEEK_V3 = Family("deepseek_v3", ("DeepseekV3ForCausalLM",), DEEPSEEK_V3_RULES, deepseek_v3_from_hf,
                     deepseek_v3_to_hf, IGNORE)
MLA_FAMILIES = (DEEPSEEK_V2, DEEPSEEK_V3)
