"""Memory per device of one layout: the train state and fp32 gradients exactly (mjax.plan.states), the activations
the model keeps for its backward (mjax.plan.activations) times the micro-batches a pipeline schedule holds at once
(docs/parallelism.md's table), plus the transients: a recomputed layer and the output layer's logits and their
gradient."""

import dataclasses

from mjax.config.validate import pipeline_schedule
from mjax.plan.activations import model_activation_bytes
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

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.other + self.activations + self.transient


def activation_bytes(cfg, batching) -> int:
    """Activations kept at the schedule's peak on the busiest device (pipeline stage 0)."""
    p, m = cfg.parallel, cfg.model
    tokens = batching.micro_batch_size * cfg.train.seq_length // p.cp
    model, fixed = model_activation_bytes(cfg, batching.micro_batch_size)
    if p.pp == 1:
        return int(model)  # accumulation runs one micro-batch at a time
    stage, fixed = (model - fixed) / p.pp, fixed / p.pp  # one stage's layers: per micro-batch, once
    stage_input = tokens * m.hidden_size * BYTES[cfg.precision.compute_dtype]
    micro = batching.micro_batches
    schedule = pipeline_schedule(p)
    if schedule == "1f1b":  # stage inputs stashed, the stage forward recomputed in its backward slot
        return int(min(2 * p.pp - 1, micro) * stage_input + stage + fixed)
    if schedule == "interleaved_1f1b":
        chunks = min(2 * p.pp - 1 + (p.vpp - 1) * p.pp, micro * p.vpp)
        return int(chunks * stage_input + (stage + fixed) / p.vpp)
    extra_inputs = micro * stage_input if schedule == "interleaved" else 0
    return int(micro * stage + fixed + extra_inputs)  # gpipe / interleaved: every micro-batch's activations


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
    total, fixed = model_activation_bytes(everything, b)
    return logits + (total - fixed) // m.num_layers


def memory(cfg, batching, num_devices: int, on_gpu: bool = False) -> Memory:
    """`on_gpu`: the attention and the loss as a GPU runs them (--attention_impl=auto picks a flash kernel there,
    which keeps no scores; the loss's fp32 temporaries fuse), whatever this process's backend; otherwise as this
    backend runs them."""
    if on_gpu and cfg.execution.attention_impl == "auto":
        cfg = cfg.replace(execution=dict(attention_impl="pallas"))
    s = state_bytes(cfg, num_devices)
    return Memory(s["params"], s["grads"], s["optimizer"], s["other"], activation_bytes(cfg, batching),
                  transient_bytes(cfg, batching, on_gpu))
