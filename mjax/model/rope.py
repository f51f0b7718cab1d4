"""Rotary position embeddings (half-split layout, as Hugging Face Llama), with optional Llama-3 frequency scaling."""

import math

import jax
import jax.numpy as jnp

from mjax.kernels.options import qkv_kernel_tiles


def rope_frequencies(cfg) -> jnp.ndarray:
    """Inverse frequencies [head_dim // 2], scaled per Llama 3.1 when cfg.rope_scaling == 'llama3'."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rotary_base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    if cfg.rope_scaling != "llama3":
        return inv
    low_wavelen = cfg.rope_original_max_positions / cfg.rope_low_freq_factor
    high_wavelen = cfg.rope_original_max_positions / cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (cfg.rope_original_max_positions / wavelen - cfg.rope_low_freq_factor) / (
        cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
    mid = (1 - smooth) * inv / cfg.rope_scaling_factor + smooth * inv
    return jnp.where(wavelen > low_wavelen, inv / cfg.rope_scaling_factor, jnp.where(wavelen < high_wavelen, inv, mid))


def rope_cos_sin(positions, inv_freq):
    """positions [B, T] -> cos, sin of the rotation angles, [B, T, H/2] f32."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, positions, inv_freq):
    """x: [B, T, N, H]; positions: [B, T]. Rotates the two halves of the head dim (computed in fp32):
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    return rotate(x, *rope_cos_sin(positions, inv_freq))


def rotate(x, cos, sin):
    """x [B, T, N, H] rotated by cos, sin [B, T, H/2]: x cos + swap(x) (-sin, sin) with the halves on an axis of
    two, so forward and backward are elementwise passes (splitting and concatenating the halves is a concatenate,
    which XLA emits one operand at a time, reading x twice)."""
    cos = cos[:, :, None, None, :]  # [B, T, 1, 1, H/2]
    sin = sin[:, :, None, None, :] * jnp.array([-1.0, 1.0])[:, None]  # [B, T, 1, 2, H/2]
    halves = x.astype(jnp.float32).reshape(*x.shape[:-1], 2, x.shape[-1] // 2)  # [B, T, N, 2, H/2]
    out = halves * cos + jnp.flip(halves, axis=-2) * sin
    return out.reshape(x.shape).astype(x.dtype)


def use_qkv_grad_kernel(impl: str, head_dim: int) -> bool:
    """--model.qkv_grad_impl: auto takes the kernel on a GPU when it can tile the head dim (3B step on an H200:
    bf16 26,752 -> 26,864 tokens/s, FP8 36,886 -> 37,101, docs/performance.md)."""
    if impl == "auto":
        return jax.default_backend() == "gpu" and qkv_kernel_tiles(head_dim)
    return impl == "pallas"


@jax.custom_vjp
def split_qkv(y, cos, sin):
    """The fused QKV output y [B, T, K, G + 2, H] (per KV head: G query heads, K, V) -> q [B, T, K*G, H] and k
    [B, T, K, H] rotated by cos, sin [B, T, H/2], and v [B, T, K, H]; the backward assembles y's gradient in one
    Pallas pass (kernels/qkv_rope_grad.py) instead of autodiff's concatenate."""
    return split_rotate(y, cos, sin)


def split_rotate(y, cos, sin):
    """`split_qkv`'s forward, differentiated by autodiff (the reference its backward is tested against)."""
    b, t, k, slots, h = y.shape
    q = y[:, :, :, :slots - 2].reshape(b, t, k * (slots - 2), h)  # [B, T, K, G, H] -> [B, T, N, H]
    return rotate(q, cos, sin), rotate(y[:, :, :, slots - 2], cos, sin), y[:, :, :, slots - 1]


def _split_qkv_bwd(res, grads):
    from mjax.kernels.qkv_rope_grad import qkv_rope_grad  # noqa: PLC0415  (import only when chosen)

    cos, sin = res
    dy = qkv_rope_grad(*grads, cos, sin, interpret=jax.default_backend() != "gpu")  # [B, T, K, G + 2, H]
    return dy, jnp.zeros_like(cos), jnp.zeros_like(sin)


split_qkv.defvjp(lambda y, cos, sin: (split_rotate(y, cos, sin), (cos, sin)), _split_qkv_bwd)
