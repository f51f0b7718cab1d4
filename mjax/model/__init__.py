"""Single-device Flax NNX transformer layers with logical axis names; usable in any JAX code."""

from mjax.model.attention import Attention
from mjax.model.functional import ModelDef, build_model
from mjax.model.layers import Embed, LayerNorm, Linear, RMSNorm
from mjax.model.mlp import MLP
from mjax.model.moe import MoE
from mjax.model.rope import apply_rope, rope_frequencies
from mjax.model.transformer import Block, CausalLM

__all__ = [
    "MLP", "Attention", "Block", "CausalLM", "Embed", "LayerNorm", "Linear", "ModelDef", "MoE", "RMSNorm",
    "apply_rope", "build_model", "rope_frequencies",
]
