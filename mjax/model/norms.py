"""RMSNorm and LayerNorm with hand-written backwards that keep only the input and the fp32 row statistics.

Autodiff of the plain formulas keeps two fp32 copies of the input per norm ([.., D] as float32, and the normalised
value) for the backward: twice the bytes of a bf16 activation each, two norms a layer. As fused-norm kernels do
(Megatron's and Transformer Engine's), the backward here recomputes the normalised value from the input in its own
dtype and the saved statistics ([.., 1] fp32). Statistics and the backward run in fp32."""

import functools

import jax
import jax.numpy as jnp


def _leading_sum(a, like):  # sum over every axis `like` (a weight of the last axes' shape) is broadcast over
    return jnp.sum(a, axis=tuple(range(a.ndim - like.ndim))).astype(like.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rms_norm(x, scale, eps: float, dtype):
    """x / rms(x) * scale over the last axis (scale's shape), returned in `dtype`."""
    return _rms_forward(x, scale, eps, dtype)[0]


def _rms_forward(x, scale, eps, dtype):
    x32 = x.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)  # [.., 1]
    return (x32 * rstd * scale.astype(jnp.float32)).astype(dtype), (x, rstd, scale)


def _rms_backward(eps, dtype, res, g):
    del eps, dtype
    x, rstd, scale = res
    g32 = g.astype(jnp.float32)
    xhat = x.astype(jnp.float32) * rstd
    gx = g32 * scale.astype(jnp.float32)
    dx = rstd * (gx - xhat * jnp.mean(gx * xhat, axis=-1, keepdims=True))
    return dx.astype(x.dtype), _leading_sum(g32 * xhat, scale)


rms_norm.defvjp(lambda x, scale, eps, dtype: _rms_forward(x, scale, eps, dtype), _rms_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def layer_norm(x, scale, bias, eps: float, dtype):
    """(x - mean) / std * scale + bias over the last axis, returned in `dtype`."""
    return _ln_forward(x, scale, bias, eps, dtype)[0]


def _ln_forward(x, scale, bias, eps, dtype):
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)  # [.., 1]
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True) + eps)  # [.., 1]
    y = (x32 - mean) * rstd * scale.astype(jnp.float32) + bias.astype(jnp.float32)
    return y.astype(dtype), (x, mean, rstd, scale, bias)


def _ln_backward(eps, dtype, res, g):
    del eps, dtype
    x, mean, rstd, scale, bias = res
    g32 = g.astype(jnp.float32)
    xhat = (x.astype(jnp.float32) - mean) * rstd
    gx = g32 * scale.astype(jnp.float32)
    dx = rstd * (gx - jnp.mean(gx, axis=-1, keepdims=True) - xhat * jnp.mean(gx * xhat, axis=-1, keepdims=True))
    return dx.astype(x.dtype), _leading_sum(g32 * xhat, scale), _leading_sum(g32, bias)


layer_norm.defvjp(lambda x, scale, bias, eps, dtype: _ln_forward(x, scale, bias, eps, dtype), _ln_backward)
