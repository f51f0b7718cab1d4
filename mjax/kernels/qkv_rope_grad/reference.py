"""The reference of the QKV gradient kernel: the fused QKV output split and rotated (RoPE), differentiated by autodiff
(whose concatenate the kernel replaces), and the rotation itself, which the model's RoPE uses too."""

import jax.numpy as jnp


def rotate(x, cos, sin):
    """x [B, T, N, H] rotated by cos, sin [B, T, H/2]: x cos + swap(x) (-sin, sin) with the halves on an axis of
    two, so forward and backward are elementwise passes (splitting and concatenating the halves is a concatenate,
    which XLA emits one operand at a time, reading x twice)."""
    cos = cos[:, :, None, None, :]  # [B, T, 1, 1, H/2]
    sin = sin[:, :, None, None, :] * jnp.array([-1.0, 1.0])[:, None]  # [B, T, 1, 2, H/2]
    halves = x.astype(jnp.float32).reshape(*x.shape[:-1], 2, x.shape[-1] // 2)  # [B, T, N, 2, H/2]
    out = halves * cos + jnp.flip(halves, axis=-2) * sin
    return out.reshape(x.shape).astype(x.dtype)


def split_rotate(y, cos, sin):
    """`split_qkv`'s forward, differentiated by autodiff (the reference its backward is tested against)."""
    b, t, k, slots, h = y.shape
    q = y[:, :, :, :slots - 2].reshape(b, t, k * (slots - 2), h)  # [B, T, K, G, H] -> [B, T, N, H]
    return rotate(q, cos, sin), rotate(y[:, :, :, slots - 2], cos, sin), y[:, :, :, slots - 1]
