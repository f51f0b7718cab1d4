"""The rules every attention implementation shares: it takes q, k, v of one floating dtype, one segment-id array only
when query and key lengths are equal, and a sliding window of at least one position; anything else is
AttentionUnsupported, never a silent zero output or a broadcasting error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mjax.kernels.attention import AttentionUnsupported, dot_product_attention

B, T, N, K, H = 1, 8, 2, 1, 8  # GQA: 2 query heads share 1 KV head


def qkv(dtype=jnp.float32, t=T, s=T):
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (B, t, N, H), jnp.float32)
    k = jax.random.normal(kk, (B, s, K, H), jnp.float32)
    v = jax.random.normal(kv, (B, s, K, H), jnp.float32)
    if jnp.issubdtype(dtype, jnp.integer):
        return tuple(jnp.round(x * 10).astype(dtype) for x in (q, k, v))
    return tuple(x.astype(dtype) for x in (q, k, v))


@pytest.mark.parametrize("impl", ["xla", "auto"])
def test_integer_inputs_are_refused(impl):
    with pytest.raises(AttentionUnsupported, match="floating dtype"):
        dot_product_attention(*qkv(jnp.int8), impl=impl)


def test_mixed_dtypes_are_refused():
    q, k, v = qkv()
    with pytest.raises(AttentionUnsupported, match="one floating dtype"):
        dot_product_attention(q, k.astype(jnp.bfloat16), v, impl="xla")


def test_one_segment_array_needs_equal_query_and_key_lengths():
    q, k, v = qkv(t=4, s=T)
    with pytest.raises(AttentionUnsupported, match="pair"):
        dot_product_attention(q, k, v, segment_ids=jnp.ones((B, 4), jnp.int32), impl="xla")


def test_a_segment_pair_with_unequal_lengths_is_taken():
    q, k, v = qkv(t=4, s=T)
    q_seg = jnp.array([[0, 0, 1, 1]], jnp.int32)
    kv_seg = jnp.array([[0, 0, 0, 0, 1, 1, 1, 1]], jnp.int32)
    out = dot_product_attention(q, k, v, causal=False, segment_ids=(q_seg, kv_seg), impl="xla")
    # NumPy oracle: each query attends the keys of its own segment, softmax over those only
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    logits = np.einsum("tnh,sh->nts", qn[0], kn[0, :, 0]) / np.sqrt(H)  # [N, T, S]
    logits = np.where(np.asarray(q_seg)[0][None, :, None] == np.asarray(kv_seg)[0][None, None, :], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    want = np.einsum("nts,sh->tnh", p / p.sum(-1, keepdims=True), vn[0, :, 0])
    np.testing.assert_allclose(np.asarray(out)[0], want, rtol=1e-5, atol=1e-5)  # fp32 vs fp64: ~1e-7 measured


@pytest.mark.parametrize("impl", ["xla", "pallas"])  # pallas runs interpreted on CPU
def test_a_window_of_zero_positions_is_refused(impl):
    with pytest.raises(AttentionUnsupported, match="sliding_window"):
        dot_product_attention(*qkv(), sliding_window=0, impl=impl)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_a_window_of_one_position_attends_only_itself(impl):
    q, k, v = qkv()
    out = dot_product_attention(q, k, v, sliding_window=1, impl=impl)
    want = np.repeat(np.asarray(v), N // K, axis=2)  # each query sees only its own key: softmax weight 1
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6, atol=1e-6)
