"""Basic layers: Linear over arbitrary in/out axes, Embed, RMSNorm, LayerNorm. Params fp32, compute in `dtype`.

Every linear layer's matmul follows the precision policy: `quant=None` is the plain compute-dtype matmul, a
`mjax.kernels.quant.QuantPolicy` routes it through the FP8/FP4 dispatch (`quantized_matmul`)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from mjax.kernels.quant import initial_meta, quantized_matmul
from mjax.model.norms import layer_norm, rms_norm
from mjax.sharding import param


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
        meta = None if self.fp8_meta is None else self.fp8_meta[...]
        y = _matmul(x, self.kernel[...], self.n_in, self.dtype, self.quant, meta)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


def _matmul(x, kernel, n_in, dtype, quant, meta, grad_words=False):
    """x [..., in...] @ kernel [in..., out...] -> [..., out...] in `dtype`, through the precision policy."""
    if quant is None:
        return jnp.tensordot(x.astype(dtype), kernel.astype(dtype), axes=n_in)
    in_shape, out_shape = kernel.shape[:n_in], kernel.shape[n_in:]
    k = math.prod(in_shape)
    y = quantized_matmul(quant, x.astype(dtype).reshape(-1, k), kernel.reshape(k, -1), meta, grad_words)
    return y.reshape(x.shape[:x.ndim - n_in] + out_shape)  # [M, N] -> [..., out...]


def fused_product(x, parts, out_shapes, axis: int, name: str | None = None, grad_words: bool = False):
    """One GEMM for several Linears that read the same x (Megatron's fused QKV and gate/up projections).

    Each part's kernel, viewed as in_shape + out_shapes[i], is concatenated with the others along out axis `axis`;
    returns the product [..., fused out...]. The math is that of calling each part; what changes is one larger GEMM,
    one quantization of x and one dx (no sum of partial input gradients). The parameters stay separate, so
    checkpoints, conversion and sharding rules see no difference: the concatenation fuses into the per-step cast
    of the weights. `name` (a remat name) labels the product. `grad_words`: the consumer's backward writes the
    product's gradient as 32-bit words of 16-bit pairs (a layout hint for FP8's amax, `fp8.amax`).
    """
    first = parts[0]
    if any((p.n_in, p.dtype, p.quant, p.bias is None) != (first.n_in, first.dtype, first.quant, first.bias is None)
           for p in parts):
        raise ValueError("fused_product: parts differ in input rank, dtype, precision policy or bias")
    n_in = first.n_in
    kernel = jnp.concatenate([p.kernel[...].reshape(p.kernel.shape[:n_in] + s) for p, s in zip(parts, out_shapes)],
                             axis=n_in + axis)  # [in..., fused out...]
    meta = None if first.fp8_meta is None else shared_meta(jnp.stack([p.fp8_meta[...] for p in parts]))
    y = _matmul(x, kernel, n_in, first.dtype, first.quant, meta, grad_words)  # [..., fused out...]
    if first.bias is not None:
        y = y + jnp.concatenate([p.bias[...].reshape(s) for p, s in zip(parts, out_shapes)], axis).astype(y.dtype)
    return y if name is None else checkpoint_name(y, name)


def fused_linear(x, parts, out_shapes, axis: int):
    """`fused_product` split back into each part's output, in the part's own out shape."""
    y = fused_product(x, parts, out_shapes, axis)
    n_in = parts[0].n_in
    lead = x.ndim - n_in
    bounds = np.cumsum([s[axis] for s in out_shapes])[:-1]
    return [t.reshape(x.shape[:lead] + p.kernel.shape[n_in:])  # [..., part out...]
            for t, p in zip(jnp.split(y, bounds, axis=lead + axis), parts)]


@jax.custom_vjp
def shared_meta(metas):
    """FP8 scales [3] of a fused GEMM from its parts' [n, 3]: the smallest (none of the parts overflows). Each part
    observes the fused GEMM's amaxes (its meta's gradient), so delayed scaling keeps the parts' histories equal."""
    return jnp.min(metas, axis=0)


shared_meta.defvjp(lambda metas: (jnp.min(metas, axis=0), metas.shape[0]),
                   lambda n, observed: (jnp.broadcast_to(observed, (n,) + observed.shape),))


def without_quant(module):
    """Turns every quantized layer in `module` (each Linear, and any other module holding a precision policy as
    `quant`: the MoE experts) back to the compute-dtype matmul (layers kept in bf16); returns module."""
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Module) and getattr(node, "quant", None) is not None:
            node.quant = None
    return module


class Embed(nnx.Module):
    """Token embedding [V, D]; `attend` is the tied output layer, quantized by `quant` (--quantize_output_layer;
    the lookup itself never is)."""

    def __init__(self, num, features, *, std, dtype=jnp.float32, param_dtype=jnp.float32, quant=None,
                 rngs: nnx.Rngs):
        self.dtype, self.quant = dtype, quant
        self.embedding = param(_normal(rngs, (num, features), std, param_dtype), ("vocab", "embed"))
        self.fp8_meta = Fp8Meta(initial_meta(), logical_axes=(None,)) if quant and quant.has_fp8_meta else None

    def __call__(self, ids):  # [B, T] -> [B, T, D]
        return jnp.take(self.embedding[...], ids, axis=0).astype(self.dtype)

    def attend(self, x):  # tied output layer: [B, T, D] -> [B, T, V]
        meta = None if self.fp8_meta is None else self.fp8_meta[...]
        return _matmul(x, self.embedding[...].T, 1, self.dtype, self.quant, meta)  # [D, V] view of the table


class RMSNorm(nnx.Module):
    def __init__(self, features, *, eps, dtype=jnp.float32, param_dtype=jnp.float32, rngs=None):
        self.eps, self.dtype = eps, dtype
        self.scale = param(jnp.ones((features,), param_dtype), ("norm",))

    def __call__(self, x):  # statistics in fp32
        return rms_norm(x, self.scale[...], self.eps, self.dtype)


class LayerNorm(nnx.Module):
    def __init__(self, features, *, eps, dtype=jnp.float32, param_dtype=jnp.float32, rngs=None):
        self.eps, self.dtype = eps, dtype
        self.scale = param(jnp.ones((features,), param_dtype), ("norm",))
        self.bias = param(jnp.zeros((features,), param_dtype), ("norm",))

    def __call__(self, x):  # statistics in fp32
        return layer_norm(x, self.scale[...], self.bias[...], self.eps, self.dtype)


def make_norm(cfg, *, dtype, param_dtype, features: int | None = None):
    """--normalization over the last `features` (default --hidden_size) features."""
    cls = RMSNorm if cfg.normalization == "rmsnorm" else LayerNorm
    return cls(features or cfg.hidden_size, eps=cfg.norm_epsilon, dtype=dtype, param_dtype=param_dtype)


def output_std(cfg) -> float:
    """Megatron's scaled init for layers that write into the residual stream: std / sqrt(2 * num_layers)."""
    return cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
