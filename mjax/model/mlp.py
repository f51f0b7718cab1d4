"""Feed-forward blocks: SwiGLU (Llama family) and GELU (GPT-2)."""

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from mjax.model.layers import Linear, fused_product, output_std
from mjax.sharding import constrain


class MLP(nnx.Module):
    def __init__(self, cfg, *, dtype, param_dtype, quant=None, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.ffn_hidden_size
        self.gated = cfg.activation == "swiglu"
        common = dict(use_bias=cfg.add_bias_linear, dtype=dtype, param_dtype=param_dtype, quant=quant, rngs=rngs)
        up = dict(in_axes=("embed",), out_axes=("mlp",), std=cfg.init_method_std, **common)
        if self.gated:
            self.gate_proj = Linear((d,), (f,), **up)
        self.up_proj = Linear((d,), (f,), **up)
        self.down_proj = Linear((f,), (d,), in_axes=("mlp",), out_axes=("embed",), std=output_std(cfg), **common)

    def __call__(self, x):  # [B, T, D] -> [B, T, D]
        if self.gated:  # one GEMM for gate and up (Megatron's linear_fc1), their columns interleaved
            f = self.up_proj.kernel.shape[-1]
            pairs = fused_product(x, (self.gate_proj, self.up_proj), ((f, 1), (f, 1)), axis=1, name="mlp_up",
                                  grad_words=True)  # swiglu_pairs' backward writes (gate, up) gradient pairs as words
            h = swiglu_pairs(pairs)  # [B, T, F, 2] -> [B, T, F]
        else:
            h = jax.nn.gelu(checkpoint_name(self.up_proj(x), "mlp_up"), approximate=True)
        h = checkpoint_name(constrain(h, ("batch", "seq", "mlp")), "mlp_hidden")
        return checkpoint_name(self.down_proj(h), "mlp_out")


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
    separate pass for the sigmoid: twice the time on an H200."""
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
