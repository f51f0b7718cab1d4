"""Forward pass with a KV cache, for generation. It runs the model's own layers (norms, projections, RoPE, MLP,
embedding and output layer of `CausalLM`) on the same params; only attention differs: new keys/values are written
into a per-layer cache and each query attends to the cached positions before it (and inside the sliding window).

The cache holds keys and values for `max_len` positions: {"k", "v"}: [layers, batch, max_len, kv_heads, head_dim].
Each call processes tokens at consecutive positions (a prompt, then one token per step); `tests/test_convert_decode.py`
checks that the logits equal those of the full forward pass.
"""

import jax
import jax.numpy as jnp
from flax import nnx


def init_cache(cfg, batch: int, max_len: int, dtype=jnp.float32) -> dict:
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def cached_attention(q, k_cache, v_cache, positions, sliding_window=None):
    """q [B, T, N, H] at `positions` [B, T]; caches [B, S, K, H] hold position s at index s. Returns [B, T, N, H]."""
    b, t, n, h = q.shape
    kh = k_cache.shape[2]
    qg = q.reshape(b, t, kh, n // kh, h)  # [B, T, K, G, H]
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, k_cache, preferred_element_type=jnp.float32) * h**-0.5
    kv_pos = jnp.arange(k_cache.shape[1])
    mask = kv_pos[None, None, :] <= positions[:, :, None]  # [B, T, S]; later slots are not written yet
    if sliding_window is not None:
        mask &= positions[:, :, None] - kv_pos[None, None, :] < sliding_window
    logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v_cache.astype(jnp.float32))
    return out.reshape(b, t, n, h).astype(q.dtype)


def _write(cache, new, start):  # cache [B, S, K, H], new [B, T, K, H], start [B]
    return jax.vmap(lambda c, x, s: jax.lax.dynamic_update_slice(c, x.astype(c.dtype), (s, 0, 0)))(cache, new, start)


def _attention(attn, x, positions, k_cache, v_cache):
    cfg = attn.cfg
    q, k, v = attn.project_qkv(x, positions)  # [B, T, N, H], [B, T, K, H]
    k_cache, v_cache = _write(k_cache, k, positions[:, 0]), _write(v_cache, v, positions[:, 0])
    out = cached_attention(q, k_cache, v_cache, positions, cfg.sliding_window)  # [B, T, N, H]
    return attn.o_proj(out), k_cache, v_cache  # [B, T, D]


def forward_with_cache(model_def, params, tokens, positions, cache):
    """tokens, positions [B, T] -> (fp32 logits [B, T, padded vocab], updated cache)."""
    model = model_def.bind(params)
    cfg = model.cfg
    x = model.embed(tokens)  # [B, T, D]
    if cfg.position_embedding_type == "learned":
        x = x + jnp.take(model.pos_embed[...], positions, axis=0).astype(model.dtype)
    graphdef, state = nnx.split(model.layers)

    def layer(x, xs):
        layer_state, k_cache, v_cache = xs
        block = nnx.merge(graphdef, layer_state)
        out, k_cache, v_cache = _attention(block.attn, block.attn_norm(x), positions, k_cache, v_cache)
        x = x + out
        x = x + block.mlp(block.mlp_norm(x))
        return x, (k_cache, v_cache)

    x, (k, v) = jax.lax.scan(layer, x, (state, cache["k"], cache["v"]))
    return model.logits(model.final_norm(x)), {"k": k, "v": v}
