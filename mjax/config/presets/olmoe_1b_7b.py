"""OLMoE-1B-7B: 16 layers, 64 experts (FFN 1024) top-8 without renormalisation, MHA 16 heads, QK RMSNorm across heads,
aux loss 0.01 and router z-loss 0.001 as trained."""
from mjax.config import Config


def config() -> Config:
    return Config().replace(
        model=dict(name="olmoe-1b-7b", num_layers=16, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=1024,
                   vocab_size=50304, max_position_embeddings=4096, norm_epsilon=1e-5, rotary_base=10000.0,
                   qk_layernorm=True, qk_layernorm_across_heads=True, untie_embeddings_and_output_weights=True,
                   num_experts=64, moe_router_topk=8, moe_router_pre_softmax=True, moe_ffn_hidden_size=1024,
                   moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001),
        train=dict(train_iters=100000, seq_length=4096, global_batch_size=512, micro_batch_size=1),
        optimizer=dict(lr=4e-4, min_lr=5e-5, lr_warmup_iters=2000, lr_decay_iters=100000),
        data=dict(tokenizer_type="huggingface"),
    )
