"""Blockwise FP8 (1x128 activations, 128x128 weights): quantizers against NumPy/ml_dtypes, the block-scaled GEMM
(reference and the Pallas kernel, interpreted) against NumPy, and the custom_vjp against exact gradients."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mjax.kernels.quant import blockwise as bw
from mjax.kernels.quant.block_gemm import GemmTiles, block_gemm_pallas

E4M3 = ml_dtypes.float8_e4m3fn


def _np_quant_rows(x, dtype=E4M3):
    r, c = x.shape
    xb = x.reshape(r, c // 128, 128)
    amax = np.abs(xb).max(-1)
    s = np.where(amax > 0, amax / float(ml_dtypes.finfo(dtype).max), 1.0).astype(np.float32)
    return (xb / s[..., None]).astype(dtype).reshape(r, c), s


def test_quantize_rows_and_tiles_match_numpy():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8, 256)) * np.exp(rng.standard_normal((8, 1)) * 3)).astype(np.float32)
    x[1, :128] = 0.0  # an all-zero block keeps scale 1
    q, s, amax = jax.jit(bw.quantize_rows, static_argnums=1)(jnp.asarray(x), jnp.float8_e4m3fn)
    assert float(amax) == np.abs(x).max()
    _, sn = _np_quant_rows(x)
    np.testing.assert_allclose(np.asarray(s), sn, rtol=2.5e-7)  # XLA divides by 448 as a multiply: 1 ulp
    qn = (x.reshape(8, 2, 128) / np.asarray(s)[..., None]).astype(E4M3).reshape(8, 256)
    np.testing.assert_array_equal(np.asarray(q).astype(np.float32), qn.astype(np.float32))
    assert np.asarray(s)[1, 0] == 1.0

    w = rng.standard_normal((256, 384)).astype(np.float32)
    wq, ws, w_amax = jax.jit(bw.quantize_tiles, static_argnums=1)(jnp.asarray(w), jnp.float8_e4m3fn)  # [256, 384]
    assert float(w_amax) == np.abs(w).max()
    assert ws.shape == (2, 3)
    blocks = w.reshape(2, 128, 3, 128)
    np.testing.assert_allclose(np.asarray(ws), np.abs(blocks).max((1, 3)) / 448, rtol=2.5e-7)
    np.testing.assert_array_equal(
        np.asarray(wq).astype(np.float32),
        (blocks / np.asarray(ws)[:, None, :, None]).astype(E4M3).astype(np.float32).reshape(256, 384))


def _operands(m=256, k=384, n=256, seed=0):
    ka, kb = jax.random.split(jax.random.key(seed))
    a, sa, _ = bw.quantize_rows(jax.random.normal(ka, (m, k)), jnp.float8_e4m3fn)
    b, sb, _ = bw.quantize_tiles(jax.random.normal(kb, (k, n)), jnp.float8_e4m3fn)
    return a, sa, b.T, bw.expand_cols(sb)  # B passed transposed, [N, K]


def test_block_gemm_reference_matches_numpy():
    a, sa, b, sb = _operands()
    an = np.asarray(a).astype(np.float32) * np.repeat(np.asarray(sa), 128, 1)
    bn = np.asarray(b).astype(np.float32).T * np.repeat(np.asarray(sb), 128, 0)
    got = jax.jit(bw.block_gemm_reference, static_argnums=4)(a, sa, b, sb, jnp.float32)
    np.testing.assert_allclose(np.asarray(got), an @ bn, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("tiles", [GemmTiles(), GemmTiles(bm=64, bn=128)])
def test_pallas_block_gemm_matches_reference(tiles):
    a, sa, b, sb = _operands(seed=1)
    ref = jax.jit(bw.block_gemm_reference, static_argnums=4)(a, sa, b, sb, jnp.float32)
    got = block_gemm_pallas(a, sa, b, sb, out_dtype=jnp.float32, interpret=True, tiles=tiles)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_blockwise_matmul_grads_close_to_exact(impl):
    kx, kw = jax.random.split(jax.random.key(2))
    x = jax.random.normal(kx, (128, 256)).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (256, 128)) * 0.05
    spec = bw.BlockwiseSpec("hybrid", impl, interpret=True)

    def loss(f, x, w):
        return jnp.sum(jnp.sin(f(x, w).astype(jnp.float32)))

    exact = jax.jit(jax.grad(lambda x, w: loss(lambda a, b: a.astype(jnp.float32) @ b, x, w), (0, 1)))(x, w)
    dx, dw, dmeta = jax.jit(jax.grad(lambda x, w, m: loss(lambda a, b: bw.blockwise_matmul(a, b, m, spec), x, w),
                                     (0, 1, 2)))(x, w, jnp.ones(3))
    for a, b in ((dx, exact[0]), (dw, exact[1])):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 0.12  # e5m2 grads
    np.testing.assert_allclose(np.asarray(dmeta)[:2], [np.abs(np.asarray(x, np.float32)).max(),
                                                       np.abs(np.asarray(w)).max()], rtol=1e-6)


def test_blockwise_shapes_must_tile():
    x, w = jnp.ones((100, 128), jnp.bfloat16), jnp.ones((128, 128))
    with pytest.raises(bw.BlockwiseUnsupported, match="micro_batch_size"):
        bw.blockwise_matmul(x, w, jnp.ones(3), bw.BlockwiseSpec())


def _np_quant_tiles(w, dtype=E4M3):
    k, n = w.shape
    blocks = w.reshape(k // 128, 128, n // 128, 128)
    amax = np.abs(blocks).max((1, 3))
    s = np.where(amax > 0, amax / float(ml_dtypes.finfo(dtype).max), 1.0).astype(np.float32)
    return (blocks / s[:, None, :, None]).astype(dtype).reshape(k, n), s


def _deq_rows(q, s):
    return q.astype(np.float64) * np.repeat(s.astype(np.float64), 128, 1)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_blockwise_matmul_forward_dgrad_wgrad_match_a_numpy_oracle(impl):
    """Each GEMM against NumPy products of operands quantized the same way (1x128 rows, 128x128 tiles; 128x1 for the
    wgrad operands), on inputs whose magnitude changes by orders across rows and blocks: one scale per tensor,
    a swapped scale or a wrong block orientation is off by more than the row tolerance."""
    rng = np.random.default_rng(3)
    m = k = n = 256
    x = rng.standard_normal((m, k)) * np.exp(2 * rng.standard_normal((m, 1))) * np.repeat(
        np.exp(2 * rng.standard_normal((1, k // 128))), 128, 1)
    tile_scale = np.exp(2 * rng.standard_normal((k // 128, n // 128)))
    w = rng.standard_normal((k, n)) * np.kron(tile_scale, np.ones((128, 128)))
    g = rng.standard_normal((m, n)) * np.exp(2 * rng.standard_normal((m, 1)))
    x = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)  # the bf16 values the kernel sees
    g = np.asarray(jnp.asarray(g, jnp.bfloat16), np.float32)
    w = w.astype(np.float32)
    spec = bw.BlockwiseSpec("hybrid", impl, interpret=True)
    y, vjp = jax.vjp(lambda a, b, c: bw.blockwise_matmul(a, b, c, spec), jnp.asarray(x, jnp.bfloat16),
                     jnp.asarray(w), jnp.ones(3))
    dx, dw, _ = vjp(jnp.asarray(g, jnp.bfloat16))

    E5M2 = ml_dtypes.float8_e5m2
    xq, sx = _np_quant_rows(x)
    wq, sw = _np_quant_tiles(w)
    w_deq = wq.astype(np.float64) * np.kron(sw.astype(np.float64), np.ones((128, 128)))
    gq, sg = _np_quant_rows(g, E5M2)
    xtq, sxt = _np_quant_rows(x.T)
    gtq, sgt = _np_quant_rows(g.T, E5M2)
    want = {"y": _deq_rows(xq, sx) @ w_deq, "dx": _deq_rows(gq, sg) @ w_deq.T,
            "dw": _deq_rows(xtq, sxt) @ _deq_rows(gtq, sgt).T}
    for name, got in (("y", y), ("dx", dx), ("dw", dw)):
        got, ref = np.asarray(got, np.float64), want[name]
        rows = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
        # XLA's scales can sit 1 ulp from NumPy's (it divides by 448 as a multiply), now and then flipping an FP8
        # rounding: worst rows ~2.5e-2 here. One scale per tensor gives 0.15 on the forward alone.
        assert rows.max() < 5e-2, (name, rows.max())


def test_blockwise_reports_the_tensor_amaxes_of_x_w_and_grad():
    """The meta's gradient is (amax x, amax w, amax grad), taken from the block amaxes the quantization computes."""
    kx, kw, kg = jax.random.split(jax.random.key(3), 3)
    x, w = jax.random.normal(kx, (256, 128)) * 3, jax.random.normal(kw, (128, 256)) * 0.1
    g = jax.random.normal(kg, (256, 256)) * 1e-3
    _, vjp = jax.vjp(lambda m: bw.blockwise_matmul(x, w, m, bw.BlockwiseSpec()), jnp.ones((3,), jnp.float32))
    np.testing.assert_array_equal(vjp(g)[0], [jnp.abs(x).max(), jnp.abs(w).max(), jnp.abs(g).max()])


