"""Token cross-entropy: the pure-JAX reference (fp32, padded vocab entries masked out, optional z-loss)."""

import jax
import jax.numpy as jnp


def cross_entropy_reference(logits, targets, *, vocab_size: int, z_loss_coeff: float = 0.0):
    """logits [B, T, Vp] (fp32), targets [B, T] -> (per-token loss [B, T], per-token log Z [B, T]).

    Columns >= vocab_size are vocab padding: they take no probability mass. The loss includes
    z_loss_coeff * logZ^2 when the coefficient is non-zero.
    """
    return token_losses(mask_vocab_padding(logits.astype(jnp.float32), vocab_size), targets, z_loss_coeff)


def mask_vocab_padding(logits, vocab_size: int):
    """[..., Vp] -> the same with the padding columns (>= vocab_size) at -inf."""
    if logits.shape[-1] <= vocab_size:
        return logits
    return jnp.where(jnp.arange(logits.shape[-1]) >= vocab_size, -jnp.inf, logits)


def token_losses(logits, targets, z_loss_coeff: float = 0.0):
    """Masked fp32 logits [..., Vp], targets [...] -> (loss incl. z-loss, log Z), both [...]."""
    log_z = jax.nn.logsumexp(logits, axis=-1)
    # A masked sum rather than a gather: with the vocab split over tensor-parallel devices each device sums its own
    # slice and only [B, T] partial sums are all-reduced, never the logits.
    vocab_ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    target_logit = jnp.sum(jnp.where(vocab_ids == targets[..., None], logits, 0.0), axis=-1)
    loss = log_z - target_logit
    if z_loss_coeff:
        loss = loss + z_loss_coeff * jnp.square(log_z)
    return loss, log_z
