"""A tiny Llama-style model: the default run on the bundled sample corpus and the model of most tests."""
from mjax.config import Config


def config() -> Config:
    return Config().replace(
        model=dict(name="tiny", num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                   ffn_hidden_size=384, vocab_size=1024, make_vocab_size_divisible_by=128,
                   max_position_embeddings=1024, rotary_base=10000.0),
        train=dict(train_iters=300, global_batch_size=16, seq_length=128, eval_interval=100, eval_iters=4),
        optimizer=dict(lr=3e-3, min_lr=3e-4, lr_warmup_iters=20, weight_decay=0.1, clip_grad=1.0),
        precision=dict(compute_dtype="float32"),
        logging=dict(log_interval=20),
    )
