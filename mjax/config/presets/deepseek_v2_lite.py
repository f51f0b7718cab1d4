"""DeepSeek-V2-Lite (16B total, 2.4B active): multi-head latent attention without query compression (16 heads, kv
rank 512, head dims 128 + 64 RoPE for Q/K, 128 for V, YaRN x40 over 4k with mscale 0.707), 27 layers of which the
first dense; 64 routed experts top-6 (softmax, not renormalised), 2 shared experts."""
from mjax.config import Config


def config() -> Config:
    return Config().replace(
        model=dict(name="deepseek-v2-lite", num_layers=27, hidden_size=2048, num_attention_heads=16,
                   ffn_hidden_size=10944, vocab_size=102400, max_position_embeddings=163840, norm_epsilon=1e-6,
                   rotary_base=10000.0, untie_embeddings_and_output_weights=True,
                   multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=512, qk_head_dim=128,
                   qk_pos_emb_head_dim=64, v_head_dim=128,
                   rope_scaling="yarn", rope_scaling_factor=40.0, rope_original_max_positions=4096,
                   rope_yarn_beta_fast=32.0, rope_yarn_beta_slow=1.0, rope_yarn_mscale=0.707,
                   rope_yarn_mscale_all_dim=0.707,
                   num_experts=64, moe_router_topk=6, moe_ffn_hidden_size=1408,
                   moe_shared_expert_intermediate_size=2816, moe_first_dense_layers=1, moe_router_pre_softmax=True,
                   moe_aux_loss_coeff=0.001),
        train=dict(train_iters=100000, seq_length=4096, global_batch_size=128, micro_batch_size=1),
        optimizer=dict(lr=4.2e-4, min_lr=4.2e-5, lr_warmup_iters=2000, lr_decay_iters=100000),
        data=dict(tokenizer_type="huggingface"),
    )
