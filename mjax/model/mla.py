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
(context parallelism's, or dot_product_attention) like any other: its Q/K head dim is dn + dr, V's dv. Decoding
caches the latent and the RoPE key only and absorbs kv_up into the query and the output (_decode).
"""

import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from mjax.kernels.attention import cached_attention, dot_product_attention
from mjax.kernels.qkv_rope_grad.reference import rotate
from mjax.model.attention import write_cache
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

    def _rope(self, positions):
        """cos, sin [B, T, dr / 2] of the decoupled RoPE dims, shared by the queries and the key."""
        return rope_cos_sin(positions, rope_frequencies(self.cfg, self.cfg.qk_pos_emb_head_dim))

    def _queries(self, x, cos, sin):
        """x [B, T, D] -> q [B, T, N, dn + dr]: RoPE on its last dr dims, YaRN's softmax factor folded in (the core
        attention scales by 1 / sqrt(dn + dr))."""
        cfg = self.cfg
        dn = cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)  # [B, T, N, dn + dr]
        else:
            q = self.q_up_proj(self.q_norm(self.q_down_proj(x)))  # [B, T, Rq] -> [B, T, N, dn + dr]
        q = checkpoint_name(constrain(q, HEADS), "mla_up")
        q_rope = rotate(q[..., dn:], cos, sin) * jnp.asarray(yarn_attention_factor(cfg), q.dtype)  # [B, T, N, dr]
        return jnp.concatenate([q[..., :dn], q_rope], axis=-1) * jnp.asarray(yarn_softmax_factor(cfg), q.dtype)

    def _latent(self, x, cos, sin):
        """x [B, T, D] -> (the normalised KV latent [B, T, c], the one RoPE key of all heads [B, T, dr])."""
        cfg = self.cfg
        c = cfg.kv_lora_rank
        latent = self.kv_down_proj(x)  # [B, T, c + dr]
        k_rope = rotate(latent[:, :, None, c:], cos, sin)[:, :, 0]  # [B, T, 1, dr] -> [B, T, dr]
        return self.kv_norm(latent[..., :c]), k_rope * jnp.asarray(yarn_attention_factor(cfg), latent.dtype)

    def project_qkv(self, x, positions):
        """x [B, T, D] -> q, k [B, T, N, dn + dr] (RoPE applied, q carrying YaRN's softmax factor), v [B, T, N, dv].
        The up projections' outputs are named "mla_up" for --remat_save_names."""
        b, t, _ = x.shape
        n, dn, dr = self.cfg.num_attention_heads, self.cfg.qk_head_dim, self.cfg.qk_pos_emb_head_dim
        rope = self._rope(positions)
        q = self._queries(x, *rope)
        latent, k_rope = self._latent(x, *rope)
        kv = checkpoint_name(constrain(self.kv_up_proj(latent), HEADS), "mla_up")  # [B, T, c] -> [B, T, N, dn + dv]
        k = jnp.concatenate([kv[..., :dn], jnp.broadcast_to(k_rope[:, :, None], (b, t, n, dr))],
                            axis=-1)  # [B, T, N, dn + dr]
        return constrain(q, HEADS), constrain(k, HEADS), constrain(kv[..., dn:], HEADS)

    def __call__(self, x, positions, segment_ids=None, cache=None):
        """x: [B, T, D]; positions, segment_ids: [B, T]. Returns (out [B, T, D], the updated cache or None).

        cache (decoding): {"latent" [B, S, c], "k_rope" [B, S, dr]}, position s at index s: the compressed latent,
        not per-head keys and values (mla_cache_shapes)."""
        if cache is not None:
            return self._decode(x, positions, cache)
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

    def _decode(self, x, positions, cache):
        """Attention over the cached latents with the up projection absorbed (DeepSeek-V2 section 2.1.2): with
        W_uk, W_uv the key and value halves of kv_up, q_h . k_h = (q_h W_uk^T) . c + q_rope_h . k_rope and
        sum_s p_s v_s = (sum_s p_s c_s) W_uv, so every head attends to one shared [c + dr] key and [c] value."""
        cfg = self.cfg
        dn, dr = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim
        rope = self._rope(positions)
        latent, k_rope = self._latent(x, *rope)
        cache = {"latent": write_cache(cache["latent"], latent, positions[:, 0]),
                 "k_rope": write_cache(cache["k_rope"], k_rope, positions[:, 0])}
        q = self._queries(x, *rope)  # [B, T, N, dn + dr]
        w = self.kv_up_proj.kernel[...].astype(q.dtype)  # [c, N, dn + dv]
        q_latent = jnp.einsum("btnd,cnd->btnc", q[..., :dn], w[..., :dn])  # [B, T, N, c]
        keys = jnp.concatenate([cache["latent"], cache["k_rope"]], axis=-1)[:, :, None]  # [B, S, 1, c + dr]
        out = cached_attention(jnp.concatenate([q_latent, q[..., dn:]], axis=-1), keys, cache["latent"][:, :, None],
                               positions, cfg.window_size, scale=(dn + dr) ** -0.5)  # [B, T, N, c]
        return self.o_proj(jnp.einsum("btnc,cnv->btnv", out, w[..., dn:])), cache  # [B, T, N, dv] -> [B, T, D]


def mla_cache_shapes(cfg, batch: int, max_len: int) -> dict:
    """The decoding cache of one MLA layer: the latent and the RoPE key per position (c + dr numbers, where
    per-head keys and values would take N (dn + dr + dv))."""
    return {"latent": (batch, max_len, cfg.kv_lora_rank), "k_rope": (batch, max_len, cfg.qk_pos_emb_head_dim)}
