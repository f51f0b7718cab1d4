"""Model FLOPs per step (Megatron-LM's current formula), MFU, and device memory."""

import resource
import sys

import jax

# Dense bf16 datasheet peaks (TFLOP/s) used as the MFU denominator, as Megatron's published MFU figures do.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "GH200": 989.0, "A100": 312.0, "B200": 2250.0}


def flops_per_token_terms(m):
    """(linear FLOPs per token, attention-core FLOPs per unit of sum(seq^2)) for fwd + bwd (factor 6 = 3 GEMMs x 2).

    Megatron-LM `num_floating_point_operations` (core_v0.12+): causal attention counted as half of the square.
    Sliding windows are not discounted, as in Megatron. MoE layers count their top-k routed experts and the shared
    experts (Megatron's MoE term; the router GEMM is not counted, as in Megatron).
    """
    h, f, layers = m.hidden_size, m.ffn_hidden_size, m.num_layers
    expansion = 3 if m.activation == "swiglu" else 2
    q = m.head_dim * m.num_attention_heads
    kv = m.head_dim * m.num_kv_heads
    moe_layers = m.moe_layer_pattern().count(True)
    routed = (m.moe_ffn_hidden_size or f) * (m.moe_router_topk if moe_layers else 0)
    shared = m.moe_shared_expert_intermediate_size or 0
    mlp = 6 * h * expansion * (f * (layers - moe_layers) + (routed + shared) * moe_layers)
    attn_linear = 6 * (h * (q + 2 * kv) + q * h) * layers
    logits = 6 * h * m.padded_vocab_size()
    attn_core = 6 * q * layers  # per token pair: (/2 causal) x (2 for QK^T and AV) x 3 GEMM passes x 2 FLOPs
    return mlp + attn_linear + logits, attn_core


def flops_per_step(m, global_batch_size: int, seq_length: int) -> float:
    linear, core = flops_per_token_terms(m)
    tokens = global_batch_size * seq_length
    return float(tokens * linear + global_batch_size * seq_length**2 * core)


def peak_tflops(device=None, override: float | None = None) -> float | None:
    if override:
        return override
    kind = (device or jax.devices()[0]).device_kind
    for name, peak in PEAK_TFLOPS.items():
        if name in kind:
            return peak
    return None


def peak_memory_bytes(device=None) -> int:
    """Peak bytes in use on the device; on CPU (no allocator stats) the process's peak resident memory."""
    stats = (device or jax.local_devices()[0]).memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"])
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)
