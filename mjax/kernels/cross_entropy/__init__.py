"""Cross-entropy of the output layer: one dispatch point (`loss_sums`, `--cross_entropy_impl=reference|fused`), the
pure-JAX reference on whole fp32 logits (reference.py: the oracle) and the fused, chunked output layer + loss that
never holds the whole logits (fused.py)."""

import jax.numpy as jnp

from mjax.kernels.cross_entropy.fused import fused_cross_entropy_sums
from mjax.kernels.cross_entropy.reference import cross_entropy_reference, mask_vocab_padding, token_losses
from mjax.kernels.options import CROSS_ENTROPY_IMPLS

__all__ = ["CROSS_ENTROPY_IMPLS", "cross_entropy_reference", "fused_cross_entropy_sums", "loss_sums",
           "mask_vocab_padding", "token_losses"]


def loss_sums(h, targets, mask, *, impl: str, vocab_size: int, z_loss_coeff: float, chunk: int, compute_dtype,
              logits_fn, output_layer):
    """(sum of the masked per-token losses incl. z-loss, sum of masked log Z^2) from the final hidden states
    h [B, T, D]; targets [B, T] int, mask [B, T] float. `reference`: logits_fn(h) -> fp32 logits [B, T, Vp], whole;
    `fused`: output_layer = (w, vocab axis, quantization policy or None, FP8 scales or None) of the output layer,
    chunked over the sequence (--cross_entropy_chunk positions at a time)."""
    if impl == "fused":
        from mjax.kernels.quant import per_tensor_spec  # noqa: PLC0415

        w, vocab_axis, quant, meta = output_layer
        return fused_cross_entropy_sums(h, w, targets, mask, vocab_axis=vocab_axis, vocab_size=vocab_size,
                                        z_loss_coeff=z_loss_coeff, chunk=chunk, compute_dtype=compute_dtype,
                                        fp8_spec=None if quant is None else per_tensor_spec(quant), fp8_meta=meta)
    if impl != "reference":
        raise ValueError(f"--cross_entropy_impl={impl!r} is not one of {', '.join(CROSS_ENTROPY_IMPLS)}")
    loss, log_z = cross_entropy_reference(logits_fn(h), targets, vocab_size=vocab_size, z_loss_coeff=z_loss_coeff)
    return jnp.sum(loss * mask), jnp.sum(jnp.square(log_z) * mask)
