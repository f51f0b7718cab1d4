"""Moonlight-16B-A3B (16B total, 3B active; DeepSeek-V3's architecture): multi-head latent attention without query
compression (16 heads, kv rank 512, head dims 128 + 64 RoPE for Q/K, 128 for V, plain RoPE base 50000 over 8k),
27 layers of which the first dense; 64 routed experts top-6 in one group, sigmoid scores with the aux-loss-free
expert bias, routed scaling 2.446, 2 shared experts; vocabulary 163840. The learning-rate schedule is
deepseek-v2-lite's: Moonlight was trained with the Muon optimizer, which mjax does not have."""
from mjax.config import Config


def config() -> Config:
    return Config().replace(
        model=dict(name="moonlight-16b-a3b", num_layers=27, hidden_size=2048, num_attention_heads=16,
                   ffn_hidden_size=11264, vocab_size=163840, max_position_embeddings=8192, norm_epsilon=1e-5,
                   rotary_base=50000.0, untie_embeddings_and_output_weights=True,
                   multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=512, qk_head_dim=128,
                   qk_pos_emb_head_dim=64, v_head_dim=128,
                   num_experts=64, moe_router_topk=6, moe_ffn_hidden_size=1408,
                   moe_shared_expert_intermediate_size=2816, moe_first_dense_layers=1,
                   moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                   moe_router_bias_update_rate=1e-3, moe_router_topk_scaling_factor=2.446,
                   moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-3),
        train=dict(train_iters=100000, seq_length=8192, global_batch_size=1024, micro_batch_size=1),
        optimizer=dict(lr=4.2e-4, min_lr=4.2e-5, lr_warmup_iters=2000, lr_decay_iters=100000),
        data=dict(tokenizer_type="huggingface"),
    )
