"""Mixture-of-experts families: Mixtral, Qwen2-MoE (Qwen1.5-MoE), Qwen3-MoE, OLMoE and DeepSeek-MoE (V1,
`DeepseekForCausalLM`): Llama's embedding, norms, attention and output names (llama.py), with a routed-expert MLP
in all layers or (Qwen2/3-MoE, DeepSeek) in some.

HF tensors of an MoE layer, one per expert as the Hub stores them ([out, in]), and their mjax parameters
(mjax/model/moe.py; x @ W layout, stacked [MoE layers, experts, ...]):

    mlp.gate [E, D]                         -> moe_layers/mlp/router/kernel [D, E]
    mlp.experts.{j}.gate_proj, up_proj [F, D]  -> moe_layers/mlp/experts/{gate,up}_proj/kernel [E, D, F]
    mlp.experts.{j}.down_proj [D, F]        -> moe_layers/mlp/experts/down_proj/kernel [E, F, D]
    mlp.shared_expert.* (Qwen2-MoE), mlp.shared_experts.* (DeepSeek)  -> moe_layers/mlp/shared_experts/* (an MLP)
    mlp.shared_expert_gate [1, D] (Qwen2-MoE)  -> moe_layers/mlp/shared_expert_gate/kernel [D, 1]
Mixtral names them block_sparse_moe.gate and block_sparse_moe.experts.{j}.w1 (gate), w3 (up), w2 (down). The dense
layers of a mixed model keep Llama's mlp.* names in `layers/...`; which layers are MoE follows the HF config
(Qwen: not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0; DeepSeek: i >= first_k_dense_replace and
i % moe_layer_freq == 0) and becomes --moe_layer_freq / --moe_first_dense_layers.

Routing is a softmax over the router logits, then the top-k. HF's norm_topk_prob=True (the top-k probabilities
renormalised; Mixtral always) is --moe_router_pre_softmax=False (the softmax of the top-k logits: the same weights);
norm_topk_prob=False is --moe_router_pre_softmax=True. DeepSeek renormalises only when top_k > 1.
"""

from mjax.convert.llama import (EMBEDDING, IGNORE, L, OUTPUT, attention_rules, common_from_hf, common_to_hf,
                                mlp_rules, qwen2_window, qwen2_window_to_hf)
from mjax.convert.spec import LINEAR, REQUIRED, ConversionError, Family, check_fixed, check_values, read_keys, rule

ROUTER = "moe_layers/mlp/router/kernel"
SHARED = "moe_layers/mlp/shared_experts"


def expert_rules(hf_prefix: str, names=("gate_proj", "up_proj", "down_proj"), block: str = "moe_layers") -> tuple:
    """Per-expert SwiGLU weights `{hf_prefix}experts.{j}.{name}.weight` -> stacked {block}/mlp/experts/*."""
    return tuple(rule(f"{hf_prefix}experts.{{j}}.{hf}.weight", f"{block}/mlp/experts/{mj}/kernel", LINEAR)
                 for hf, mj in zip(names, ("gate_proj", "up_proj", "down_proj")))


def qk_norm_rules(stack: str) -> tuple:  # the weights' width (per head or all heads) comes from the config
    return (rule(L + "self_attn.q_norm.weight", stack + "/attn/q_norm/scale"),
            rule(L + "self_attn.k_norm.weight", stack + "/attn/k_norm/scale"))


M = L + "mlp."
DENSE_BLOCKS = (*attention_rules("layers"), *mlp_rules(M, "layers/mlp"))  # the dense blocks of a mixed model
MIXTRAL_RULES = (EMBEDDING, *attention_rules("moe_layers"), rule(L + "block_sparse_moe.gate.weight", ROUTER, LINEAR),
                 *expert_rules(L + "block_sparse_moe.", ("w1", "w3", "w2")), *OUTPUT)
QWEN2_MOE_RULES = (EMBEDDING, *DENSE_BLOCKS, *attention_rules("moe_layers"), rule(M + "gate.weight", ROUTER, LINEAR),
                   *expert_rules(M), *mlp_rules(M + "shared_expert.", SHARED),
                   rule(M + "shared_expert_gate.weight", "moe_layers/mlp/shared_expert_gate/kernel", LINEAR), *OUTPUT)
QWEN3_MOE_RULES = (EMBEDDING, *DENSE_BLOCKS, *qk_norm_rules("layers"), *attention_rules("moe_layers"),
                   *qk_norm_rules("moe_layers"), rule(M + "gate.weight", ROUTER, LINEAR), *expert_rules(M), *OUTPUT)
