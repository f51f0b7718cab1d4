"""Llama 3.2 1B: GQA 32/8, SwiGLU, RoPE base 500k with Llama-3 scaling (factor 32), tied embeddings."""
from mjax.config import Config


def config() -> Config:
    return Config().replace(
        model=dict(name="llama3.2-1b", num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=8,
                   kv_channels=64, ffn_hidden_size=8192, vocab_size=128256, max_position_embeddings=131072,
                   norm_epsilon=1e-5, rotary_base=500000.0, rope_scaling="llama3", rope_scaling_factor=32.0,
                   rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_positions=8192,
                   untie_embeddings_and_output_weights=False),
        # The fastest measured at 8 x 4096 tokens (docs/performance.md): unrolled layers (no scan-stacked residual
        # copies; gradient reductions overlap the next layer's backward) and the default selective remat set.
        execution=dict(scan_layers=False, remat_policy="selective"),
        train=dict(train_iters=100000, seq_length=4096, global_batch_size=8),
        optimizer=dict(lr=3e-4, min_lr=3e-5, lr_warmup_iters=2000, lr_decay_iters=100000),
        data=dict(tokenizer_type="huggingface"),
    )
