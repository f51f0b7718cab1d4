"""Mixtral 8x7B: Mistral-7B attention (no sliding window, RoPE 1e6) with 8 experts, top-2 routing."""
from mjax.config import load_config


def config():
    return load_config("mistral-7b").replace(
        model=dict(name="mixtral-8x7b", window_size=None, rotary_base=1000000.0, num_experts=8,
                   moe_router_topk=2, moe_ffn_hidden_size=14336, moe_aux_loss_coeff=0.02),
    )
