"""Multi-head latent attention (MLA, DeepSeek-V2/V3; Megatron's MLASelfAttention), chosen by
--multi_latent_attention in place of mjax.model.attention.Attention.

Per token x [D], with n heads, c = --kv_lora_rank, dn = --qk_head_dim (no RoPE), dr = --qk_pos_emb_head_dim,
dv = --v_head_dim:
    q        = q_up(rmsnorm(q_down(x)))  [n, dn + dr]    (or q_proj(x) without --q_lora_rank)
    c_kv, kr = kv_down(x)                [c], [dr]        the compressed latent and one RoPE key for all heads
    k_nope, v = kv_up(rmsnorm(c_kv))     [n, dn], [n, dv]
    q = [q_nope, rope(q_rope)], k = [k_nope, rope(kr) on every head]; out = o_proj(softmax(q k^T s) v)
with s = mscale(mscale_all_dim)^2 / sqrt(dn + dr) under YaRN (1 / sqrt(dn + dr) otherwise) and the rotated dims
scaled by YaRN's attention factor (mjax.model.rope). RoPE is mjax's half-split layout: conversion permutes the rows
of checkpoints that rotate interleaved pairs (mjax/convert/deepseek.py), which leaves q k^T unchanged.

Keys and values are expanded per head before attention, so attention goes through the injected core attention
(context parallelism's, or dot_product_attention) like any other: its Q/K head dim is dn + dr, V's dv.
"""

import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from mjax.kernels.attention import dot_product_attention
from mjax.kernels.qkv_rope_grad.reference import rotate
from mjax.model.layers import Linear, RMSNorm, output_std
from mjax.model.rope import rope_cos_sin, rope_frequencies, yarn_attention_factor, yarn_softmax_factor
from mjax.sharding import constrain

# DeepSeek's code normalises the latents with its RMSNorm's default epsilon, whatever rms_norm_eps says.
LATENT_NORM_EPS = 1e-6
HEADS = ("batch", "seq", "heads", "head_dim")


class MLAttention(nnx.Module):
    def __init__(self, cfg, *, dtype, param_dtype, quant=None, execution=None, core_attention=None,
                 rngs: nnx.Rngs):
        """As mjax.model.attention.Attention: `core_attention(q, k, v, *, causal, sliding_window, segment_ids, impl)`
        attends over the heads (default dot_product_attention)."""
        self.cfg, self.core_attention = cfg, core_attention or dot_product_attention
        self.attention_impl = execution.attention_impl if execution is not None else "auto"
        d, n, c = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
        dn, dr, dv = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        common = dict(std=cfg.init_method_std, dtype=dtype, param_dtype=param_dtype, quant=quant, rngs=rngs)
        norm = lambda f: RMSNorm(f, eps=LATENT_NORM_EPS, dtype=dtype, param_dtype=param_dtype)  # noqa: E731
        # The low-rank dims are small and read by every head: replicated (logical axis None).
        if cfg.q_lora_rank is None:
            self.q_proj = Linear((d,), (n, dn + dr), in_axes=("embed",), out_axes=("heads", "head_dim"), **common)
        else:
            self.q_down_proj = Linear((d,), (cfg.q_lora_rank,), in_axes=("embed",), out_axes=(None,), **common)
            self.q_norm = norm(cfg.q_lora_rank)
            self.q_up_proj = Linear((cfg.q_lora_rank,), (n, dn + dr), in_axes=(None,),
                                    out_axes=("heads", "head_dim"), **common)
        self.kv_down_proj = Linear((d,), (c + dr,), in_axes=("embed",), out_axes=(None,), **common)
        self.kv_norm = norm(c)
        self.kv_up_proj = Linear((c,), (n, dn + dv), in_axes=(None,), out_axes=("heads", "head_dim"), **common)
        self.o_proj = Linear((n, dv), (d,), in_axes=("heads", "head_dim"), out_axes=("embed",),
                             **dict(common, std=output_std(cfg)))

    def project_qkv(self, x, positions):
        """x [B, T, D] -> q, k [B, T, N, dn + dr] (RoPE applied, q carrying YaRN's softmax factor), v [B, T, N, dv].
        The up projections' outputs are named "mla_up" for --remat_save_names."""
        cfg = self.cfg
        b, t, _ = x.shape
        n, c, dn, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)  # [B, T, N, dn + dr]
        else:
            q = self.q_up_proj(self.q_norm(self.q_down_proj(x)))  # [B, T, Rq] -> [B, T, N, dn + dr]
        q = checkpoint_name(constrain(q, HEADS), "mla_up")
        latent = self.kv_down_proj(x)  # [B, T, c + dr]
        kv = checkpoint_name(constrain(self.kv_up_proj(self.kv_norm(latent[..., :c])), HEADS),
                             "mla_up")  # [B, T, c] -> [B, T, N, dn + dv]
        cos, sin = rope_cos_sin(positions, rope_frequencies(cfg, dr))  # [B, T, dr / 2]
        factor = yarn_attention_factor(cfg)
        q_rope = rotate(q[..., dn:], cos, sin) * jnp.asarray(factor, q.dtype)  # [B, T, N, dr]
        k_rope = rotate(latent[:, :, None, c:], cos, sin) * jnp.asarray(factor, latent.dtype)  # [B, T, 1, dr]
        # The core attention scales by 1 / sqrt(dn + dr); YaRN's extra softmax factor rides on q.
        q = jnp.concatenate([q[..., :dn], q_rope], axis=-1) * jnp.asarray(yarn_softmax_factor(cfg), q.dtype)
        k = jnp.concatenate([kv[..., :dn], jnp.broadcast_to(k_rope, (b, t, n, dr))], axis=-1)  # [B, T, N, dn + dr]
        return constrain(q, HEADS), constrain(k, HEADS), constrain(kv[..., dn:], HEADS)

    def __call__(self, x, positions, segment_ids=None, cache=None):
        """x: [B, T, D]; positions, segment_ids: [B, T]. Returns (out [B, T, D], None)."""
        if cache is not None:
            raise ValueError("decoding with a KV cache (mjax.inference) does not support --multi_latent_attention "
                             "yet; run the model on whole sequences")
        q, k, v = self.project_qkv(x, positions)
        dv, dqk = v.shape[-1], q.shape[-1]
        # The attention kernels take one head dim for Q, K and V: V is zero-padded to Q/K's (192 for 128 in
        # DeepSeek-V3) and the output's padded dims, which are zero, are sliced off. Validation keeps dv <= dqk.
        if dv < dqk:
            v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, dqk - dv)))  # [B, T, N, dv] -> [B, T, N, dqk]
        out = self.core_attention(q, k, v, causal=True, sliding_window=self.cfg.window_size,
                                  segment_ids=segment_ids, impl=self.attention_impl)  # [B, T, N, dqk]
        out = checkpoint_name(constrain(out[..., :dv], HEADS), "attn_context")  # [B, T, N, dv]
        return checkpoint_name(self.o_proj(out), "attn_out"), None

