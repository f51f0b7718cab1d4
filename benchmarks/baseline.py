"""A plain-JAX Llama train step on the same shapes as a preset: the floor mjax's step is measured against.

Deliberately untuned: jax.numpy einsums, `jax.nn.dot_product_attention` (cuDNN on GPU when it applies, XLA
otherwise), fp32 params cast to bf16 per use, plain fp32 softmax cross-entropy over the whole logits, layers scanned
under JAX's stock `dots_with_no_batch_dims_saveable` remat policy (without any remat a 1B model at 8 x 4096 tokens
does not fit an H200), optax AdamW. No mjax model, kernel, sharding or remat code is used.
"""

import jax
import jax.numpy as jnp
import optax


def init(cfg, key):
    """Params of a Llama-style decoder with cfg's sizes (untied output layer, as the cost is the same)."""
    if cfg.activation != "swiglu" or cfg.normalization != "rmsnorm" or cfg.position_embedding_type != "rope":
        raise ValueError(f"the plain-JAX baseline is a Llama-family step; preset {cfg.name!r} is not one")
    d, f, v, n = cfg.hidden_size, cfg.ffn_hidden_size, cfg.padded_vocab_size(), cfg.num_layers
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"wq": (n, d, q), "wk": (n, d, kv), "wv": (n, d, kv), "wo": (n, q, d), "w1": (n, d, f), "w3": (n, d, f),
              "w2": (n, f, d), "embed": (v, d), "head": (d, v)}
    keys = jax.random.split(key, len(shapes))
    params = {k: 0.02 * jax.random.normal(kk, s, jnp.float32) for kk, (k, s) in zip(keys, shapes.items())}
    params["norm1"], params["norm2"] = jnp.ones((n, d)), jnp.ones((n, d))
    params["final_norm"] = jnp.ones((d,))
    return params


def _rms(x, w):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-5) * w).astype(jnp.bfloat16)


def _rope(x, pos, theta):
    half = x.shape[-1] // 2
    freq = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) / half)
    ang = pos[:, None] * freq  # [T, H/2]
    cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def loss_fn(params, tokens, targets, cfg):
    bf = lambda w: w.astype(jnp.bfloat16)  # noqa: E731
    b, t = tokens.shape
    h, kvh, hd = cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
    pos = jnp.arange(t, dtype=jnp.float32)
    x = bf(params["embed"])[tokens]  # [B, T, D]

    def layer(x, p):
        y = _rms(x, p["norm1"])
        q = _rope((y @ bf(p["wq"])).reshape(b, t, h, hd), pos, cfg.rotary_base)
        k = _rope((y @ bf(p["wk"])).reshape(b, t, kvh, hd), pos, cfg.rotary_base)
        v = (y @ bf(p["wv"])).reshape(b, t, kvh, hd)
        impl = "cudnn" if jax.default_backend() == "gpu" else None
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl).reshape(b, t, h * hd)
        x = x + a @ bf(p["wo"])
        y = _rms(x, p["norm2"])
        return x + (jax.nn.silu(y @ bf(p["w1"])) * (y @ bf(p["w3"]))) @ bf(p["w2"]), None

    stacked = {k: params[k] for k in ("wq", "wk", "wv", "wo", "w1", "w3", "w2", "norm1", "norm2")}
    x, _ = jax.lax.scan(jax.checkpoint(layer, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
                        x, stacked)
    logits = (_rms(x, params["final_norm"]) @ bf(params["head"])).astype(jnp.float32)  # [B, T, V]
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))


def make_step(cfg, lr=3e-4):
    tx = optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=0.1)

    def step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets, cfg)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return tx, step
