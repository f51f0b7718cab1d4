"""DeepSeek-MoE 16B: fine-grained experts (64 routed, top-6 without renormalisation, FFN 1408), 2 shared experts
(FFN 2 x 1408), first layer dense, MHA 16 heads."""
from mjax.config import Config


def config() -> Config:
    return Config().replace(
        model=dict(name="deepseek-moe-16b", num_layers=28, hidden_size=2048, num_attention_heads=16,
                   ffn_hidden_size=10944, vocab_size=102400, max_position_embeddings=4096, norm_epsilon=1e-6,
                   rotary_base=10000.0, untie_embeddings_and_output_weights=True, num_experts=64,
                   moe_router_topk=6, moe_ffn_hidden_size=1408, moe_shared_expert_intermediate_size=2816,
                   moe_first_dense_layers=1, moe_router_pre_softmax=True, moe_aux_loss_coeff=0.001),
        train=dict(train_iters=100000, seq_length=4096, global_batch_size=128, micro_batch_size=1),
        optimizer=dict(lr=4.2e-4, min_lr=4.2e-5, lr_warmup_iters=2000, lr_decay_iters=100000),
        data=dict(tokenizer_type="huggingface"),
    )
