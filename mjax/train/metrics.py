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
    experts (Megatron's MoE term; the router GEMM is not counted, as in Megatron). Multi-latent attention counts its
    low-rank projections (Megatron's MLA term, norms included as one multiply per latent dim). Each multi-token
    prediction depth counts as one more layer of the model's last layer's kind, plus its eh_proj and norms and one
    more output-layer GEMM.
    """
    h, f, mtp = m.hidden_size, m.ffn_hidden_size, m.mtp_depth
    layers = m.num_layers + mtp
    expansion = 3 if m.activation == "swiglu" else 2
    moe_layers = m.moe_layer_pattern().count(True) + (mtp if mtp and m.mtp_is_moe() else 0)
    routed = (m.moe_ffn_hidden_size or f) * (m.moe_router_topk if moe_layers else 0)
    shared = m.moe_shared_expert_intermediate_size or 0
    mlp = 6 * h * expansion * (f * (layers - moe_layers) + (routed + shared) * moe_layers)
    attn_linear, attn_core = _attention_terms(m)
    mtp_proj = 6 * mtp * (3 * h + 2 * h * h)  # enorm, hnorm, final norm; eh_proj [2h, h]
    logits = 6 * h * m.padded_vocab_size() * (mtp + 1)
    return mlp + attn_linear * layers + mtp_proj + logits, attn_core * layers


def _attention_terms(m):
    """One layer's (attention linear FLOPs per token, core FLOPs per unit of sum(seq^2))."""
    n, h = m.num_attention_heads, m.hidden_size
    if not m.multi_latent_attention:
        q, kv = m.head_dim * n, m.head_dim * m.num_kv_heads
        # core per token pair: (/2 causal) x (2 for QK^T and AV) x 3 GEMM passes x 2 FLOPs
        return 6 * (h * (q + 2 * kv) + q * h), 6 * q
    qk, pe, v, c = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim, m.kv_lora_rank
    q_term = h * n * (qk + pe) if m.q_lora_rank is None else m.q_lora_rank * (h + n * (qk + pe) + 1)
    linear = 6 * (q_term + c * (h + n * (qk + v) + 1) + h * pe + n * v * h)
    return linear, 3 * n * (qk + pe + v)  # 6 x (QK^T over qk + pe dims + AV over v dims) / 2 causal


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
