"""DeepSeek-MoE (DeepseekForCausalLM, model_type "deepseek": deepseek-moe-16b's remote code, which transformers does
not ship, so there is no HF fixture). A random checkpoint laid out as modeling_deepseek.py names it, written with
the safetensors library, is checked against the NumPy restatement of that code
(tests/helpers/numpy_reference.forward_hf, itself checked against HF's logits on the Qwen2-MoE/Mixtral fixtures in
test_numpy_reference_matches_hf) and converted back bit for bit."""

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import mjax
from mjax.convert import hf_to_mjax, mjax_to_hf
from mjax.convert.hf import model_config_from_hf
from tests.helpers.convert_utils import FIXTURES, LOGITS_ATOL, MOE_NAMES, read_safetensors, reference
from tests.helpers.numpy_reference import forward_hf

# deepseek-moe-16b-base's config.json keys, at a tiny size: 5 layers, layer 0 dense (first_k_dense_replace) and MoE
# on even layers after it (moe_layer_freq 2), so the dense and MoE stacks interleave: dense 0, 1, 3; MoE 2, 4.
CONFIG = {
    "architectures": ["DeepseekForCausalLM"], "model_type": "deepseek", "attention_bias": False,
    "attention_dropout": 0.0, "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekConfig",
                                           "AutoModelForCausalLM": "modeling_deepseek.DeepseekForCausalLM"},
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 1, "hidden_act": "silu",
    "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96, "max_position_embeddings": 128,
    "moe_intermediate_size": 16, "moe_layer_freq": 2, "n_routed_experts": 6, "n_shared_experts": 2,
    "norm_topk_prob": False, "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 5,
    "num_key_value_heads": 4, "pretraining_tp": 1, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 10000.0, "scoring_func": "softmax", "seq_aux": True, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 300,
}
MOE_LAYERS = (2, 4)


def deepseek_tensors(cfg: dict, seed: int) -> dict:
    """Random bf16 weights under modeling_deepseek.py's names ([out, in]); norms near one."""
    rng = np.random.default_rng(seed)
    d, f, fe = cfg["hidden_size"], cfg["intermediate_size"], cfg["moe_intermediate_size"]
    rand = lambda *shape: (0.08 * rng.standard_normal(shape)).astype(ml_dtypes.bfloat16)  # noqa: E731
    norm = lambda: (1 + 0.1 * rng.standard_normal(d)).astype(ml_dtypes.bfloat16)  # noqa: E731

    def mlp(prefix, width):
        return {prefix + "gate_proj.weight": rand(width, d), prefix + "up_proj.weight": rand(width, d),
                prefix + "down_proj.weight": rand(d, width)}

    out = {"model.embed_tokens.weight": rand(cfg["vocab_size"], d), "model.norm.weight": norm(),
           "lm_head.weight": rand(cfg["vocab_size"], d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm()})
        out.update({f"{p}self_attn.{n}_proj.weight": rand(d, d) for n in ("q", "k", "v", "o")})
        if i not in MOE_LAYERS:
            out.update(mlp(p + "mlp.", f))
            continue
        out[p + "mlp.gate.weight"] = rand(cfg["n_routed_experts"], d)
        for j in range(cfg["n_routed_experts"]):
            out.update(mlp(f"{p}mlp.experts.{j}.", fe))
        out.update(mlp(p + "mlp.shared_experts.", fe * cfg["n_shared_experts"]))
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["not_renormalised", "renormalised"])
def deepseek(request, tmp_path_factory):
    """(HF dir, its config, tensors, converted mjax dir, exported HF dir)."""
    root = tmp_path_factory.mktemp("deepseek")
    cfg = dict(CONFIG, norm_topk_prob=request.param)
    tensors = deepseek_tensors(cfg, seed=7)
    hf = root / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    hf_to_mjax(hf, root / "mjax")
    mjax_to_hf(root / "mjax", root / "out", max_shard_bytes=50_000)
    return hf, cfg, tensors, root / "mjax", root / "out"


def test_config_translation(deepseek):
    hf, cfg, *_ = deepseek
    m = model_config_from_hf(cfg)
    assert m.moe_layer_pattern() == (False, False, True, False, True)
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.ffn_hidden_size) == (6, 2, 16, 96)
    assert m.moe_shared_expert_intermediate_size == 32 and not m.moe_shared_expert_gate  # 2 shared experts of 16
    assert m.moe_router_pre_softmax is not cfg["norm_topk_prob"]


def test_logits_match_the_numpy_reference(deepseek):
    hf, cfg, tensors, ckpt, _ = deepseek
    tokens = reference("qwen2_moe")["tokens"]  # any ids < 300
    routing = []
    want = forward_hf(tensors, cfg, tokens, routing)
    assert {layer for layer, *_ in routing} == set(MOE_LAYERS)
    assert min(margin for *_, margin in routing) > 1e-4  # no routing choice within float noise of a tie
    for layer in MOE_LAYERS:  # every expert is used, so a mis-mapped one would show
        ids = np.concatenate([r[1] for r in routing if r[0] == layer])
        assert np.unique(ids).size == cfg["n_routed_experts"]
    flipped = forward_hf(tensors, dict(cfg, norm_topk_prob=not cfg["norm_topk_prob"]), tokens)
    assert np.abs(flipped - want).max() > 100 * LOGITS_ATOL  # the routing flag is visible in the logits
    for path in (hf, ckpt):  # the HF directory itself, and the converted checkpoint
        model, _ = mjax.load_pretrained(path)
        np.testing.assert_allclose(np.asarray(model(tokens)), want, atol=LOGITS_ATOL, rtol=0, err_msg=str(path))


def test_round_trip_reproduces_every_tensor_and_config(deepseek):
    hf, cfg, tensors, _, out = deepseek
    exported = read_safetensors(out)
    assert sorted(exported) == sorted(tensors)
    for k, a in tensors.items():
        assert (exported[k].dtype, exported[k].tobytes()) == (a.dtype, a.tobytes()), k
    dst = json.loads((out / "config.json").read_text())
    assert model_config_from_hf(dst) == model_config_from_hf(cfg)
    for key in ("architectures", "model_type", "n_routed_experts", "n_shared_experts", "moe_intermediate_size",
                "first_k_dense_replace", "moe_layer_freq", "norm_topk_prob", "num_experts_per_tok", "scoring_func",
                "intermediate_size", "auto_map", "eos_token_id"):
        assert dst[key] == cfg[key], key


@pytest.mark.parametrize("name", MOE_NAMES)
def test_numpy_reference_matches_hf(name):
    """The oracle above, on the families transformers has: HF's fp32 logits and routing."""
    ref = reference(name)
    cfg = json.loads((FIXTURES / name / "config.json").read_text())
    routing = []
    logits = forward_hf(read_safetensors(FIXTURES / name), cfg, ref["tokens"], routing)
    np.testing.assert_allclose(logits, ref["logits"], atol=LOGITS_ATOL, rtol=0)
    for row, layer in enumerate(ref["router_layers"]):
        ids = np.concatenate([r[1] for r in routing if r[0] == layer])  # batch rows in order: HF's flattening
        np.testing.assert_array_equal(ids, ref["router_ids"][row])
