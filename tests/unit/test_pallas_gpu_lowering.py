"""The quantization kernels lower through Triton for an H200 on a machine without a GPU (tests/helpers/gpu_lowering.py;
flash attention has its own cases in test_flash_attention.py)."""

import jax
import jax.numpy as jnp
import pytest

from mjax.kernels.quant.fp4_pallas import fake_quant_pallas
from mjax.kernels.quant.blockwise import BlockwiseSpec, blockwise_matmul
from mjax.kernels.quant.cast_transpose import cast_transpose_local
from tests.helpers.gpu_lowering import lower_for_h200

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_blockwise_fp8_gemms_lower(fmt):
    """Forward (e4m3 x e4m3), dgrad and wgrad (gradient x e4m3: e5m2 x e4m3 under hybrid) all lower."""
    spec = BlockwiseSpec(fmt, impl="pallas", interpret=False)

    def fwd_bwd(x, w, g):
        y, vjp = jax.vjp(lambda x, w: blockwise_matmul(x, w, jnp.ones(3), spec), x, w)
        return y, *vjp(g)

    args = (jnp.zeros((256, 256), jnp.bfloat16), jnp.zeros((256, 384), jnp.float32),
            jnp.zeros((256, 384), jnp.bfloat16))
    assert lower_for_h200(fwd_bwd, *args) == 3


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("src", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("with_amax", [False, True])
def test_fp8_cast_transpose_lowers(dtype, src, with_amax):
    """The kernel itself (its custom_partitioning wrapper needs real devices to lower)."""
    f = lambda x, s: cast_transpose_local(x, s, dtype=dtype, interpret=False, with_amax=with_amax)  # noqa: E731
    assert lower_for_h200(f, jnp.zeros((256, 384), src), jnp.ones((1,), jnp.float32)) == 1


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("stochastic", [False, True])
def test_fp4_quantize_kernel_lowers(recipe, stochastic):
    f = lambda x: fake_quant_pallas(x, recipe=recipe, stochastic=stochastic)  # noqa: E731
    assert lower_for_h200(f, jnp.zeros((256, 512), jnp.bfloat16)) == 1
