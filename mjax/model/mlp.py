"""Feed-forward blocks: SwiGLU (Llama family) and GELU (GPT-2)."""

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from mjax.kernels.swiglu import swiglu_pairs
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
        # Sequence parallelism's all-gather (over `tensor` only) made explicit: left to itself, GSPMD gathered the
        # whole sequence over `context` in the backward here when fsdp, tp + SP and cp meet.
        x = constrain(x, ("batch", "seq", "act_embed"))
        if self.gated:  # one GEMM for gate and up (Megatron's linear_fc1), their columns interleaved
            f = self.up_proj.kernel.shape[-1]
            pairs = fused_product(x, (self.gate_proj, self.up_proj), ((f, 1), (f, 1)), axis=1, name="mlp_up",
                                  grad_words=True)  # swiglu_pairs' backward writes (gate, up) gradient pairs as words
            h = swiglu_pairs(pairs)  # [B, T, F, 2] -> [B, T, F]
        else:
            h = jax.nn.gelu(checkpoint_name(self.up_proj(x), "mlp_up"), approximate=True)
        h = checkpoint_name(constrain(h, ("batch", "seq", "mlp")), "mlp_hidden")
        return checkpoint_name(self.down_proj(h), "mlp_out")
