"""Llama 3.2 3B: 28 layers, GQA 24/8, head dim 128, Llama-3 RoPE scaling (factor 32), tied embeddings."""
from mjax.config import load_config


def config():
    return load_config("llama3.2-1b").replace(
        model=dict(name="llama3.2-3b", num_layers=28, hidden_size=3072, num_attention_heads=24, num_query_groups=8,
                   kv_channels=128, ffn_hidden_size=8192),
    )
