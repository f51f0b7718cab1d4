"""The Mosaic GPU grouped matmul off the GPU: its dispatch facts, its tiles, and that forward, dgrad and wgrad lower
for CUDA (the Mosaic GPU compiler's passes run at lowering: shapes, layouts, transforms and TMA copies are checked
here; the values are checked on a Hopper GPU by tests/gpu/test_grouped_matmul_mosaic.py)."""

import jax
import jax.numpy as jnp
import pytest

from mjax.kernels.grouped_matmul import (GroupedMatmulUnsupported, KernelTile, Tiling, choose_impl, grouped_matmul,
                                         why_unsupported)
from mjax.kernels.grouped_matmul.mosaic import grouped_matmul_mosaic, mosaic_tile_problem
from mjax.kernels.grouped_matmul.tiling import default_mosaic_tiling

FACTS = dict(dtype=jnp.bfloat16, k=2048, n=768, m=32768, groups=8)


def test_mosaic_runs_only_on_a_gpu_and_only_16_bit_calls():
    assert "only on a GPU" in why_unsupported("mosaic", backend="cpu", **FACTS)
    assert why_unsupported("mosaic", backend="gpu", **FACTS) is None
    assert "float32" in why_unsupported("mosaic", backend="gpu", **{**FACTS, "dtype": jnp.float32})
    assert "FP8" in why_unsupported("mosaic", backend="gpu", **FACTS, fp8_grad=jnp.float8_e5m2)
    assert "multiples of 64" in why_unsupported("mosaic", backend="gpu", **{**FACTS, "n": 96})
    x, w, gs = jnp.zeros((8, 64), jnp.bfloat16), jnp.zeros((2, 64, 64), jnp.bfloat16), jnp.array([3, 5])
    with pytest.raises(GroupedMatmulUnsupported, match="--moe_grouped_gemm_impl=mosaic cannot do this call"):
        grouped_matmul(x, w, gs, impl="mosaic")
    assert choose_impl("mosaic", backend="gpu", **FACTS) == "mosaic"


def test_default_tiles_and_tile_problems():
    t = default_mosaic_tiling(2048, 768)
    assert (t.forward.block_m, t.forward.block_n, t.dgrad.block_n, t.wgrad.block_m, t.wgrad.block_n) == \
        (128, 192, 128, 128, 192)
    t = default_mosaic_tiling(4096, 14336)  # Mixtral: 14336 = 112 x 128, no multiple of 192
    assert (t.forward.block_n, t.wgrad.block_n) == (128, 128)
    assert default_mosaic_tiling(2048, 1408).forward.block_n == 128  # DeepSeek-MoE: 1408 = 11 x 128
    assert default_mosaic_tiling(2048, 1472).forward.block_n == 64  # 23 x 64
    assert "accumulator" in mosaic_tile_problem("forward", KernelTile(128, 256, 64, 4, 4), 2048, 768)
    assert "num_warps=4" in mosaic_tile_problem("forward", KernelTile(128, 128, 64, 8, 4), 2048, 768)
    assert "multiple of block_n" in mosaic_tile_problem("dgrad", KernelTile(128, 192, 64, 4, 4), 2048, 768)
    assert "multiples of 64" in mosaic_tile_problem("forward", KernelTile(128, 96, 64, 4, 4), 2048, 768)


def _mosaic_calls(rows, k, n, groups, dtype, tiling):
    def fwd_bwd(x, w, gs, dy):
        y, vjp = jax.vjp(lambda x, w: grouped_matmul_mosaic(x, w, gs, tiling, 132), x, w)
        return y, *vjp(dy)

    args = (jax.ShapeDtypeStruct((rows, k), dtype), jax.ShapeDtypeStruct((groups, k, n), dtype),
            jax.ShapeDtypeStruct((groups,), jnp.int32), jax.ShapeDtypeStruct((rows, n), dtype))
    text = jax.jit(fwd_bwd).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return text.count("stablehlo.custom_call @mosaic_gpu")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("rows", [1024, 1000])  # whole 128-row blocks, and a last block past the array
def test_forward_dgrad_and_wgrad_lower_for_cuda(dtype, rows):
    assert _mosaic_calls(rows, 256, 384, 5, dtype, default_mosaic_tiling(256, 384)) == 3


def test_other_tiles_lower_too():
    tiling = Tiling(KernelTile(64, 64, 64, 4, 3, 1), KernelTile(128, 64, 128, 4, 2, 2), KernelTile(64, 128, 64, 4, 5, 8))
    assert _mosaic_calls(1000, 256, 128, 3, jnp.bfloat16, tiling) == 3