OLMOE_RULES = (EMBEDDING, *attention_rules("moe_layers"), *qk_norm_rules("moe_layers"),
               rule(M + "gate.weight", ROUTER, LINEAR), *expert_rules(M), *OUTPUT)
DEEPSEEK_RULES = (EMBEDDING, *DENSE_BLOCKS, *attention_rules("moe_layers"), rule(M + "gate.weight", ROUTER, LINEAR),
                  *expert_rules(M), *mlp_rules(M + "shared_experts.", SHARED), *OUTPUT)

# ---- config translation ----
QWEN_LAYER_KEYS = "mlp_only_layers / decoder_sparse_step"


def _layer_freq(pattern: tuple, family: str, keys: str) -> dict:
    """--moe_layer_freq for a per-layer pattern (True = MoE)."""
    if not any(pattern):
        raise ConversionError(f"{family}: config.json {keys} make every layer dense; mjax converts mixture-of-experts "
                              "models only with at least one MoE layer")
    text = "1" if all(pattern) else "[" + ",".join(str(int(p)) for p in pattern) + "]"
    return dict(moe_layer_freq=text, moe_first_dense_layers=0)


def _moe_from_hf(hf: dict, family: str, experts_key: str, norm_topk: bool) -> dict:
    """The routed experts' fields: count, top-k and routing (`norm_topk`: HF renormalises the top-k weights)."""
    keys = read_keys(hf, ((experts_key, "num_experts", REQUIRED), ("num_experts_per_tok", "moe_router_topk", REQUIRED)),
                     family)
    return dict(keys, moe_router_pre_softmax=not norm_topk, moe_router_score_function="softmax")


def _check_moe(m, arch: str, fixed: dict, all_moe: bool = False):
    """Export: an MoE model whose routing and layout `arch` can express."""
    if not m.num_experts:
        raise ConversionError(f"cannot write a dense model (no --num_experts) as {arch}; choose another --architecture")
    check_fixed(m, dict(moe_router_score_function="softmax", moe_router_num_groups=None,
                        moe_router_enable_expert_bias=False, **fixed), arch)
    if m.moe_router_topk_scaling_factor not in (None, 1.0):
        raise ConversionError(f"cannot write model.moe_router_topk_scaling_factor={m.moe_router_topk_scaling_factor} "
                              f"as {arch}: it has no routed scaling factor")
    if all_moe and not all(m.moe_layer_pattern()):
        raise ConversionError(f"cannot write dense layers (--moe_layer_freq={m.moe_layer_freq}, "
                              f"--moe_first_dense_layers={m.moe_first_dense_layers}) as {arch}: every layer of it is "
                              "MoE; choose another --architecture")


def _expert_ffn(m) -> int:
    return m.moe_ffn_hidden_size or m.ffn_hidden_size


def _moe_to_hf(m) -> dict:
    return {"num_experts_per_tok": m.moe_router_topk, "norm_topk_prob": not m.moe_router_pre_softmax}


def _qwen_pattern(hf: dict, layers: int, experts: int) -> tuple:
    only = set(hf.get("mlp_only_layers") or [])
    step = hf.get("decoder_sparse_step") or 1
    return tuple(i not in only and experts > 0 and (i + 1) % step == 0 for i in range(layers))


def _qwen_layers_to_hf(m) -> dict:
    return {"decoder_sparse_step": 1, "mlp_only_layers": [i for i, moe in enumerate(m.moe_layer_pattern()) if not moe]}



def mixtral_from_hf(hf: dict) -> dict:
    check_values(hf, (("router_jitter_noise", (0.0,), 0.0),), "Mixtral")  # training noise mjax does not add
    out = common_from_hf(hf, "Mixtral")
    return dict(out, name="mixtral", window_size=hf.get("sliding_window"),
                moe_ffn_hidden_size=out["ffn_hidden_size"], moe_layer_freq="1",
                **_moe_from_hf(hf, "Mixtral", "num_local_experts", norm_topk=True))


def mixtral_to_hf(m, original=None) -> dict:
    arch = "MixtralForCausalLM"
    _check_moe(m, arch, dict(moe_router_pre_softmax=False, add_qkv_bias=False, qk_layernorm=False,
                             moe_shared_expert_intermediate_size=None), all_moe=True)
    return dict(common_to_hf(m, arch, "mixtral", original), intermediate_size=_expert_ffn(m),
                num_local_experts=m.num_experts, num_experts_per_tok=m.moe_router_topk,
                sliding_window=m.window_size, router_jitter_noise=0.0)


