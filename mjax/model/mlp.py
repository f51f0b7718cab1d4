"""Feed-forward blocks: SwiGLU (Llama family) and GELU (GPT-2)."""

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from mjax.model.layers import Linear, fused_linear, output_std
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
        if self.gated:  # one GEMM for gate and up (Megatron's linear_fc1), output [B, T, 2, F]
            f = self.up_proj.kernel.shape[-1]
            gate, up = fused_linear(x, (self.gate_proj, self.up_proj), ((1, f), (1, f)), axis=0, name="mlp_up")
            h = jax.nn.silu(gate) * up  # [B, T, F]
        else:
            h = jax.nn.gelu(checkpoint_name(self.up_proj(x), "mlp_up"), approximate=True)
        h = checkpoint_name(constrain(h, ("batch", "seq", "mlp")), "mlp_hidden")
        return checkpoint_name(self.down_proj(h), "mlp_out")
