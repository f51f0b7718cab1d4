"""Output layer + cross-entropy fused and chunked: the [tokens, vocab] logits exist one sequence chunk at a time,
never whole, and the backward costs no recomputation.

Each chunk's forward pass also computes that chunk's gradients (softmax - one-hot is known as soon as the log-sum-
exp is), so the forward does the logits GEMM plus the two gradient GEMMs, exactly the FLOPs of an unfused forward +
backward, while the peak memory is one chunk of fp32 logits instead of all of them (at 32768 tokens x 128256 vocab,
16.8 GB). The result is the *sum* over unmasked tokens, as the train step needs it; its backward scales the saved
gradients by the incoming cotangent. The z-loss sum is returned for logging only: its cotangent is ignored.
"""

import functools

import jax
import jax.numpy as jnp

from mjax.kernels.cross_entropy import mask_vocab_padding, token_losses


def fused_cross_entropy_sums(h, w, targets, mask, *, vocab_axis: int, vocab_size: int, z_loss_coeff: float = 0.0,
                             chunk: int = 1024, compute_dtype=jnp.bfloat16):
    """h [B, T, D]; w [V, D] (vocab_axis 0, a tied embedding) or [D, V] (vocab_axis 1); targets [B, T] int;
    mask [B, T] float. Returns (sum of masked per-token losses incl. z-loss, sum of masked log Z^2)."""
    return _fused(h, w, targets, mask, vocab_axis, vocab_size, float(z_loss_coeff), int(chunk),
                  jnp.dtype(compute_dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _fused(h, w, targets, mask, vocab_axis, vocab_size, z_coeff, chunk, dtype):
    return _forward(h, w, targets, mask, vocab_axis, vocab_size, z_coeff, chunk, dtype)[0]


def _chunks(x, chunk):
    """[B, T, ...] -> [T / chunk, B, chunk, ...]: scanned over sequence chunks, so a batch split over devices stays
    split (scanning a sharded axis would gather it)."""
    b, t = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, t // chunk, chunk, *x.shape[2:]), 1, 0)


def _forward(h, w, targets, mask, vocab_axis, vocab_size, z_coeff, chunk, dtype):
    b, t, d = h.shape
    chunk = min(chunk, t)
    pad = -t % chunk
    if pad:  # padded positions carry mask 0
        h, targets, mask = (jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in (h, targets, mask))
    wc = w.astype(dtype)
    logits_eq, dh_eq, dw_eq = (("bcd,vd->bcv", "bcv,vd->bcd", "bcd,bcv->vd") if vocab_axis == 0
                               else ("bcd,dv->bcv", "bcv,dv->bcd", "bcd,bcv->dv"))

    def body(dw, xs):
        hb, tb, mb = xs  # [B, c, D], [B, c], [B, c]
        logits = jnp.einsum(logits_eq, hb.astype(dtype), wc, preferred_element_type=jnp.float32)  # [B, c, V]
        logits = mask_vocab_padding(logits, vocab_size)
        loss, lse = token_losses(logits, tb, z_coeff)  # [B, c]
        probs = jnp.exp(logits - lse[..., None])
        # d(loss)/d(logits) = softmax - one-hot (+ 2 z lse softmax), for unmasked tokens only
        vocab_ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2)
        dlogits = (probs * (1.0 + 2.0 * z_coeff * lse[..., None]) - (vocab_ids == tb[..., None])) * mb[..., None]
        dlogits = dlogits.astype(dtype)
        dh = jnp.einsum(dh_eq, dlogits, wc, preferred_element_type=jnp.float32).astype(h.dtype)  # [B, c, D]
        dw = dw + jnp.einsum(dw_eq, hb.astype(dtype), dlogits, preferred_element_type=jnp.float32)
        return dw, (jnp.sum(loss * mb), jnp.sum(jnp.square(lse) * mb), dh)

    # A zero that varies over the same manual mesh axes as h and w (inside a pipeline stage's shard_map the scan
    # carry must have the body's varying-axes type); `where` keeps it exactly 0 even if h or w hold NaN.
    zero = jnp.where(True, 0.0, h.ravel()[0].astype(jnp.float32) + w.ravel()[0].astype(jnp.float32))
    dw, (loss_sums, z_sums, dh) = jax.lax.scan(body, jnp.zeros(w.shape, jnp.float32) + zero,
                                               (_chunks(h, chunk), _chunks(targets, chunk), _chunks(mask, chunk)))
    dh = jnp.moveaxis(dh, 0, 1).reshape(b, t + pad, d)[:, :t]  # [B, T, D]
    return (jnp.sum(loss_sums), jnp.sum(z_sums)), (dh, dw.astype(w.dtype))


def _fused_fwd(h, w, targets, mask, vocab_axis, vocab_size, z_coeff, chunk, dtype):
    return _forward(h, w, targets, mask, vocab_axis, vocab_size, z_coeff, chunk, dtype)


def _fused_bwd(vocab_axis, vocab_size, z_coeff, chunk, dtype, residuals, cotangents):
    dh, dw = residuals
    g = cotangents[0]  # the z sum is a metric: its cotangent is dropped
    return (dh * g.astype(dh.dtype), dw * g.astype(dw.dtype), None, None)


_fused.defvjp(_fused_fwd, _fused_bwd)