def qwen2_moe_from_hf(hf: dict) -> dict:
    family = "Qwen2-MoE"
    out = common_from_hf(hf, family)
    moe = _moe_from_hf(hf, family, "num_experts", norm_topk=hf.get("norm_topk_prob", False))
    sizes = read_keys(hf, (("moe_intermediate_size", "moe_ffn_hidden_size", REQUIRED),
                           ("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size", REQUIRED)),
                      family)
    pattern = _qwen_pattern(hf, out["num_layers"], moe["num_experts"])
    return dict(out, name="qwen2_moe", add_qkv_bias=hf.get("qkv_bias", True), window_size=qwen2_window(hf, family),
                moe_shared_expert_gate=True, **moe, **sizes, **_layer_freq(pattern, family, QWEN_LAYER_KEYS))


def qwen2_moe_to_hf(m, original=None) -> dict:
    arch = "Qwen2MoeForCausalLM"
    _check_moe(m, arch, dict(qk_layernorm=False, moe_shared_expert_gate=True))
    return dict(common_to_hf(m, arch, "qwen2_moe", original), qkv_bias=m.add_qkv_bias, **qwen2_window_to_hf(m),
                num_experts=m.num_experts, moe_intermediate_size=_expert_ffn(m),
                shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size, **_moe_to_hf(m),
                **_qwen_layers_to_hf(m))


def qwen3_moe_from_hf(hf: dict) -> dict:
    family = "Qwen3-MoE"
    check_values(hf, (("attention_bias", (False,), False), ("use_sliding_window", (False,), False)), family)
    out = common_from_hf(hf, family)
    key = "num_experts" if "num_experts" in hf else "num_local_experts"  # the Hub's key; transformers 5 saves the other
    moe = _moe_from_hf(hf, family, key, norm_topk=hf.get("norm_topk_prob", False))
    sizes = read_keys(hf, (("moe_intermediate_size", "moe_ffn_hidden_size", REQUIRED),), family)
    pattern = _qwen_pattern(hf, out["num_layers"], moe["num_experts"])
    return dict(out, name="qwen3_moe", qk_layernorm=True, **moe, **sizes,
                **_layer_freq(pattern, family, QWEN_LAYER_KEYS))


def qwen3_moe_to_hf(m, original=None) -> dict:
    arch = "Qwen3MoeForCausalLM"
    _check_moe(m, arch, dict(qk_layernorm=True, qk_layernorm_across_heads=False, add_qkv_bias=False,
                             window_size=None, moe_shared_expert_intermediate_size=None))
    key = "num_local_experts" if original and "num_local_experts" in original and "num_experts" not in original \
        else "num_experts"
    return dict(common_to_hf(m, arch, "qwen3_moe", original), attention_bias=False, use_sliding_window=False,
                sliding_window=None, **{key: m.num_experts}, moe_intermediate_size=_expert_ffn(m), **_moe_to_hf(m),
                **_qwen_layers_to_hf(m))


def olmoe_from_hf(hf: dict) -> dict:
    family = "OLMoE"
    check_values(hf, (("attention_bias", (False,), False), ("clip_qkv", (None,), None)), family)
    out = common_from_hf(hf, family)
    if out["kv_channels"] is not None:  # its q_norm spans hidden_size, so heads * head_dim must be hidden_size
        raise ConversionError(f"{family}: config.json head_dim={hf['head_dim']} is not hidden_size / "
                              "num_attention_heads, which OLMoE's q_norm over hidden_size assumes")
    return dict(out, name="olmoe", qk_layernorm=True, qk_layernorm_across_heads=True,
                moe_ffn_hidden_size=out["ffn_hidden_size"], moe_layer_freq="1",
                **_moe_from_hf(hf, family, "num_experts", norm_topk=hf.get("norm_topk_prob", False)))


def olmoe_to_hf(m, original=None) -> dict:
    arch = "OlmoeForCausalLM"
    _check_moe(m, arch, dict(qk_layernorm=True, qk_layernorm_across_heads=True, add_qkv_bias=False,
                             window_size=None, kv_channels=None, moe_shared_expert_intermediate_size=None),
               all_moe=True)
    return dict(common_to_hf(m, arch, "olmoe", original), intermediate_size=_expert_ffn(m), attention_bias=False,
                clip_qkv=None, num_experts=m.num_experts, **_moe_to_hf(m))


