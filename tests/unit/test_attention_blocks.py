"""Attention blocks with a traced query offset and their blockwise backward: what context parallelism is built on.

Oracles: a NumPy softmax attention over an explicitly built mask, and jax.grad of the whole (unsplit) reference
attention, which the blocks' gradients against the merged output and log-sum-exp must add up to.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mjax.kernels.attention import attention_block_backward, dot_product_attention, reference_attention

B, T, S, N, K, H = 2, 32, 48, 4, 2, 16


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, N, H)).astype(np.float32)
    k = rng.normal(size=(B, S, K, H)).astype(np.float32)
    v = rng.normal(size=(B, S, K, H)).astype(np.float32)
    q_seg = np.sort(rng.integers(0, 3, size=(B, T)), axis=1).astype(np.int32)
    kv_seg = np.sort(rng.integers(0, 3, size=(B, S)), axis=1).astype(np.int32)
    return q, k, v, q_seg, kv_seg


def _numpy_attention(q, k, v, offsets, window, q_seg, kv_seg):
    """float64 attention where query i of row b sees key j iff j <= i + offsets[b] (and the window, segments)."""
    i = np.arange(T)[None, :, None] + np.asarray(offsets)[:, None, None]
    j = np.arange(S)[None, None, :]
    mask = j <= i
    if window is not None:
        mask &= i - j < window
    if q_seg is not None:
        mask &= q_seg[:, :, None] == kv_seg[:, None, :]
    kr = np.repeat(k.astype(np.float64), N // K, axis=2)
    vr = np.repeat(v.astype(np.float64), N // K, axis=2)
    z = np.einsum("btnh,bsnh->bnts", q.astype(np.float64), kr) * H**-0.5
    z = np.where(mask[:, None], z, -np.inf)
    m = np.max(z, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(z - m)
    denom = p.sum(-1, keepdims=True)
    out = np.einsum("bnts,bsnh->btnh", p / np.where(denom == 0, 1, denom), vr)
    with np.errstate(divide="ignore"):
        lse = (np.log(denom) + m)[..., 0]
    return out, lse


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("window,segments", [(None, False), (7, False), (None, True), (12, True)])
def test_traced_offset_matches_numpy(impl, window, segments):
    q, k, v, q_seg, kv_seg = _inputs()
    offsets = np.array([5, -9], np.int32)  # per row; -9: the first queries see no key at all
    seg = (q_seg, kv_seg) if segments else None

    @jax.jit
    def run(q, k, v, offsets, seg):
        return dot_product_attention(q, k, v, causal=True, sliding_window=window, segment_ids=seg, impl=impl,
                                     return_lse=True, offset=offsets)

    out, lse = run(q, k, v, offsets, seg)
    ref_out, ref_lse = _numpy_attention(q, k, v, offsets, window, *(seg or (None, None)))
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=2e-5)  # fp32 vs fp64: 5e-7 measured
    seen = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), seen)
    np.testing.assert_allclose(np.asarray(lse)[seen], ref_lse[seen], atol=2e-5)


def _block_inputs(segments):
    q, k, v, q_seg, kv_seg = _inputs(1)
    do = np.random.default_rng(2).normal(size=(B, T, N, H)).astype(np.float32)
    return q, k, v, do, ((q_seg, kv_seg) if segments else None)


@functools.cache  # one compiled oracle per mask, shared by both impls
def _whole(window, segments):
    """The unsplit reference attention and the gradient of its sum against do, compiled as one program."""
    q, k, v, do, seg = _block_inputs(segments)

    @jax.jit
    def whole(q, k, v):
        attend = lambda q, k, v: reference_attention(q, k, v, causal=True, sliding_window=window,  # noqa: E731
                                                     segment_ids=seg)
        return attend(q, k, v), jax.grad(lambda *a: jnp.sum(attend(*a) * do), argnums=(0, 1, 2))(q, k, v)

    return whole(q, k, v)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("window,segments", [(None, False), (20, True)])
def test_blocks_add_up_to_the_whole_gradient(impl, window, segments):
    """Keys split in two blocks [0, 16) and [16, 48): each block's forward (offset relative to its first key) merged
    by log-sum-exp is the whole attention, and the blocks' backward against the merged output sums to its grad."""
    q, k, v, do, seg = _block_inputs(segments)
    base = S - T  # the whole attention's offset: query i at key position i + 16
    cut = 16
    whole_out, grads = _whole(window, segments)
    blocks = [(0, cut), (cut, S)]

    @jax.jit
    def blockwise(q, k, v, do):
        parts = []
        for lo, hi in blocks:
            bseg = None if seg is None else (seg[0], seg[1][:, lo:hi])
            parts.append((bseg, lo, hi, dot_product_attention(
                q, k[:, lo:hi], v[:, lo:hi], causal=True, sliding_window=window, segment_ids=bseg, impl=impl,
                return_lse=True, offset=jnp.int32(base - lo))))
        lse = jnp.logaddexp(parts[0][3][1], parts[1][3][1])
        safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
        out = sum(o.astype(jnp.float32) * jnp.swapaxes(jnp.exp(l - safe), 1, 2)[..., None]
                  for *_, (o, l) in parts)
        dq = jnp.zeros_like(q)
        dk, dv = [], []
        for bseg, lo, hi, _ in parts:
            a, b_, c = attention_block_backward(q, k[:, lo:hi], v[:, lo:hi], out, lse, do, causal=True,
                                                sliding_window=window, segment_ids=bseg, impl=impl,
                                                offset=jnp.int32(base - lo))
            dq, dk, dv = dq + a, dk + [b_], dv + [c]
        return out, dq, jnp.concatenate(dk, 1), jnp.concatenate(dv, 1)

    out, *block_grads = blockwise(q, k, v, do)
    np.testing.assert_allclose(np.asarray(out), np.asarray(whole_out), atol=2e-5)
    for got, want in zip(block_grads, grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=5e-5)  # 8e-7 measured


def test_cudnn_refuses_an_offset():
    from mjax.kernels.attention import why_unsupported

    reason = why_unsupported("cudnn", backend="gpu", dtype=jnp.bfloat16, head_dim=128, segment_ids=False,
                             return_lse=False, offset=True)
    assert reason == "cudnn takes no query position offset"
