"""Rotary position embeddings (half-split layout, as Hugging Face Llama), with optional Llama-3 frequency scaling."""

import math

import jax
import jax.numpy as jnp

from mjax.kernels.qkv_rope_grad.reference import rotate


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
