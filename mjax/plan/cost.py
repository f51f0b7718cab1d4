"""Step time of one layout: Megatron's model FLOPs (mjax/train/metrics.py) plus recomputation over the GEMM rate,
plus the device-memory traffic of the weights and gradients (once per micro-batch, and the optimizer's once per
step), stretched by the pipeline bubble, plus the communication the schedule cannot hide: bytes per collective per
mesh axis per step, priced by the link the axis crosses (NVLink within a node, the network across)."""

import dataclasses

from mjax.config.validate import pipeline_schedule
from mjax.parallel.mesh import AXES, mesh_shape
from mjax.plan.memory import BYTES
from mjax.train.metrics import flops_per_step


@dataclasses.dataclass(frozen=True)
class StepTime:
    compute_s: float  # GEMMs and recomputation, on one device
    memory_s: float  # weight and gradient traffic through device memory
    bubble: float  # idle fraction of a pipeline step
    comm_s: dict  # mesh axis -> exposed seconds
    model_flops: float  # per step, Megatron's formula (the MFU numerator)

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.memory_s) / (1 - self.bubble) + sum(self.comm_s.values())


def crosses_node(cfg, machine, axis: str) -> bool:
    """Whether a mesh axis spans devices of more than one node (the mesh is row-major, tensor innermost)."""
    shape = mesh_shape(cfg, machine.num_gpus)
    stride = 1
    for name in reversed(AXES):
        if name == axis:
            return shape[name] > 1 and stride * shape[name] > machine.gpus_per_node
        stride *= shape[name]
    raise ValueError(axis)


def bubble_fraction(cfg, batching) -> float:
    p, micro = cfg.parallel, batching.micro_batches
    if p.pp == 1:
        return 0.0
    chunks = p.vpp if pipeline_schedule(p) in ("interleaved_1f1b", "interleaved") else 1
    return (p.pp - 1) / (chunks * micro + p.pp - 1)


def recompute_factor(cfg) -> float:
    """Executed FLOPs over model FLOPs: full recomputation runs each layer's forward (1/3 of fwd + bwd) once more,
    and the 1F1B schedules recompute each stage forward in its backward slot (docs/parallelism.md)."""
    factor = 1.0 + (1 / 3 if cfg.execution.remat_policy == "full" else 0.0)
    if cfg.parallel.pp > 1 and pipeline_schedule(cfg.parallel) in ("1f1b", "interleaved_1f1b"):
        factor += 1 / 3
    return factor


def memory_traffic_bytes(cfg, batching, state) -> float:
    """Bytes one device moves through its memory per step for the weights and gradients. Per micro-batch: the
    weights cast to the compute dtype (fp32 read, copy written), that copy read by the forward, the input gradient
    and a full recomputation, the fp32 weight gradient written, and added into the accumulated one when
    micro-batches accumulate (with FSDP the gathered weights and unscattered gradients are whole layers). Per step:
    the optimizer (Adam: params, gradient and both moments read, params and moments written). Small micro-batches
    pay the per-micro-batch part more often (their GEMMs are short in M)."""
    c = BYTES[cfg.precision.compute_dtype]
    shard = state["params"] / BYTES[cfg.precision.params_dtype]  # elements on this device
    full = shard * cfg.parallel.fsdp  # FSDP gathers the layers' weights, and scatters their gradients, whole
    weight_reads = 3 if cfg.execution.remat_policy == "full" else 2
    accumulate = 8 if batching.micro_batches > 1 else 0
    per_micro = shard * (BYTES[cfg.precision.params_dtype] + c + accumulate) + full * (weight_reads * c + 4)
    optimizer = (state["params"] + state["optimizer"]) * 2 + state["grads"]
    return per_micro * batching.micro_batches + optimizer


