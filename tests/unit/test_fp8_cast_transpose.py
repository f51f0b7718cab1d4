"""The FP8 cast-transpose kernel (interpreted) against `fp8.quantize` and its transpose, alone and sharded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mjax.kernels.quant.fp8 import quantize
from mjax.kernels.quant.cast_transpose import cast_transpose


def _f32(a):
    return np.asarray(a, np.float32)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("shape,src", [((256, 384), jnp.bfloat16), ((300, 200), jnp.bfloat16),
                                       ((128, 256), jnp.float32)])
def test_cast_transpose_matches_quantize(dtype, shape, src):
    """Both copies bit-equal to the saturating cast (values past the FP8 range included); ragged shapes pad."""
    x = (jax.random.normal(jax.random.key(0), shape) * 300).astype(src)
    scale = jnp.float32(2.0 ** 7)  # pushes the tails past e4m3's 448: saturation is exercised
    q, qt = jax.jit(lambda x, s: cast_transpose(x, s, dtype, interpret=True))(x, scale)
    ref = _f32(quantize(x, scale, dtype))
    assert q.dtype == qt.dtype == dtype and q.shape == shape and qt.shape == shape[::-1]
    np.testing.assert_array_equal(_f32(q), ref)
    np.testing.assert_array_equal(_f32(qt), ref.T)
    assert np.abs(ref).max() == float(jnp.finfo(dtype).max)


@pytest.mark.parametrize("spec", [P("data", None), P("data", "tensor"), P(None, "tensor")])
def test_cast_transpose_sharded_without_gathers(spec):
    """Each device quantizes its own shard; the transposed copy comes out sharded transposed, with no collective."""
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = (jax.random.normal(jax.random.key(1), (512, 256)) * 30).astype(jnp.bfloat16)
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    f = jax.jit(lambda x, s: cast_transpose(x, s, jnp.float8_e4m3fn, interpret=True))
    q, qt = f(xs, jnp.float32(2.0))
    ref = _f32(quantize(x, 2.0, jnp.float8_e4m3fn))
    np.testing.assert_array_equal(_f32(q), ref)
    np.testing.assert_array_equal(_f32(qt), ref.T)
    rows, cols = (tuple(spec) + (None,))[:2]
    assert q.sharding.is_equivalent_to(NamedSharding(mesh, P(rows, cols)), 2)
    assert qt.sharding.is_equivalent_to(NamedSharding(mesh, P(cols, rows)), 2)
    hlo = f.lower(xs, jnp.float32(2.0)).compile().as_text()
    assert not any(c in hlo for c in ("all-gather", "all-to-all", "collective-permute", "all-reduce"))


@pytest.mark.parametrize("shape", [(256, 512), (300, 200)])
def test_amax_from_the_same_pass(shape):
    """with_amax (delayed scaling): max |x| of the unscaled input, exactly, whatever the padding; NaN or inf in x
    make it non-finite, as the reference's max."""
    x = (jax.random.normal(jax.random.key(2), shape) * 30).astype(jnp.bfloat16)
    f = jax.jit(lambda x: cast_transpose(x, jnp.float32(4.0), jnp.float8_e4m3fn, interpret=True, with_amax=True))
    q, qt, a = f(x)
    assert a.shape == () and a.dtype == jnp.float32
    assert float(a) == float(jnp.max(jnp.abs(x)))
    np.testing.assert_array_equal(_f32(q), _f32(quantize(x, 4.0, jnp.float8_e4m3fn)))
    for bad in (jnp.nan, -jnp.inf):
        assert not np.isfinite(float(f(x.at[shape[0] - 1, 3].set(bad))[2]))


def test_amax_sharded_is_the_whole_tensors():
    """Each device's tile maxima, then one max over the devices (a scalar all-reduce, no gather)."""
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = (jax.random.normal(jax.random.key(3), (512, 256)) * 30).astype(jnp.bfloat16).at[17, 200].set(1000.0)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", "tensor")))
    f = jax.jit(lambda x: cast_transpose(x, jnp.float32(0.25), jnp.float8_e4m3fn, interpret=True, with_amax=True))
    q, qt, a = f(xs)
    assert float(a) == 1000.0
    np.testing.assert_array_equal(_f32(q), _f32(quantize(x, 0.25, jnp.float8_e4m3fn)))
    assert q.sharding.is_equivalent_to(NamedSharding(mesh, P("data", "tensor")), 2)
    hlo = f.lower(xs).compile().as_text()
    assert "all-reduce" in hlo and not any(c in hlo for c in ("all-gather", "all-to-all", "collective-permute"))
