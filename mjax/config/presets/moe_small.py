"""The one-GPU MoE benchmark: Qwen3-30B-A3B's layer geometry (hidden 2048, 128 experts top-8, expert FFN 768, GQA
32/4, head dim 128) with the 8 layers whose training fits one H200 at sequence 4096: 5.6B parameters, fp32 master
weights, gradients and Adam moments (~16 bytes a parameter), one micro-batch of 8 sequences without recomputation
(docs/moe.md has XLA's memory estimate; 10 layers do not fit)."""
from mjax.config import load_config


def config():
    return load_config("qwen3-30b-a3b").replace(
        model=dict(name="moe-small", num_layers=8),
        execution=dict(cross_entropy_impl="fused", scan_layers=False),
        train=dict(train_iters=1000, seq_length=4096, global_batch_size=8, micro_batch_size=8),
    )
