"""SwiGLU of (gate, up) pairs, silu(gate) * up: the reference (autodiff of the plain expression) for wide dtypes and
float32, and for 16-bit pairs a custom backward that treats each pair as one 32-bit word (one elementwise pass)."""

import jax
import jax.numpy as jnp
from jax import lax


def swiglu_pairs(y):
    """silu(gate) * up of y [..., F, 2] holding (gate, up) pairs -> [..., F]."""
    if y.dtype.itemsize == 2:
        return _swiglu_packed(y)
    return jax.nn.silu(y[..., 0]) * y[..., 1]


@jax.custom_vjp
def _swiglu_packed(y):
    """16-bit pairs: the backward views each (gate, up) pair as one 32-bit word, so computing both gradients is
    one elementwise pass that reads each pair once and writes it once. Autodiff splits y and concatenates the two
    gradients, which XLA emits one operand at a time (inputs read twice, every other element written) after a
    separate pass for the sigmoid: far slower on a GPU (docs/performance.md)."""
    return jax.nn.silu(y[..., 0]) * y[..., 1]


def _unpack(words, dtype, shift):  # uint32 [...] -> f32 [...]: the 16-bit value at bit `shift`
    return lax.bitcast_convert_type(((words >> shift) & 0xFFFF).astype(jnp.uint16), dtype).astype(jnp.float32)


def _pack(x, dtype, shift):  # f32 [...] -> uint32 [...] holding x as `dtype` at bit `shift`
    return lax.bitcast_convert_type(x.astype(dtype), jnp.uint16).astype(jnp.uint32) << shift


def _swiglu_packed_bwd(y, dh):
    words = lax.bitcast_convert_type(y, jnp.uint32)  # [..., F, 2] -> [..., F]: gate in the low half (little-endian)
    g_shift, u_shift = 0, 16
    g, u, dh = _unpack(words, y.dtype, g_shift), _unpack(words, y.dtype, u_shift), dh.astype(jnp.float32)
    s = jax.nn.sigmoid(g)
    d_gate = dh * u * s * (1 + g * (1 - s))  # d silu(g) / dg = s (1 + g (1 - s))
    d_up = dh * g * s
    out = _pack(d_gate, y.dtype, g_shift) | _pack(d_up, y.dtype, u_shift)  # [..., F]
    return (lax.bitcast_convert_type(out, y.dtype),)  # [..., F, 2]


_swiglu_packed.defvjp(lambda y: (_swiglu_packed(y), y), _swiglu_packed_bwd)


@jax.custom_vjp
def weighted_swiglu(gate, up, weights):
    """silu(gate) * up * weights[:, None] for rows [R, F] and per-row weights [R], computed in float32 (or the
    weights' wider dtype) and returned in gate's dtype. The backward recomputes from the 16-bit gate and up: autodiff
    would keep four float32 [R, F] intermediates of the expression for it."""
    return _weighted_swiglu(gate, up, weights)[0]


def _weighted_swiglu(gate, up, weights):
    compute = jnp.promote_types(weights.dtype, jnp.float32)
    h = jax.nn.silu(gate.astype(compute)) * up.astype(compute)
    return (h * weights[:, None].astype(compute)).astype(gate.dtype), (gate, up, weights)


def _weighted_swiglu_bwd(res, dy):
    gate, up, weights = res
    compute = jnp.promote_types(weights.dtype, jnp.float32)
    g, u, w, dy = gate.astype(compute), up.astype(compute), weights.astype(compute), dy.astype(compute)
    s = jax.nn.sigmoid(g)
    silu = g * s
    dh = dy * w[:, None]
    d_gate = dh * u * s * (1 + g * (1 - s))
    return (d_gate.astype(gate.dtype), (dh * silu).astype(up.dtype),
            jnp.sum(dy * silu * u, axis=-1).astype(weights.dtype))


weighted_swiglu.defvjp(_weighted_swiglu, _weighted_swiglu_bwd)
