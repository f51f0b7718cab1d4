"""Rotary position embeddings (half-split layout, as Hugging Face Llama), with optional Llama-3 or YaRN frequency
scaling (YaRN's cos/sin and softmax-scale factors: `yarn_attention_factor`, `yarn_softmax_factor`)."""

import math

import jax.numpy as jnp

from mjax.kernels.qkv_rope_grad.reference import rotate


def rope_frequencies(cfg, dim: int | None = None) -> jnp.ndarray:
    """Inverse frequencies [dim // 2] (dim: the rotated dims, default the head dim), scaled per Llama 3.1 when
    cfg.rope_scaling == 'llama3', per YaRN when 'yarn'."""
    dim = dim or cfg.head_dim
    inv = 1.0 / (cfg.rotary_base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    if cfg.rope_scaling == "yarn":
        return _yarn_frequencies(cfg, dim, inv)
    if cfg.rope_scaling != "llama3":
        return inv
    low_wavelen = cfg.rope_original_max_positions / cfg.rope_low_freq_factor
    high_wavelen = cfg.rope_original_max_positions / cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (cfg.rope_original_max_positions / wavelen - cfg.rope_low_freq_factor) / (
        cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
    mid = (1 - smooth) * inv / cfg.rope_scaling_factor + smooth * inv
    return jnp.where(wavelen > low_wavelen, inv / cfg.rope_scaling_factor, jnp.where(wavelen < high_wavelen, inv, mid))


def _yarn_frequencies(cfg, dim: int, inv):
    """YaRN (Peng et al. 2023, as DeepSeek-V2/V3 and Hugging Face compute it): frequencies that turn fewer than
    beta_slow times over the original context are divided by the factor, those turning more than beta_fast times
    are kept, and a linear ramp over the dims in between blends the two."""
    base, orig = cfg.rotary_base, cfg.rope_original_max_positions

    def correction_dim(rotations):  # the dim whose frequency turns `rotations` times over the original context
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(cfg.rope_yarn_beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.rope_yarn_beta_slow)), dim - 1)
    high = high + 0.001 if low == high else high  # a one-dim ramp would divide by zero
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    return inv / cfg.rope_scaling_factor * ramp + inv * (1.0 - ramp)


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude correction 0.1 mscale ln(factor) + 1 (1 without extension)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(cfg) -> float:
    """The factor on cos and sin (so on the rotated query and key dims): mscale(mscale) / mscale(mscale_all_dim),
    or mscale(1) when either is 0, as Hugging Face's YaRN computes it; 1 without YaRN."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    f, m, m_all = cfg.rope_scaling_factor, cfg.rope_yarn_mscale, cfg.rope_yarn_mscale_all_dim
    return yarn_mscale(f, m) / yarn_mscale(f, m_all) if m and m_all else yarn_mscale(f, 1.0)


def yarn_softmax_factor(cfg) -> float:
    """The factor on the softmax scale 1/sqrt(head dim): mscale(mscale_all_dim)^2 (DeepSeek-V2/V3); 1 without YaRN
    or with mscale_all_dim 0."""
    if cfg.rope_scaling != "yarn" or not cfg.rope_yarn_mscale_all_dim:
        return 1.0
    return yarn_mscale(cfg.rope_scaling_factor, cfg.rope_yarn_mscale_all_dim) ** 2


def rope_cos_sin(positions, inv_freq):
    """positions [B, T] -> cos, sin of the rotation angles, [B, T, H/2] f32."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, positions, inv_freq):
    """x: [B, T, N, H]; positions: [B, T]. Rotates the two halves of the head dim (computed in fp32):
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    return rotate(x, *rope_cos_sin(positions, inv_freq))
