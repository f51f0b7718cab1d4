"""Attention: the pure-JAX reference and the dispatch point every attention layer calls.

Layout is [batch, seq, heads, head_dim] (BTNH). K/V may have fewer heads than Q (GQA/MQA); they are never
materialised repeated. Masks: causal, a left sliding window, and segment ids for packed documents.
"""

import functools
import logging

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)

IMPLS = ("auto", "xla", "cudnn", "pallas")


class AttentionUnsupported(ValueError):
    """The requested attention implementation cannot do this call; the message names the option to change."""


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
    """Plain softmax attention in fp32; the oracle for every kernel. Returns out [B,T,N,H] (and lse [B,N,T])."""
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    groups = n // kh
    scale = h**-0.5 if scale is None else scale
    qg = q.reshape(b, t, kh, groups, h)  # [B, T, K, G, H]
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    mask = make_mask(t, s, causal=causal, sliding_window=sliding_window, segment_ids=segment_ids)
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


def _cudnn_attention(q, k, v, *, causal, sliding_window, segment_ids, scale, return_lse):
    if segment_ids is not None:
        raise AttentionUnsupported(
            "attention_impl=cudnn cannot mask packed documents (segment ids); use --attention_impl=pallas "
            "or turn off --reset_attention_mask")
    if return_lse:
        raise AttentionUnsupported("attention_impl=cudnn does not return the log-sum-exp; use pallas")
    window = None if sliding_window is None else (sliding_window - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, local_window_size=window,
                                        implementation="cudnn")


def _pallas_attention(q, k, v, **kwargs):
    from mjax.kernels import flash_attention  # noqa: PLC0415  (import only when chosen)

    return flash_attention.flash_attention(q, k, v, **kwargs)


_IMPL_FNS = {"xla": reference_attention, "cudnn": _cudnn_attention, "pallas": _pallas_attention}


def choose_impl(impl: str, *, backend: str, dtype, head_dim: int, segment_ids: bool, return_lse: bool) -> str:
    """The capability table behind `auto`; an explicit choice is checked, never replaced."""
    if impl not in IMPLS:
        raise AttentionUnsupported(f"--attention_impl={impl!r} is not one of {', '.join(IMPLS)}")
    if impl != "auto":
        return impl
    if backend != "gpu":
        return "xla"
    cudnn_ok = (jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim <= 256 and head_dim % 8 == 0
                and not segment_ids and not return_lse)
    return "cudnn" if cudnn_ok else "pallas"


def dot_product_attention(q, k, v, *, causal=True, sliding_window=None, segment_ids=None, scale=None,
                          impl="auto", return_lse=False):
    """Dispatches to the implementation `impl` names (or `auto` picks); raises AttentionUnsupported otherwise."""
    if q.shape[2] % k.shape[2]:
        raise AttentionUnsupported(f"query heads {q.shape[2]} are not a multiple of KV heads {k.shape[2]}")
    chosen = choose_impl(impl, backend=jax.default_backend(), dtype=q.dtype, head_dim=q.shape[-1],
                         segment_ids=segment_ids is not None, return_lse=return_lse)
    _log_choice(impl, chosen, q.shape, str(q.dtype))
    return _IMPL_FNS[chosen](q, k, v, causal=causal, sliding_window=sliding_window, segment_ids=segment_ids,
                             scale=scale, return_lse=return_lse)


@functools.cache
def _log_choice(requested, chosen, shape, dtype):
    log.info("attention: %s (requested %s) for q%s %s", chosen, requested, shape, dtype)
