"""GPT-2 small (124M): LayerNorm, learned positions, GELU, biases, tied embeddings."""
from mjax.config import Config


def config() -> Config:
    return Config().replace(
        model=dict(name="gpt2", num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072,
                   vocab_size=50257, max_position_embeddings=1024, normalization="layernorm", norm_epsilon=1e-5,
                   activation="gelu", position_embedding_type="learned", add_bias_linear=True,
                   untie_embeddings_and_output_weights=False),
        train=dict(train_iters=100000, seq_length=1024, global_batch_size=16),
        optimizer=dict(lr=6e-4, min_lr=6e-5, lr_warmup_iters=2000, lr_decay_iters=100000),
        data=dict(tokenizer_type="huggingface", tokenizer_model="gpt2"),
    )
