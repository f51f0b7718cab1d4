"""Forward pass with a KV cache, for generation: the model's own forward (mjax.model.transformer.CausalLM.forward)
with each attention layer writing its new keys and values into a per-layer cache and attending to the cached
positions before it (and inside the sliding window).

The cache holds `max_len` positions per stack of layers, {"layers" / "moe_layers": {name: [layers of the stack,
batch, max_len, ...]}}: keys and values {"k", "v"} [.., kv_heads, head_dim], or with --multi_latent_attention the
compressed latent and RoPE key {"latent" [.., kv_lora_rank], "k_rope" [.., qk_pos_emb_head_dim]}. Each call
processes tokens at consecutive positions (a prompt, then one token per step); the tests check that the logits equal
those of the full forward pass.
"""

import jax.numpy as jnp

from mjax.model.attention import kv_cache_shapes
from mjax.model.mla import mla_cache_shapes


def init_cache(cfg, batch: int, max_len: int, dtype=jnp.float32) -> dict:
    pattern = cfg.moe_layer_pattern()
    shapes = (mla_cache_shapes if cfg.multi_latent_attention else kv_cache_shapes)(cfg, batch, max_len)
    stacks = {"layers": pattern.count(False), "moe_layers": pattern.count(True)}
    return {name: {key: jnp.zeros((n, *shape), dtype) for key, shape in shapes.items()}
            for name, n in stacks.items() if n}


def forward_with_cache(model_def, params, tokens, positions, cache):
    """tokens, positions [B, T] -> (fp32 logits [B, T, padded vocab], updated cache)."""
    model = model_def.bind(params)
    h, _, cache = model.forward(tokens, positions, cache=cache)
    return model.logits(h), cache
