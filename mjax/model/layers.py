"""Basic layers: Linear over arbitrary in/out axes, Embed, RMSNorm, LayerNorm. Params fp32, compute in `dtype`.

Every linear layer's matmul follows the precision policy: `quant=None` is the plain compute-dtype matmul, a
`mjax.kernels.quant.QuantPolicy` routes it through the FP8/FP4 dispatch (`quantized_matmul`)."""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from mjax.kernels.quant import initial_meta, quantized_matmul
from mjax.model.sharding import param


def _normal(rngs, shape, std, dtype):
    return std * jax.random.normal(rngs.params(), shape, dtype)


class Fp8Meta(nnx.Variable):
    """FP8 scales [3] of a linear layer's (input, weight, output grad). Not a parameter: its gradient is the amax
    observed, which the train step folds into the amax history (mjax/train/fp8_state.py)."""


class Linear(nnx.Module):
    """y = x @ W (+ b), contracting the last len(in_shape) axes of x. W has shape in_shape + out_shape."""

    def __init__(self, in_shape, out_shape, *, in_axes, out_axes, std, use_bias=False, dtype=jnp.float32,
                 param_dtype=jnp.float32, quant=None, rngs: nnx.Rngs):
        in_shape, out_shape = tuple(in_shape), tuple(out_shape)
        self.n_in = len(in_shape)
        self.dtype = dtype
        self.quant = quant
        self.kernel = param(_normal(rngs, in_shape + out_shape, std, param_dtype), tuple(in_axes) + tuple(out_axes))
        self.bias = param(jnp.zeros(out_shape, param_dtype), tuple(out_axes)) if use_bias else None
        self.fp8_meta = Fp8Meta(initial_meta(), logical_axes=(None,)) if quant and quant.has_fp8_meta else None

    def __call__(self, x):
        if self.quant is None:
            y = jnp.tensordot(x.astype(self.dtype), self.kernel[...].astype(self.dtype), axes=self.n_in)
        else:
            kernel = self.kernel[...]
            in_shape, out_shape = kernel.shape[:self.n_in], kernel.shape[self.n_in:]
            k = math.prod(in_shape)
            meta = None if self.fp8_meta is None else self.fp8_meta[...]
            y = quantized_matmul(self.quant, x.astype(self.dtype).reshape(-1, k), kernel.reshape(k, -1), meta)
            y = y.reshape(x.shape[:x.ndim - self.n_in] + out_shape)  # [M, N] -> [..., out...]
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


def without_quant(module):
    """Turns every Linear in `module` back to the compute-dtype matmul (layers kept in bf16); returns module."""
    for _, node in nnx.iter_graph(module):
        if isinstance(node, Linear):
            node.quant = None
    return module


class Embed(nnx.Module):
    def __init__(self, num, features, *, std, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.dtype = dtype
        self.embedding = param(_normal(rngs, (num, features), std, param_dtype), ("vocab", "embed"))

    def __call__(self, ids):  # [B, T] -> [B, T, D]
        return jnp.take(self.embedding[...], ids, axis=0).astype(self.dtype)

    def attend(self, x):  # tied output layer: [B, T, D] -> [B, T, V]
        return jnp.einsum("btd,vd->btv", x.astype(self.dtype), self.embedding[...].astype(self.dtype))


class RMSNorm(nnx.Module):
    def __init__(self, features, *, eps, dtype=jnp.float32, param_dtype=jnp.float32, rngs=None):
        self.eps, self.dtype = eps, dtype
        self.scale = param(jnp.ones((features,), param_dtype), ("norm",))

    def __call__(self, x):  # statistics in fp32
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(self.dtype)


class LayerNorm(nnx.Module):
    def __init__(self, features, *, eps, dtype=jnp.float32, param_dtype=jnp.float32, rngs=None):
        self.eps, self.dtype = eps, dtype
        self.scale = param(jnp.ones((features,), param_dtype), ("norm",))
        self.bias = param(jnp.zeros((features,), param_dtype), ("norm",))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(self.dtype)


def make_norm(cfg, *, dtype, param_dtype):
    cls = RMSNorm if cfg.normalization == "rmsnorm" else LayerNorm
    return cls(cfg.hidden_size, eps=cfg.norm_epsilon, dtype=dtype, param_dtype=param_dtype)


def output_std(cfg) -> float:
    """Megatron's scaled init for layers that write into the residual stream: std / sqrt(2 * num_layers)."""
    return cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
