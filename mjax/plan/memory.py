"""Memory per device of one layout: the train state and fp32 gradients exactly (mjax.plan.states), the activations
the model keeps for its backward (mjax.plan.activations), as a pipeline schedule holds them
(mjax.plan.pipeline_memory), the gradient buffers besides the step's sum, and the transients: the working set of
the layer being back-propagated (with the reference grouped GEMM's dense expansion in MoE layers) and the output
layer's logits and their gradient."""

import dataclasses

import jax

from mjax.plan import pipeline_memory
from mjax.plan.activations import model_activation_bytes, nested_regions, residuals, routed_sequence_share
from mjax.plan.pipeline_memory import Device
from mjax.plan.states import state_bytes

BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclasses.dataclass(frozen=True)
class Memory:
    params: int
    grads: int
    optimizer: int
    other: int  # FP8 state, step, rng, loss scale
    activations: int  # kept for the backward, at the schedule's peak
    transient: int  # short-lived: a recomputed layer, the fp32 logits and their gradient
    partial_grads: int  # fp32 gradients besides the step's sum: a micro-batch's, a pipeline chunk's, per-device sums

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.optimizer + self.other + self.activations + self.transient
                + self.partial_grads)


def device_share(cfg, batching, states: dict) -> Device:
    """One device's residuals and layer weights, as mjax.plan.pipeline_memory takes them."""
    p, m = cfg.parallel, cfg.model
    r = residuals(cfg)
    tokens = batching.micro_batch_size * cfg.train.seq_length // p.cp
    grads = lambda params: params * 4 // BYTES[cfg.precision.params_dtype]  # noqa: E731
    c = BYTES[cfg.precision.compute_dtype]
    # the output layer's weight cast to the compute dtype (a residual of its matmul; none when no cast is needed)
    head = m.hidden_size * m.padded_vocab_size() // p.tp * c if c != BYTES[cfg.precision.params_dtype] else 0
    return Device(per_micro=batching.micro_batch_size * r.per_sequence, fixed=r.fixed, head_fixed=head,
                  layer_weights=r.layer_weights,
                  layer_params=states["layer_params"], layer_grads=grads(states["layer_params"]),
                  rest_grads=grads(states["params"] - states["layer_params"]),
                  stage_input=tokens * m.hidden_size * c)


def activation_bytes(cfg, batching, states: dict, on_gpu: bool = False) -> int:
    """Activations kept at the schedule's peak on the busiest device (pipeline stage 0)."""
    if cfg.parallel.pp == 1:
        return model_activation_bytes(cfg, batching.micro_batch_size)[0]  # one micro-batch at a time
    return pipeline_memory.activation_bytes(cfg, batching.micro_batches, device_share(cfg, batching, states), on_gpu)


def partial_grad_bytes(cfg, batching, states: dict, on_gpu: bool = False) -> int:
    """fp32 gradient buffers besides the step's sum. Accumulating micro-batches without a pipeline, XLA:CPU holds the
    micro-batch's whole gradient beside the sum while the layer scan's stacked residuals are still live (measured:
    M = 2 costs one more gradient than M = 1); on a GPU XLA unrolls the layer scan, frees each layer's residuals as
    its backward runs, and the step's peak is at the end of a forward, where only the sum is live (measured on an
    H200: llama3.2-1b, M = 2 over M = 1 by the sum alone). A pipeline's are its own (pipeline_memory.py)."""
    if cfg.parallel.pp > 1:
        return pipeline_memory.partial_grad_bytes(cfg, batching.micro_batches, device_share(cfg, batching, states),
                                                  on_gpu)
    return states["grads"] if batching.micro_batches > 1 and not on_gpu else 0


