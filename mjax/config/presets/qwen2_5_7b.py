"""Qwen2.5 7B: GQA 28/4, biases on Q/K/V, RoPE base 1e6, RMSNorm eps 1e-6, vocab 152064 (already padded)."""
from mjax.config import Config


def config() -> Config:
    return Config().replace(
        model=dict(name="qwen2.5-7b", num_layers=28, hidden_size=3584, num_attention_heads=28, num_query_groups=4,
                   ffn_hidden_size=18944, vocab_size=152064, max_position_embeddings=32768, norm_epsilon=1e-6,
                   rotary_base=1000000.0, add_qkv_bias=True, untie_embeddings_and_output_weights=True),
        train=dict(train_iters=100000, seq_length=4096, global_batch_size=128, micro_batch_size=1),
        optimizer=dict(lr=3e-4, min_lr=3e-5, lr_warmup_iters=2000, lr_decay_iters=100000),
        data=dict(tokenizer_type="huggingface"),
    )
