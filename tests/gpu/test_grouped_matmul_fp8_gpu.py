"""On the GPU: the compiled FP8 grouped-GEMM kernels (per-tensor: tensorwise and delayed; blockwise) against the
float32 dequantize + ragged_dot of the same quantized values. Their CPU checks (interpreted kernels against NumPy
oracles, the Triton lowering) are tests/unit/test_grouped_matmul_fp8.py and test_grouped_matmul_fp8_blockwise.py.

    JAX_PLATFORMS=cuda python3 -m pytest -m gpu tests/gpu/test_grouped_matmul_fp8_gpu.py -q
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mjax.kernels.grouped_matmul import blockwise_grouped_matmul, fp8_grouped_matmul
from mjax.kernels.quant.fp8 import Fp8Spec
from tests.unit.test_grouped_matmul_fp8 import RECIPES, delayed_metas


@pytest.mark.gpu
@pytest.mark.parametrize("recipe,fmt", RECIPES)
def test_tensorwise_and_delayed_kernels_match_the_reference_of_the_same_quantization(recipe, fmt):
    """On the GPU: the compiled FP8 kernels (and the cast-transpose copies) against the float32 dequantize +
    ragged_dot of the same quantized values, at MoE-like sizes with ragged, empty and padding rows. Both sum exact
    products in float32 (the dequantized values are exact even in TF32) and round once to bf16: within 2^-6 of the
    largest |value| (twice bf16's rounding)."""
    sizes = [0, 300, 17, 0, 512, 129, 64, 0]  # 1022 rows of 1152: padding rows at the end
    k, ns, rows = 512, (768, 256), 1152
    keys = jax.random.split(jax.random.key(7), 4)
    x = jax.random.normal(keys[0], (rows, k), jnp.bfloat16)
    ws = tuple(jax.random.normal(keys[1 + i], (len(sizes), k, n)) * k**-0.5 for i, n in enumerate(ns))
    dys = tuple(jax.random.normal(keys[3], (rows, n), jnp.bfloat16) for n in ns)
    metas = delayed_metas(x, ws, dys, sizes) if recipe == "delayed" else tuple(jnp.ones((8, 3)) for _ in ns)
    spec = Fp8Spec(recipe, fmt, impl="pallas")

    @functools.partial(jax.jit, static_argnums=0)
    def fwd_bwd(impl, x, ws, gs, metas, dys):
        ys, vjp = jax.vjp(lambda x, ws: fp8_grouped_matmul(x, ws, gs, metas, spec, impl=impl), x, ws)
        return ys, *vjp(dys)

    args = (x, ws, jnp.asarray(sizes, jnp.int32), metas, dys)
    got, want = fwd_bwd("pallas", *args), fwd_bwd("xla", *args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.max(np.abs(a - b)) <= 2.0**-6 * np.max(np.abs(b)), (np.max(np.abs(a - b)), np.max(np.abs(b)))
    assert all(np.all(np.asarray(y)[sum(sizes):] == 0) for y in got[0])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_blockwise_kernels_match_the_reference_of_the_same_quantization(fmt):
    """On the GPU: the compiled blockwise kernels (default tiles) against the float32 dequantize + ragged_dot of the
    same quantized values (at full f32 precision: a dequantized value has 24 significant bits, which TF32 would cut),
    at MoE-like sizes with ragged, empty and padding rows, one dispatch group and two under jax.vmap. Both sum in
    float32 and round once to bf16: within 2^-6 of the largest |value| (twice bf16's rounding)."""
    sizes = [[0, 300, 17, 0, 512, 129, 64, 0], [40, 0, 0, 700, 1, 0, 200, 100]]  # of 1152 rows: padding at the end
    k, ns, rows = 512, (768, 256), 1152
    keys = jax.random.split(jax.random.key(7), 4)
    x = jax.random.normal(keys[0], (2, rows, k), jnp.bfloat16)
    ws = tuple(jax.random.normal(keys[1 + i], (8, k, n)) * k**-0.5 for i, n in enumerate(ns))
    dys = tuple(jax.random.normal(keys[3], (2, rows, n), jnp.bfloat16) for n in ns)
    metas = tuple(jnp.ones((8, 3)) for _ in ns)

    @functools.partial(jax.jit, static_argnums=(0, 1))
    def fwd_bwd(impl, batched, x, ws, gs, dys):
        def one(x, gs, dys):
            ys, vjp = jax.vjp(lambda x, ws: blockwise_grouped_matmul(x, ws, gs, metas, fmt, impl=impl), x, ws)
            return ys, *vjp(dys)

        return jax.vmap(one, in_axes=(0, 0, 0))(x, gs, dys) if batched else one(x[0], gs[0], tuple(d[0] for d in dys))

    gs = jnp.asarray(sizes, jnp.int32)
    for batched in (False, True):
        got = fwd_bwd("pallas", batched, x, ws, gs, dys)
        with jax.default_matmul_precision("highest"):
            want = fwd_bwd("xla", batched, x, ws, gs, dys)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            assert np.max(np.abs(a - b)) <= 2.0**-6 * np.max(np.abs(b)), (np.max(np.abs(a - b)), np.max(np.abs(b)))
        for b, item_sizes in enumerate(sizes if batched else sizes[:1]):  # padding rows: zeros
            for y in got[0]:
                assert np.all(np.asarray(y[b] if batched else y)[sum(item_sizes):] == 0)
