"""Mistral 7B (v0.1): GQA 32/8, sliding-window attention over 4096 tokens, vocab 32000."""
from mjax.config import Config


def config() -> Config:
    return Config().replace(
        model=dict(name="mistral-7b", num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                   ffn_hidden_size=14336, vocab_size=32000, max_position_embeddings=32768, norm_epsilon=1e-5,
                   rotary_base=10000.0, window_size=4096, untie_embeddings_and_output_weights=True),
        train=dict(train_iters=100000, seq_length=8192, global_batch_size=128, micro_batch_size=1),
        optimizer=dict(lr=3e-4, min_lr=3e-5, lr_warmup_iters=2000, lr_decay_iters=100000),
        data=dict(tokenizer_type="huggingface"),
    )
