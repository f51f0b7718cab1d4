"""Plain softmax attention in fp32 (the oracle of every kernel), its mask, and decoding attention over a KV cache."""

import jax
import jax.numpy as jnp


def make_mask(t: int, s: int, *, causal: bool, sliding_window: int | None, segment_ids=None, kv_segment_ids=None,
              offset=None):
    """Boolean [B or 1, 1, T, S] mask; True means attend. Query i sits at key position i + offset (default s - t;
    an int, or a traced scalar or [B] array)."""
    offset = jnp.asarray(s - t if offset is None else offset, jnp.int32).reshape(-1, 1, 1)  # [B or 1, 1, 1]
    q_pos = jnp.arange(t)[None, :, None] + offset  # [B or 1, T, 1]
    k_pos = jnp.arange(s)[None, None, :]
    mask = jnp.ones((1, t, s), bool)
    if causal:
        mask = mask & (k_pos <= q_pos)
    if sliding_window is not None:
        mask = mask & (q_pos - k_pos < sliding_window)
    mask = mask[:, None]
    if segment_ids is not None:
        kv = segment_ids if kv_segment_ids is None else kv_segment_ids
        mask = mask & (segment_ids[:, None, :, None] == kv[:, None, None, :])
    return mask


def _masked_logits(q, k, *, causal, sliding_window, segment_ids, scale, offset):
    """fp32 logits [B, K, G, T, S] with -inf where masked, and the scale used."""
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    scale = h**-0.5 if scale is None else scale
    qg = q.reshape(b, t, kh, n // kh, h)  # [B, T, K, G, H]
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    q_seg, kv_seg = segment_ids if isinstance(segment_ids, (tuple, list)) else (segment_ids, None)
    mask = make_mask(t, s, causal=causal, sliding_window=sliding_window, segment_ids=q_seg, kv_segment_ids=kv_seg,
                     offset=offset)
    return jnp.where(mask[:, :, None], logits, -jnp.inf), scale  # [B, K, G, T, S]


def reference_attention(q, k, v, *, causal=True, sliding_window=None, segment_ids=None, scale=None,
                        return_lse=False, offset=None):
    """Plain softmax attention in fp32; the oracle for every kernel. Returns out [B,T,N,H] (and lse [B,N,T]).

    segment_ids: [B, T] (needs T == S), or a pair (q_segment_ids [B, T], kv_segment_ids [B, S]). offset: query i
    sits at key position i + offset (default S - T; an int, or a traced scalar or [B] array).
    """
    b, t, n, h = q.shape
    logits, _ = _masked_logits(q, k, causal=causal, sliding_window=sliding_window, segment_ids=segment_ids,
                               scale=scale, offset=offset)
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


def reference_attention_backward(q, k, v, out, lse, do, *, causal=True, sliding_window=None, segment_ids=None,
                                 scale=None, offset=None):
    """(dq, dk, dv) of a block of attention given the merged output `out` [B,T,N,H] and log-sum-exp `lse` [B,N,T]
    of the attention it is part of, and do = d loss / d out: ring attention's blockwise backward, in fp32.
    P = exp(z - lse), dS = P (dO V^T - rowsum(dO O)), dq = scale dS K, dk = scale dS^T Q, dv = P^T dO."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    logits, scale = _masked_logits(q, k, causal=causal, sliding_window=sliding_window, segment_ids=segment_ids,
                                   scale=scale, offset=offset)
    lse = lse.astype(jnp.float32).reshape(b, kh, n // kh, t)[..., None]  # [B, K, G, T, 1]
    p = jnp.where(jnp.isfinite(lse), jnp.exp(logits - jnp.where(jnp.isfinite(lse), lse, 0.0)), 0.0)
    f32 = lambda x, heads: x.astype(jnp.float32).reshape(b, x.shape[1], kh, heads // kh, h)  # noqa: E731
    dog, og = f32(do, n), f32(out, n)  # [B, T, K, G, H]
    dp = jnp.einsum("btkgh,bskh->bkgts", dog, v.astype(jnp.float32))
    delta = jnp.einsum("btkgh,btkgh->bkgt", dog, og)[..., None]
    ds = p * (dp - delta)  # [B, K, G, T, S]
    dq = jnp.einsum("bkgts,bskh->btkgh", ds, k.astype(jnp.float32)) * scale
    dk = jnp.einsum("bkgts,btkgh->bskh", ds, f32(q, n)) * scale
    dv = jnp.einsum("bkgts,btkgh->bskh", p, dog)
    return dq.reshape(b, t, n, h).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def cached_attention(q, k_cache, v_cache, positions, sliding_window=None, scale=None):
    """Decoding attention: q [B, T, N, H] at `positions` [B, T] over caches k [B, S, K, H] and v [B, S, K, Hv] that
    hold position s at index s (later slots not yet written) -> [B, T, N, Hv]. Causal, with an optional left
    sliding window; logits scaled by `scale` (default H^-0.5)."""
    b, t, n, h = q.shape
    kh, hv = k_cache.shape[2], v_cache.shape[3]
    qg = q.reshape(b, t, kh, n // kh, h)  # [B, T, K, G, H]
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, k_cache, preferred_element_type=jnp.float32)
    logits = logits * (h**-0.5 if scale is None else scale)
    kv_pos = jnp.arange(k_cache.shape[1])
    mask = kv_pos[None, None, :] <= positions[:, :, None]  # [B, T, S]
    if sliding_window is not None:
        mask &= positions[:, :, None] - kv_pos[None, None, :] < sliding_window
    logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v_cache.astype(jnp.float32))  # [B, T, K, G, Hv]
    return out.reshape(b, t, n, hv).astype(q.dtype)
