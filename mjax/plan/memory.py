"""Memory per device of one layout: the train state and fp32 gradients exactly (mjax.plan.states), activations
from the tensors each layer keeps for its backward under the recomputation policy, times the micro-batches a
pipeline schedule holds at once (docs/parallelism.md's table), plus the largest transient: one layer's attention
scores (XLA attention only) and the output layer's logits and their gradient."""

import dataclasses

from mjax.config.validate import pipeline_schedule
from mjax.plan.states import state_bytes

BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclasses.dataclass(frozen=True)
class Memory:
    params: int
    grads: int
    optimizer: int
    other: int  # FP8 state, step, rng, loss scale
    activations: int  # kept for the backward, at the schedule's peak
    transient: int  # the largest short-lived buffer: attention scores or the logits

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.other + self.activations + self.transient


def _kept_names(cfg) -> set[str] | None:
    """The remat names one layer keeps (None: everything)."""
    policy = cfg.execution.remat_policy
    if policy == "none":
        return None
    if policy == "full":
        return set()
    return set(cfg.execution.remat_save_names)


def layer_activation_bytes(cfg, tokens: int, moe: bool) -> int:
    """Bytes one layer keeps for its backward for `tokens` tokens of one device's micro-batch."""
    m, p = cfg.model, cfg.parallel
    c = BYTES[cfg.precision.compute_dtype]
    tp = p.tp
    sp = tp if p.sequence_parallel and tp > 1 else 1
    q, kv = m.num_attention_heads * m.head_dim, m.num_kv_heads * m.head_dim
    kv_split = tp if m.num_kv_heads % tp == 0 else 1
    heads = m.num_attention_heads // tp
    up = 2 if m.activation == "swiglu" else 1
    sizes = {  # name: elements per token (per device)
        "qkv_proj": q / tp + 2 * kv / kv_split, "attn_core": q / tp, "attn_context": 0,  # the same tensor
        "attn_out": m.hidden_size / sp, "norm": 2 * m.hidden_size / sp}
    extra = {"attn_lse": heads * 4 / c}  # fp32 log-sum-exp, kept with attn_core
    if moe:
        etp = tp if p.expert_tensor_parallel_size in (None, tp) else 1
        rows = m.moe_router_topk  # rows per token after dispatch (balanced)
        fe = m.moe_ffn_hidden_size or m.ffn_hidden_size
        sizes |= {"moe_router_logits": m.num_experts * 4 / c, "moe_dispatch": rows * m.hidden_size,
                  "moe_up": rows * up * fe / etp, "moe_hidden": rows * fe / etp, "moe_down": rows * m.hidden_size,
                  "moe_out": m.hidden_size / sp}
        if m.moe_shared_expert_intermediate_size:
            sizes |= {"mlp_up": up * m.moe_shared_expert_intermediate_size / tp,
                      "mlp_hidden": m.moe_shared_expert_intermediate_size / tp, "mlp_out": m.hidden_size / sp}
    else:
        sizes |= {"mlp_up": up * m.ffn_hidden_size / tp, "mlp_hidden": m.ffn_hidden_size / tp,
                  "mlp_out": m.hidden_size / sp}
    kept = _kept_names(cfg)
    layer_input = m.hidden_size / sp  # the scan carry each layer's backward starts from
    if kept is None:
        per_token = sum(sizes.values()) + extra["attn_lse"] + (q / tp + kv / kv_split)  # + the RoPE'd q, k
    else:
        per_token = sum(v for k, v in sizes.items() if k in kept) + (extra["attn_lse"] if "attn_core" in kept else 0)
    return int(tokens * (per_token + layer_input) * c)


def _moe_layers(cfg) -> tuple[int, int]:
    pattern = cfg.model.moe_layer_pattern()
    return len(pattern) - sum(pattern), sum(pattern)


def activation_bytes(cfg, batching) -> int:
    """Activations kept at the schedule's peak on the busiest device (pipeline stage 0)."""
    p, m = cfg.parallel, cfg.model
    tokens = batching.micro_batch_size * cfg.train.seq_length // p.cp
    dense, moe = _moe_layers(cfg)
    model = dense * layer_activation_bytes(cfg, tokens, False) + (
        moe * layer_activation_bytes(cfg, tokens, True) if moe else 0)
    stage = model / p.pp  # one stage's layers
    stage_input = tokens * m.hidden_size * BYTES[cfg.precision.compute_dtype]
    micro = batching.micro_batches
    if p.pp == 1:
        return int(model)  # accumulation runs one micro-batch at a time
    schedule = pipeline_schedule(p)
    if schedule == "1f1b":  # stage inputs stashed, the stage forward recomputed in its backward slot
        return int(min(2 * p.pp - 1, micro) * stage_input + stage)
    if schedule == "interleaved_1f1b":
        chunks = min(2 * p.pp - 1 + (p.vpp - 1) * p.pp, micro * p.vpp)
        return int(chunks * stage_input + stage / p.vpp)
    extra_inputs = micro * stage_input if schedule == "interleaved" else 0
    return int(micro * stage + extra_inputs)  # gpipe / interleaved: every micro-batch's activations


def transient_bytes(cfg, batching, attention_scores: bool) -> int:
    """The largest buffer live only within one layer or the loss: attention scores when attention is XLA's
    (`attention_scores`; flash kernels keep none) or the fp32 logits and their gradient."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    b, seq = batching.micro_batch_size, t.seq_length
    vocab = m.padded_vocab_size() // p.tp
    positions = seq // p.cp
    if cfg.execution.cross_entropy_impl == "fused":
        positions = min(positions, cfg.execution.cross_entropy_chunk)
    logits = b * positions * vocab * (4 + 4 + BYTES[cfg.precision.compute_dtype])
    scores = 0
    if attention_scores:
        heads = m.num_attention_heads // p.tp
        keys = seq if p.cp_comm_type in ("all_gather", "a2a") else seq // p.cp
        queries = seq if p.cp_comm_type == "a2a" else seq // p.cp
        if p.cp_comm_type == "a2a":
            heads = max(heads // p.cp, 1)
        scores = 2 * b * heads * queries * keys * 4  # fp32 scores and their gradient
    return max(logits, scores)


def memory(cfg, batching, num_devices: int, attention_scores: bool = False) -> Memory:
    s = state_bytes(cfg, num_devices)
    grads = s["grads"] * (2 if batching.micro_batches > 1 and cfg.parallel.pp == 1 else 1)  # + the accumulator
    return Memory(s["params"], grads, s["optimizer"], s["other"], activation_bytes(cfg, batching),
                  transient_bytes(cfg, batching, attention_scores))