def deepseek_from_hf(hf: dict) -> dict:
    family = "DeepSeek-MoE"
    check_values(hf, (("scoring_func", ("softmax",), "softmax"), ("attention_bias", (False,), False),
                      ("rope_scaling", (None,), None)), family)  # its code scales RoPE only linearly / dynamically
    out = common_from_hf(hf, family)
    if out["kv_channels"] is not None:
        raise ConversionError(f"{family}: config.json head_dim={hf['head_dim']}: DeepSeek's attention uses "
                              "hidden_size / num_attention_heads")
    renormalised = hf.get("norm_topk_prob", False) and (hf.get("num_experts_per_tok") or 0) > 1
    moe = _moe_from_hf(hf, family, "n_routed_experts", norm_topk=renormalised)
    ffn = read_keys(hf, (("moe_intermediate_size", "f", REQUIRED),), family)["f"]
    first, freq = hf.get("first_k_dense_replace") or 0, hf.get("moe_layer_freq") or 1
    if not any(i >= first and i % freq == 0 for i in range(out["num_layers"])):
        raise ConversionError(f"{family}: config.json first_k_dense_replace={first} / moe_layer_freq={freq} make "
                              "every layer dense; mjax converts mixture-of-experts models only with an MoE layer")
    shared = hf.get("n_shared_experts")
    return dict(out, name="deepseek_moe", moe_ffn_hidden_size=ffn,
                moe_shared_expert_intermediate_size=shared * ffn if shared else None,
                moe_layer_freq=str(freq), moe_first_dense_layers=first, **moe)


def deepseek_layers(m, arch: str) -> tuple[int, int]:
    """(first_k_dense_replace, moe_layer_freq) giving the model's pattern: layer i is MoE iff i >= first and
    i % freq == 0."""
    pattern = m.moe_layer_pattern()
    tried = [(pattern.index(True), freq) for freq in range(1, len(pattern) + 1)]
    if str(m.moe_layer_freq).strip().isdigit():  # the model's own (first, interval) when it is one: kept as given
        tried.insert(0, (m.moe_first_dense_layers, int(m.moe_layer_freq)))
    for first, freq in tried:
        if pattern == tuple(i >= first and i % freq == 0 for i in range(len(pattern))):
            return first, freq
    raise ConversionError(f"cannot write the layer pattern {[int(p) for p in pattern]} (--moe_layer_freq="
                          f"{m.moe_layer_freq}, --moe_first_dense_layers={m.moe_first_dense_layers}) as {arch}: it "
                          "needs leading dense layers, then MoE on every freq-th layer; choose another --architecture")


def deepseek_to_hf(m, original=None) -> dict:
    arch = "DeepseekForCausalLM"
    _check_moe(m, arch, dict(qk_layernorm=False, add_qkv_bias=False, window_size=None, kv_channels=None,
                             rope_scaling="none", moe_shared_expert_gate=False))
    if m.moe_router_topk == 1 and not m.moe_router_pre_softmax:
        raise ConversionError(f"cannot write model.moe_router_pre_softmax=False with --moe_router_topk=1 as {arch}: "
                              "it never renormalises a single expert's weight")
    ffn, shared = _expert_ffn(m), m.moe_shared_expert_intermediate_size
    if shared and shared % ffn:
        raise ConversionError(f"cannot write model.moe_shared_expert_intermediate_size={shared} as {arch}: its shared "
                              f"experts are n_shared_experts * moe_intermediate_size ({ffn})")
    first, freq = deepseek_layers(m, arch)
    return dict(common_to_hf(m, arch, "deepseek", original), attention_bias=False, scoring_func="softmax",
                n_routed_experts=m.num_experts, n_shared_experts=shared // ffn if shared else None,
                moe_intermediate_size=ffn, first_k_dense_replace=first, moe_layer_freq=freq, **_moe_to_hf(m))


MIXTRAL = Family("mixtral", ("MixtralForCausalLM",), MIXTRAL_RULES, mixtral_from_hf, mixtral_to_hf, IGNORE)
QWEN2_MOE = Family("qwen2_moe", ("Qwen2MoeForCausalLM",), QWEN2_MOE_RULES, qwen2_moe_from_hf, qwen2_moe_to_hf,
                   IGNORE)
QWEN3_MOE = Family("qwen3_moe", ("Qwen3MoeForCausalLM",), QWEN3_MOE_RULES, qwen3_moe_from_hf, qwen3_moe_to_hf,
                   IGNORE)
OLMOE = Family("olmoe", ("OlmoeForCausalLM",), OLMOE_RULES, olmoe_from_hf, olmoe_to_hf, IGNORE)
DEEPSEEK_MOE = Family("deepseek_moe", ("DeepseekForCausalLM",), DEEPSEEK_RULES, deepseek_from_hf, deepseek_to_hf,
                      IGNORE)
MOE_FAMILIES = (MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMOE, DEEPSEEK_MOE)
