"""Qwen3-30B-A3B: 48 layers, 128 experts (FFN 768) top-8 renormalised, GQA 32/4, head dim 128, per-head QK RMSNorm."""
from mjax.config import Config


def config() -> Config:
    return Config().replace(
        model=dict(name="qwen3-30b-a3b", num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
                   kv_channels=128, ffn_hidden_size=6144, vocab_size=151936, max_position_embeddings=40960,
                   norm_epsilon=1e-6, rotary_base=1000000.0, qk_layernorm=True,
                   untie_embeddings_and_output_weights=True, num_experts=128, moe_router_topk=8,
                   moe_ffn_hidden_size=768, moe_aux_loss_coeff=0.001),
        train=dict(train_iters=100000, seq_length=4096, global_batch_size=512, micro_batch_size=1),
        optimizer=dict(lr=3e-4, min_lr=3e-5, lr_warmup_iters=2000, lr_decay_iters=100000),
        data=dict(tokenizer_type="huggingface"),
    )