def comm_bytes(cfg, batching, state) -> dict[str, tuple[float, float]]:
    """mesh axis -> (bytes one device sends per step, fraction of it the schedule can overlap with compute)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    c = BYTES[cfg.precision.compute_dtype]
    micro = batching.micro_batches
    tokens = batching.micro_batch_size * t.seq_length // p.cp  # per device per micro-batch, before SP
    layers = m.num_layers / p.pp  # per device
    pattern = m.moe_layer_pattern()
    moe_layers = sum(pattern) / p.pp
    act = tokens * m.hidden_size * c
    out = {}
    if p.tp > 1:  # per layer: attention and MLP, forward and backward, an all-gather + reduce-scatter each
        ring = (p.tp - 1) / p.tp
        out["tensor"] = (8 * ring * act * layers * micro, 0.0)
    if p.cp > 1:
        kv = 2 * m.num_kv_heads * m.head_dim // (p.tp if m.num_kv_heads % p.tp == 0 else 1)
        if p.cp_comm_type in ("p2p", "all_gather"):  # K/V forward; K/V and fp32 dK/dV backward
            per_layer = (p.cp - 1) * tokens * kv * (2 * c + 4)
            overlap = 1.0 if p.cp_comm_type == "p2p" else 0.0  # the ring overlaps each block with attention
        else:  # a2a: Q, K, V and the output, forward and backward
            q = m.num_attention_heads * m.head_dim // p.tp
            per_layer = 2 * (p.cp - 1) / p.cp * tokens * (2 * q + kv) * c
            overlap = 0.0
        out["context"] = (per_layer * layers * micro, overlap)
    if p.ep > 1 and moe_layers:  # dispatch and combine, forward and backward
        rows = tokens * m.moe_router_topk
        out["expert"] = (4 * (p.ep - 1) / p.ep * rows * m.hidden_size * c * moe_layers * micro, 0.0)
    if p.pp > 1:  # each micro-batch's stage output forward and its gradient backward, per chunk
        chunks = p.vpp if pipeline_schedule(p) in ("interleaved_1f1b", "interleaved") else 1
        out["pipeline"] = (2 * act / (p.tp if p.sequence_parallel else 1) * micro * chunks, 1.0)
    dp = batching.shards // (p.fsdp * p.ep) * p.cp  # context-parallel ranks hold the same parameters too
    # fp32 gradients per device as sharded by tp / pp / ep / fsdp (before ZeRO-1 splits them over data)
    grads = state["params"] * 4 // BYTES[cfg.precision.params_dtype]
    if dp > 1:  # gradient all-reduce over dp x cp (reduce-scatter + all-gather with ZeRO-1): same bytes
        out["data"] = (2 * (dp - 1) / dp * grads, 1.0)  # overlappable with the last micro-batch's backward
    if p.fsdp > 1:  # params all-gathered for forward and backward, grads reduce-scattered, per micro-batch
        full = state["params"] * p.fsdp  # this device's tp / pp share, unsharded over fsdp
        ring = (p.fsdp - 1) / p.fsdp
        out["fsdp"] = ((2 * full * c / 4 + full) * ring * micro, 1.0)  # prefetched layer by layer
    return out


def step_time(cfg, batching, state, machine) -> StepTime:
    flops = flops_per_step(cfg.model, cfg.train.global_batch_size, cfg.train.seq_length)
    executed = flops * recompute_factor(cfg)
    p = cfg.parallel
    if p.pp > 1 and pipeline_schedule(p) == "1f1b":  # the output layer runs on every stage (SPMD)
        linear_logits = 6 * cfg.model.hidden_size * cfg.model.padded_vocab_size()
        executed += linear_logits * cfg.train.global_batch_size * cfg.train.seq_length * (p.pp - 1)
    compute = executed / machine.num_gpus / (machine.gemm_tflops * 1e12)
    comm = {}
    for axis, (nbytes, overlap) in comm_bytes(cfg, batching, state).items():
        gbps = machine.inter_node_gbps if crosses_node(cfg, machine, axis) else machine.intra_node_gbps
        # `overlap`: what the schedule could hide at best; machine.comm_overlap: how much of that it does
        comm[axis] = nbytes / (gbps * 1e9) * (1 - overlap * machine.comm_overlap)
    memory_s = memory_traffic_bytes(cfg, batching, state) / (machine.hbm_gbps * 1e9)
    return StepTime(compute, memory_s, bubble_fraction(cfg, batching), comm, flops)

