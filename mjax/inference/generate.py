"""Greedy and sampled generation with a KV cache (one compiled prefill, then one compiled step per token)."""

import functools

import jax
import jax.numpy as jnp

from mjax.inference.decode import forward_with_cache, init_cache
from mjax.sharding import single_device


class PromptError(ValueError):
    """A prompt or generation length the model cannot take; the message names what to change."""


def sample(logits, key, temperature: float, top_k: int):
    """logits [B, V] -> token ids [B]: argmax when temperature == 0, else softmax(logits / T) over the top k."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]  # [B, 1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("model_def", "max_new_tokens", "temperature", "top_k", "vocab_size"))
def _generate(model_def, params, prompt, key, *, max_new_tokens, temperature, top_k, vocab_size):
    b, p = prompt.shape
    cache = init_cache(model_def.cfg, b, p + max_new_tokens, jnp.dtype(model_def.dtype))
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    logits, cache = forward_with_cache(model_def, params, prompt, positions, cache)  # [B, P, Vp]
    keys = jax.random.split(key, max_new_tokens)
    first = sample(logits[:, -1, :vocab_size], keys[0], temperature, top_k)  # [B]

    def step(carry, xs):
        token, cache = carry
        pos, k = xs
        logits, cache = forward_with_cache(model_def, params, token[:, None], jnp.full((b, 1), pos, jnp.int32),
                                           cache)  # [B, 1, Vp]
        nxt = sample(logits[:, 0, :vocab_size], k, temperature, top_k)
        return (nxt, cache), nxt

    steps = jnp.arange(p, p + max_new_tokens - 1, dtype=jnp.int32)
    _, rest = jax.lax.scan(step, (first, cache), (steps, keys[1:]))  # [N - 1, B]
    return jnp.concatenate([first[:, None], rest.T], axis=1)  # [B, N]


def generate(model_def, params, prompt, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
             seed: int = 0, vocab_size: int | None = None):
    """prompt: int32 [B, P] (equal-length prompts) -> new token ids [B, max_new_tokens]."""
    cfg = model_def.cfg
    prompt = jnp.asarray(prompt, jnp.int32)
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise PromptError(f"prompt must be [batch, length > 0] token ids, got shape {prompt.shape}")
    total = prompt.shape[1] + max_new_tokens
    if cfg.position_embedding_type == "learned" and total > cfg.max_position_embeddings:
        raise PromptError(f"prompt + --max_new_tokens = {total} exceeds the {cfg.max_position_embeddings} learned "
                         "positions of this model")
    if max_new_tokens < 1:
        raise PromptError("--max_new_tokens must be at least 1")
    with single_device():
        return _generate(model_def, params, prompt, jax.random.key(seed), max_new_tokens=max_new_tokens,
                         temperature=float(temperature), top_k=int(top_k), vocab_size=vocab_size or cfg.vocab_size)