def transient_bytes(cfg, batching, on_gpu: bool = False) -> int:
    """The largest buffers live only within one layer or the loss: the working set of the layer being
    back-propagated (its activations as no recomputation keeps them: recomputed, or the gradients of those kept)
    and the logits and their gradient."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    b, seq = batching.micro_batch_size, t.seq_length
    vocab = m.padded_vocab_size() // p.tp
    positions = seq // p.cp
    if cfg.execution.cross_entropy_impl == "fused":
        positions = min(positions, cfg.execution.cross_entropy_chunk)
    c = BYTES[cfg.precision.compute_dtype]
    # the logits in the compute dtype, their fp32 copy and fp32 gradient; a GPU fuses the fp32 copy into the
    # log-sum-exp and the gradient's cast into its producer (each read or written once in the compute dtype)
    logits = b * positions * vocab * (2 * c if on_gpu else 4 + 4 + c)
    everything = cfg.replace(execution=dict(remat_policy="none"))
    total, fixed = model_activation_bytes(everything, b, checkpointed=False)
    layer = (total - fixed) // m.num_layers
    experts = expert_expansion_bytes(cfg, batching, on_gpu)
    # recomputed (by the policy, or as a pipeline stage's dispatch region), the layer's activations are live while
    # its experts' backward runs; kept, the layer's gradients and its experts' expanded backward are the two
    # candidates for the working set
    recomputed = cfg.execution.remat_policy != "none" or nested_regions(cfg)[0]
    return logits + (layer + experts if recomputed else max(layer, experts))


def expert_expansion_bytes(cfg, batching, on_gpu: bool = False) -> int:
    """The reference grouped GEMM (lax.ragged_dot, --moe_grouped_gemm_impl=xla: the default off a GPU) is lowered
    as a dense product over the device's G experts: each ragged operand is copied G times with the other groups'
    rows masked (jax's _ragged_dot_general_impl). The backward of x [R, K] . w [G, K, N] expands its output
    gradient for the input gradient and both operands for the weight gradient, G R (K + 2 N) elements; the
    experts' backward holds those of all its GEMMs (measured, expert_rows' vjp alone on XLA:CPU: within 10% over
    G 1-8, R 2k-8k, D and F 256-1024), in float32 on XLA:CPU (its dots run bf16 in f32). Zero for the Pallas
    kernels and for dense models."""
    m, p = cfg.model, cfg.parallel
    impl = cfg.execution.moe_grouped_gemm_impl
    here = None if on_gpu else jax.default_backend()  # the backend the step compiles for; None: a GPU
    reference = impl == "xla" or (impl == "auto" and here not in (None, "gpu"))
    if not m.num_experts or not reference:
        return 0
    folded = p.expert_tensor_parallel_size not in (None, p.tp)  # experts over expert x tensor
    groups = m.num_experts // (p.ep * (p.tp if folded else 1))
    tokens = batching.micro_batch_size * cfg.train.seq_length // routed_sequence_share(cfg)  # a device routes these
    rows = p.ep * m.moe_router_topk * tokens  # the receive buffer
    d, f = m.hidden_size, (m.moe_ffn_hidden_size or m.ffn_hidden_size) // (1 if folded else p.tp)
    gated = m.activation == "swiglu"
    gemms = [(d, f), (d, f), (f, d)] if gated else [(d, f), (f, d)]  # (K, N): gate, up, down
    itemsize = 4 if here == "cpu" else BYTES[cfg.precision.compute_dtype]
    kept = rows * (d + (3 if gated else 2) * f)  # the experts' own residuals (rows, gate, up, hidden): counted
    return max(groups * rows * sum(k + 2 * n for k, n in gemms) - kept, 0) * itemsize


def memory(cfg, batching, num_devices: int, on_gpu: bool = False) -> Memory:
    """`on_gpu`: the attention and the loss as a GPU runs them (--attention_impl=auto picks a flash kernel there,
    which keeps no scores; the loss's fp32 temporaries fuse), whatever this process's backend; otherwise as this
    backend runs them."""
    if on_gpu and cfg.execution.attention_impl == "auto":
        cfg = cfg.replace(execution=dict(attention_impl="pallas"))
    s = state_bytes(cfg, num_devices)
    return Memory(s["params"], s["grads"], s["optimizer"], s["other"], activation_bytes(cfg, batching, s, on_gpu),
                  transient_bytes(cfg, batching, on_gpu), partial_grad_bytes(cfg, batching, s, on_gpu))
