"""Qwen1.5-MoE-A2.7B (Qwen2-MoE): 24 layers, 60 experts (FFN 1408) top-4 without renormalisation, a gated shared
expert of FFN 5632, MHA 16 heads, QKV biases."""
from mjax.config import Config


def config() -> Config:
    return Config().replace(
        model=dict(name="qwen2-moe-a2.7b", num_layers=24, hidden_size=2048, num_attention_heads=16,
                   ffn_hidden_size=5632, vocab_size=151936, max_position_embeddings=8192, norm_epsilon=1e-6,
                   rotary_base=1000000.0, add_qkv_bias=True, untie_embeddings_and_output_weights=True,
                   num_experts=60, moe_router_topk=4, moe_router_pre_softmax=True, moe_ffn_hidden_size=1408,
                   moe_shared_expert_intermediate_size=5632, moe_shared_expert_gate=True, moe_aux_loss_coeff=0.001),
        train=dict(train_iters=100000, seq_length=4096, global_batch_size=512, micro_batch_size=1),
        optimizer=dict(lr=3e-4, min_lr=3e-5, lr_warmup_iters=2000, lr_decay_iters=100000),
        data=dict(tokenizer_type="huggingface"),
    )