def test_partial_blocks_are_scaled_by_their_real_entries():
    """K and N that are not whole blocks (DeepSeek-V3's KV down-projection is 576 wide): the policy's matmul equals
    the blockwise product of the zero-padded operands with the padding sliced off, values and gradients, and stays
    within FP8's error of the exact product."""
    from mjax.kernels.quant.policy import QuantPolicy, quantized_matmul  # noqa: PLC0415

    kx, kw, kg = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(kx, (128, 200)).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (200, 192)) * 0.05
    g = jax.random.normal(kg, (128, 192)).astype(jnp.bfloat16)
    policy = QuantPolicy(fp8_recipe="blockwise", fp8_format="e4m3", quant_impl="xla")
    spec = bw.BlockwiseSpec("e4m3", "xla", interpret=True)

    def by_hand(x, w):
        y = bw.blockwise_matmul(jnp.pad(x, ((0, 0), (0, 56))), jnp.pad(w, ((0, 56), (0, 64))), jnp.ones(3), spec)
        return y[:, :192]

    y, vjp = jax.vjp(lambda x, w: quantized_matmul(policy, x, w, jnp.ones(3)), x, w)
    want, want_vjp = jax.vjp(by_hand, x, w)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
    for a, b in zip(vjp(g), want_vjp(g)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    exact = np.asarray(x, np.float32) @ np.asarray(w)
    assert np.linalg.norm(np.asarray(y, np.float32) - exact) / np.linalg.norm(exact) < 0.06  # measured 0.037
