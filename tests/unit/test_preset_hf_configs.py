"""Presets of converted families against the model their published Hugging Face config.json converts to: the
architecture must be the one the checkpoint loads into (load-balancing settings are training choices that
config.json does not carry)."""

import dataclasses

from mjax.config import load_config
from mjax.convert.hf import model_config_from_hf

# moonshotai/Moonlight-16B-A3B's config.json (the fields its DeepseekV3ForCausalLM reads).
MOONLIGHT = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 163840,
    "hidden_size": 2048, "intermediate_size": 11264, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
    "routed_scaling_factor": 2.446, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 6, "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu",
    "max_position_embeddings": 8192, "initializer_range": 0.02, "rms_norm_eps": 1e-05, "rope_theta": 50000.0,
    "rope_scaling": None, "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 163584,
    "eos_token_id": 163585, "num_nextn_predict_layers": 0, "torch_dtype": "bfloat16",
}
TRAINING_CHOICES = {"name", "moe_router_load_balancing_type", "moe_aux_loss_coeff"}


def differences(preset: str, hf: dict) -> dict:
    want, got = model_config_from_hf(hf), load_config(preset).model
    return {f.name: (getattr(got, f.name), getattr(want, f.name)) for f in dataclasses.fields(want)
            if f.name not in TRAINING_CHOICES and getattr(got, f.name) != getattr(want, f.name)}


def test_moonlight_preset_is_the_published_architecture():
    assert differences("moonlight-16b-a3b", MOONLIGHT) == {}
    m = load_config("moonlight-16b-a3b").model  # and it trains as Moonlight's config says
    assert (m.moe_router_load_balancing_type, m.moe_aux_loss_coeff) == ("seq_aux_loss", 0.001)


def test_a_changed_field_shows():
    assert differences("moonlight-16b-a3b", dict(MOONLIGHT, routed_scaling_factor=2.5)) == {
        "moe_router_topk_scaling_factor": (2.446, 2.5)}
