"""Every Pallas kernel lowers through Triton for an H200, on a machine without a GPU.

Interpreted kernels (the CPU tests) run the kernel body as plain JAX, so whatever only the Triton lowering
rejects (operand types of a dot, block shapes, unsupported ops) would first show up on the GPU. Lowering for an
abstract H200 device runs that same lowering here.
"""

import jax
import jax.numpy as jnp
import pytest
from jax._src.mesh import AbstractDevice, AbstractMesh  # no public constructor for an abstract device yet

from mjax.kernels.flash_attention import flash_attention
from mjax.kernels.fp4_pallas import fake_quant_pallas
from mjax.kernels.fp8_cast_transpose import _cast_transpose_local
from mjax.kernels.fp8_blockwise import BlockwiseSpec, blockwise_matmul

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                                                  platform="gpu"))


def _lower_for_h200(f, *args) -> str:
    with jax.sharding.use_abstract_mesh(H200):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _linear_fwd_bwd(matmul):
    def f(x, w, g):
        y, vjp = jax.vjp(matmul, x, w)
        return y, *vjp(g)
    return f


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_blockwise_fp8_gemms_lower(fmt):
    """Forward (e4m3 x e4m3), dgrad and wgrad (gradient x e4m3: e5m2 x e4m3 under hybrid) all lower."""
    x, w, g = jnp.zeros((256, 256), jnp.bfloat16), jnp.zeros((256, 384), jnp.float32), jnp.zeros((256, 384),
                                                                                                  jnp.bfloat16)
    spec = BlockwiseSpec(fmt, impl="pallas", interpret=False)
    hlo = _lower_for_h200(_linear_fwd_bwd(lambda x, w: blockwise_matmul(x, w, jnp.ones(3), spec)), x, w, g)
    assert hlo.count("mjax_fp8_block_gemm") >= 3


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("src", [jnp.bfloat16, jnp.float32])
def test_fp8_cast_transpose_lowers(dtype, src):
    """The kernel itself (its custom_partitioning wrapper needs real devices to lower)."""
    hlo = _lower_for_h200(lambda x, s: _cast_transpose_local(x, s, dtype=dtype, interpret=False),
                          jnp.zeros((256, 384), src), jnp.ones((1,), jnp.float32))
    assert "mjax_fp8_cast_transpose" in hlo


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
def test_fp4_quantize_kernel_lowers(recipe):
    hlo = _lower_for_h200(lambda x: fake_quant_pallas(x, recipe=recipe), jnp.zeros((256, 512), jnp.bfloat16))
    assert f"mjax_fp4_fake_quant_{recipe}" in hlo


@pytest.mark.parametrize("window", [None, 128])
def test_flash_attention_lowers(window):
    q = jnp.zeros((1, 256, 4, 64), jnp.bfloat16)
    kv = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)

    def f(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, sliding_window=window, interpret=False), q, k, v)
        return out, *vjp(out)

    hlo = _lower_for_h200(f, q, kv, kv)
    assert all(name in hlo for name in ("mjax_flash_fwd", "mjax_flash_bwd_dq", "mjax_flash_bwd_dkv"))
