"""Llama 3 70B: 80 layers, hidden 8192, GQA 64/8, FFN 28672."""
from mjax.config import load_config


def config():
    return load_config("llama3-8b").replace(
        model=dict(name="llama3-70b", num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
                   ffn_hidden_size=28672),
        optimizer=dict(lr=1.5e-4, min_lr=1.5e-5),
    )
