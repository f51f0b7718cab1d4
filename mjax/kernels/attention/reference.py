"""Plain softmax attention in fp32 (the oracle of every kernel), its mask, and decoding attention over a KV cache."""

import jax
import jax.numpy as jnp


def make_mask(t: int, s: int, *, causal: bool, sliding_window: int | None, segment_ids=None, kv_segment_ids=None):
    """Boolean [B or 1, 1, T, S] mask; True means attend. Query i sits at position i + (s - t) of the keys."""
    q_pos = jnp.arange(t)[:, None] + (s - t)
    k_pos = jnp.arange(s)[None, :]
    mask = jnp.ones((t, s), bool)
    if causal:
        mask &= k_pos <= q_pos
    if sliding_window is not None:
        mask &= q_pos - k_pos < sliding_window
    mask = mask[None, None]
    if segment_ids is not None:
        kv = segment_ids if kv_segment_ids is None else kv_segment_ids
        mask = mask & (segment_ids[:, None, :, None] == kv[:, None, None, :])
    return mask


def reference_attention(q, k, v, *, causal=True, sliding_window=None, segment_ids=None, scale=None,
                        return_lse=False):
    """Plain softmax attention in fp32; the oracle for every kernel. Returns out [B,T,N,H] (and lse [B,N,T]).

    segment_ids: [B, T] (needs T == S), or a pair (q_segment_ids [B, T], kv_segment_ids [B, S]).
    """
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    groups = n // kh
    scale = h**-0.5 if scale is None else scale
    qg = q.reshape(b, t, kh, groups, h)  # [B, T, K, G, H]
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    q_seg, kv_seg = segment_ids if isinstance(segment_ids, (tuple, list)) else (segment_ids, None)
    mask = make_mask(t, s, causal=causal, sliding_window=sliding_window, segment_ids=q_seg, kv_segment_ids=kv_seg)
    logits = jnp.where(mask[:, :, None], logits, -jnp.inf)  # [B, K, G, T, S]
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # fully masked rows give zeros, not NaN
    p = jnp.exp(logits - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bkgts,bskh->btkgh", p / jnp.where(denom == 0, 1.0, denom), v.astype(jnp.float32))
    out = out.reshape(b, t, n, h).astype(q.dtype)
    if return_lse:
        lse = (jnp.log(denom) + m)[..., 0].reshape(b, n, t)  # [B, N, T]
        return out, lse
    return out


def cached_attention(q, k_cache, v_cache, positions, sliding_window=None):
    """Decoding attention: q [B, T, N, H] at `positions` [B, T] over caches [B, S, K, H] that hold position s at
    index s (later slots not yet written) -> [B, T, N, H]. Causal, with an optional left sliding window."""
    b, t, n, h = q.shape
    kh = k_cache.shape[2]
    qg = q.reshape(b, t, kh, n // kh, h)  # [B, T, K, G, H]
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, k_cache, preferred_element_type=jnp.float32) * h**-0.5
    kv_pos = jnp.arange(k_cache.shape[1])
    mask = kv_pos[None, None, :] <= positions[:, :, None]  # [B, T, S]
    if sliding_window is not None:
        mask &= positions[:, :, None] - kv_pos[None, None, :] < sliding_window
    logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v_cache.astype(jnp.float32))
    return out.reshape(b, t, n, h).astype(q.dtype)
