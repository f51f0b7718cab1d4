"""DeepSeek-V3 (671B total, 37B active): multi-head latent attention (128 heads, q rank 1536, kv rank 512, head dims
128 + 64 RoPE for Q/K, 128 for V, YaRN x40 over 4k), 61 layers of which the first 3 dense; 256 routed experts top-8
in 8 groups (4 kept), sigmoid scores with the aux-loss-free expert bias, routed scaling 2.5, 1 shared expert.
Multi-token prediction is off here: DeepSeek-V3 trained with --mtp_num_layers=1."""
from mjax.config import Config


def config() -> Config:
    return Config().replace(
        model=dict(name="deepseek-v3", num_layers=61, hidden_size=7168, num_attention_heads=128,
                   ffn_hidden_size=18432, vocab_size=129280, max_position_embeddings=163840, norm_epsilon=1e-6,
                   rotary_base=10000.0, untie_embeddings_and_output_weights=True,
                   multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
                   qk_pos_emb_head_dim=64, v_head_dim=128,
                   rope_scaling="yarn", rope_scaling_factor=40.0, rope_original_max_positions=4096,
                   rope_yarn_beta_fast=32.0, rope_yarn_beta_slow=1.0, rope_yarn_mscale=1.0,
                   rope_yarn_mscale_all_dim=1.0,
                   num_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048,
                   moe_shared_expert_intermediate_size=2048, moe_first_dense_layers=3,
                   moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                   moe_router_bias_update_rate=1e-3, moe_router_num_groups=8, moe_router_group_topk=4,
                   moe_router_topk_scaling_factor=2.5, moe_router_load_balancing_type="seq_aux_loss",
                   moe_aux_loss_coeff=1e-4),
        train=dict(train_iters=100000, seq_length=4096, global_batch_size=15360, micro_batch_size=1),
        optimizer=dict(lr=2.2e-4, min_lr=2.2e-5, lr_warmup_iters=2000, lr_decay_iters=100000),
        data=dict(tokenizer_type="huggingface"),
    )
