"""Feed-forward blocks: SwiGLU (Llama family) and GELU (GPT-2)."""

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from mjax.model.layers import Linear, output_std
from mjax.model.sharding import constrain


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
        up = checkpoint_name(self.up_proj(x), "mlp_up")  # [B, T, F]
        if self.gated:
            h = jax.nn.silu(checkpoint_name(self.gate_proj(x), "mlp_gate")) * up
        else:
            h = jax.nn.gelu(up, approximate=True)
        h = checkpoint_name(constrain(h, ("batch", "seq", "mlp")), "mlp_hidden")
        return checkpoint_name(self.down_proj(h), "mlp_out")
