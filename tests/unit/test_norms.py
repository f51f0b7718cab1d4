"""The norms' and the MoE SwiGLU's hand-written backwards against autodiff of the plain formulas, and what they keep
for the backward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals

from mjax.model.norms import layer_norm, rms_norm

EPS = 1e-5


def plain_rms(x, scale, eps, dtype):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps) * scale).astype(dtype)


def plain_ln(x, scale, bias, eps, dtype):
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, -1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), -1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps) * scale + bias).astype(dtype)


def _inputs(shape, dtype, seed=0):
    kx, ks, kb, kg = jax.random.split(jax.random.key(seed), 4)
    d = shape[-1]
    x = (3 * jax.random.normal(kx, shape) + 0.5).astype(dtype)
    scale = 1 + 0.1 * jax.random.normal(ks, (d,))
    bias = 0.1 * jax.random.normal(kb, (d,))
    g = jax.random.normal(kg, shape).astype(dtype)
    return x, scale, bias, g


def _grads(f, args, g):
    out, vjp = jax.vjp(f, *args)
    return out, vjp(g)


def _close(a, b, rtol):  # relative to the largest entry: the backward's sums differ in order only
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_allclose(a, b, rtol=0, atol=rtol * np.max(np.abs(b)))


# fp32: the two backwards round differently (measured 1e-7 relative); bf16 inputs: dx is rounded to bf16 by both
# (one bf16 ulp, 2^-8, apart at most)
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", [(2, 8, 64), (3, 5, 4, 16)])  # the second: a per-head norm ([.., heads, dim])
def test_rms_norm_matches_autodiff(dtype, tol, shape):
    x, scale, _, g = _inputs(shape, dtype)
    ours, (dx, ds) = _grads(lambda x, s: rms_norm(x, s, EPS, dtype), (x, scale), g)
    ref, (rdx, rds) = _grads(lambda x, s: plain_rms(x, s, EPS, dtype), (x, scale), g)
    np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(ref, np.float32))
    assert dx.dtype == x.dtype and ds.dtype == scale.dtype
    _close(dx, rdx, tol)
    _close(ds, rds, 2e-6)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 1e-2)])
def test_layer_norm_matches_autodiff(dtype, tol):
    x, scale, bias, g = _inputs((2, 8, 64), dtype, seed=1)
    ours, (dx, ds, db) = _grads(lambda x, s, b: layer_norm(x, s, b, EPS, dtype), (x, scale, bias), g)
    ref, (rdx, rds, rdb) = _grads(lambda x, s, b: plain_ln(x, s, b, EPS, dtype), (x, scale, bias), g)
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(ref, np.float32), rtol=0,
                               atol=float(jnp.finfo(dtype).eps) * 8)
    _close(dx, rdx, tol)
    _close(ds, rds, 2e-6)
    _close(db, rdb, 2e-6)


def test_rms_norm_value_against_numpy():
    x, scale, _, _ = _inputs((4, 32), jnp.float32, seed=2)
    x64, s64 = np.asarray(x, np.float64), np.asarray(scale, np.float64)
    want = x64 / np.sqrt(np.mean(x64**2, -1, keepdims=True) + EPS) * s64
    np.testing.assert_allclose(np.asarray(rms_norm(x, scale, EPS, jnp.float32)), want, rtol=2e-6, atol=0)


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_backward_keeps_only_the_input_and_row_statistics(norm):
    """A bf16 [.., D] input leaves no fp32 [.., D] residual: the backward recomputes it."""
    x, scale, bias, _ = _inputs((2, 8, 64), jnp.bfloat16)
    if norm == "rms":
        f = lambda x: jnp.sum(rms_norm(x, scale, EPS, jnp.bfloat16).astype(jnp.float32))  # noqa: E731
    else:
        f = lambda x: jnp.sum(layer_norm(x, scale, bias, EPS, jnp.bfloat16).astype(jnp.float32))  # noqa: E731
    big = [a for a, _ in saved_residuals(f, x) if a.shape and a.shape[-1] == 64 and a.ndim == 3]
    assert [a.dtype for a in big] == [jnp.bfloat16]  # x itself
    plain = (lambda x: jnp.sum(plain_rms(x, scale, EPS, jnp.bfloat16).astype(jnp.float32))) if norm == "rms" else (
        lambda x: jnp.sum(plain_ln(x, scale, bias, EPS, jnp.bfloat16).astype(jnp.float32)))
    assert any(a.dtype == jnp.float32 and a.shape == x.shape for a, _ in saved_residuals(plain, x))  # what it saves


@pytest.mark.parametrize("dtype,wdtype", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32)])
def test_weighted_swiglu_matches_autodiff(dtype, wdtype):
    """The MoE experts' silu(gate) * up * weight: forward equal, backward as autodiff of the plain expression, and
    no float32 [R, F] residual for 16-bit rows."""
    from mjax.kernels.swiglu import weighted_swiglu  # noqa: PLC0415

    kg, ku, kw, kd = jax.random.split(jax.random.key(3), 4)
    g, u = (2 * jax.random.normal(kg, (24, 32))).astype(dtype), jax.random.normal(ku, (24, 32)).astype(dtype)
    w, dy = jax.random.uniform(kw, (24,), wdtype), jax.random.normal(kd, (24, 32)).astype(dtype)

    def plain(g, u, w):
        return (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32) * w[:, None]).astype(dtype)

    ours, ours_grads = _grads(weighted_swiglu, (g, u, w), dy)
    ref, ref_grads = _grads(plain, (g, u, w), dy)
    np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(ref, np.float32))
    tol = 2e-6 if dtype == jnp.float32 else 1e-2  # bf16 gradients: one rounding, placed differently
    for a, b in zip(ours_grads, ref_grads):
        assert a.dtype == b.dtype
        _close(a, b, tol)
    f = lambda g, u: jnp.sum(weighted_swiglu(g, u, w).astype(jnp.float32))  # noqa: E731
    if dtype == jnp.bfloat16:
        assert not [a for a, _ in saved_residuals(f, g, u) if a.dtype == jnp.float32 and a.shape == g.shape]
