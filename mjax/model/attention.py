"""Multi-head attention with GQA/MQA, RoPE, optional QKV bias and sliding window; the kernel is chosen by dispatch."""

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from mjax.kernels.attention import cached_attention, dot_product_attention
from mjax.model.layers import Linear, fused_linear, fused_product, make_norm, output_std
from mjax.kernels.qkv_rope_grad import split_qkv, use_qkv_grad_kernel
from mjax.model.rope import apply_rope, rope_cos_sin, rope_frequencies
from mjax.sharding import constrain, splits_evenly


class Attention(nnx.Module):
    def __init__(self, cfg, *, dtype, param_dtype, quant=None, execution=None, core_attention=None,
                 rngs: nnx.Rngs):
        """execution: the kernel choices (--attention_impl, --qkv_grad_impl); default auto. core_attention:
        `f(q, k, v, *, causal, sliding_window, segment_ids, impl) -> out` as dot_product_attention (the default);
        training passes mjax.parallel.context_parallel's, which attends across the ranks holding the sequence."""
        self.cfg, self.core_attention = cfg, core_attention or dot_product_attention
        self.attention_impl, self.qkv_grad_impl = ((execution.attention_impl, execution.qkv_grad_impl)
                                                   if execution is not None else ("auto", "auto"))
        d, n, k, h = cfg.hidden_size, cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
        qkv_bias = cfg.add_bias_linear or cfg.add_qkv_bias
        common = dict(std=cfg.init_method_std, use_bias=qkv_bias, dtype=dtype, param_dtype=param_dtype, quant=quant,
                      rngs=rngs)
        self.q_proj = Linear((d,), (n, h), in_axes=("embed",), out_axes=("heads", "head_dim"), **common)
        self.k_proj = Linear((d,), (k, h), in_axes=("embed",), out_axes=("kv_heads", "head_dim"), **common)
        self.v_proj = Linear((d,), (k, h), in_axes=("embed",), out_axes=("kv_heads", "head_dim"), **common)
        self.o_proj = Linear((n, h), (d,), in_axes=("heads", "head_dim"), out_axes=("embed",), std=output_std(cfg),
                             use_bias=cfg.add_bias_linear, dtype=dtype, param_dtype=param_dtype, quant=quant,
                             rngs=rngs)
        if cfg.qk_layernorm:  # Megatron's q_layernorm / k_layernorm: per head, or (OLMoE) over all heads at once
            across = cfg.qk_layernorm_across_heads
            norm = lambda heads: make_norm(cfg, features=heads * h if across else h, dtype=dtype,  # noqa: E731
                                           param_dtype=param_dtype)
            self.q_norm, self.k_norm = norm(n), norm(k)

    def project_qkv(self, x, positions):
        """x [B, T, D] -> q [B, T, N, H], k and v [B, T, K, H], RoPE applied. One GEMM (Megatron's linear_qkv)
        whose output is grouped per KV head, [B, T, K, N/K + 2, H], so that tensor parallelism splits it by
        KV head like the separate projections; separate GEMMs when the KV heads are fewer than tp (replicated)."""
        cfg = self.cfg
        n, k, h = cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
        parts = (self.q_proj, self.k_proj, self.v_proj)
        fused = splits_evenly("kv_heads", k)
        shapes = ((k, n // k, h), (k, 1, h), (k, 1, h))
        rope = cfg.position_embedding_type == "rope"
        if fused and rope and not cfg.qk_layernorm and use_qkv_grad_kernel(self.qkv_grad_impl, h):
            y = fused_product(x, parts, shapes, axis=1)  # [B, T, K, G + 2, H]
            q, k_, v = split_qkv(y, *rope_cos_sin(positions, rope_frequencies(cfg)))
            return self._constrain(q, k_, v)
        q, k_, v = fused_linear(x, parts, shapes, axis=1) if fused else (p(x) for p in parts)
        q, k_, v = self._constrain(q, k_, v)
        if cfg.qk_layernorm:
            q, k_ = self._qk_norm(self.q_norm, q), self._qk_norm(self.k_norm, k_)
        if rope:
            inv_freq = rope_frequencies(cfg)
            q, k_ = apply_rope(q, positions, inv_freq), apply_rope(k_, positions, inv_freq)
        return q, k_, v

    def _qk_norm(self, norm, x):  # [B, T, heads, H]: per head, or over the heads' features together
        if not self.cfg.qk_layernorm_across_heads:
            return norm(x)
        return norm(x.reshape(*x.shape[:2], -1)).reshape(x.shape)  # [B, T, heads * H] -> [B, T, heads, H]

    @staticmethod
    def _constrain(q, k, v):
        return (constrain(q, ("batch", "seq", "heads", "head_dim")),  # [B, T, N, H]
                constrain(k, ("batch", "seq", "kv_heads", "head_dim")),  # [B, T, K, H]
                constrain(v, ("batch", "seq", "kv_heads", "head_dim")))

    def __call__(self, x, positions, segment_ids=None, cache=None):
        """x: [B, T, D]; positions, segment_ids: [B, T]. Returns (out [B, T, D], the updated KV cache or None).

        cache (decoding): {"k", "v"}: [B, S, K, H] holding position s at index s; the new keys and values are
        written at `positions` (consecutive per row) and the queries attend to every cached position up to theirs."""
        q, k, v = (checkpoint_name(t, "qkv_proj") for t in self.project_qkv(x, positions))
        if cache is not None:
            cache = {"k": write_cache(cache["k"], k, positions[:, 0]), "v": write_cache(cache["v"], v, positions[:, 0])}
            out = cached_attention(q, cache["k"], cache["v"], positions, self.cfg.window_size)  # [B, T, N, H]
            return self.o_proj(out), cache
        out = self.core_attention(q, k, v, causal=True, sliding_window=self.cfg.window_size,
                                  segment_ids=segment_ids, impl=self.attention_impl)  # [B, T, N, H]
        out = checkpoint_name(constrain(out, ("batch", "seq", "heads", "head_dim")), "attn_context")
        return checkpoint_name(self.o_proj(out), "attn_out"), None


def write_cache(cache, new, start):
    """cache [B, S, ...] with new [B, T, ...] written at rows start [B] .. start + T of each batch row."""
    rest = (0,) * (cache.ndim - 2)
    return jax.vmap(lambda c, x, s: jax.lax.dynamic_update_slice(c, x.astype(c.dtype), (s, *rest)))(cache, new, start)


def kv_cache_shapes(cfg, batch: int, max_len: int) -> dict:
    """The decoding cache of one attention layer: keys and values per position and KV head."""
    shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return {"k": shape, "v": shape}
