"""What a pipeline schedule keeps on its busiest device, from the schedules' code (mjax/parallel/pipeline*.py) and
their own tables, given one device's residuals without a pipeline (mjax.plan.activations).

The 1F1B family (1f1b, interleaved_1f1b, zero_bubble) runs explicit slots: a device keeps its tables' buffers of
stage inputs and arriving activations and gradients, and in a backward slot one chunk's residuals (its forward is
recomputed there). Its gradients are summed in the tick carry: the layers' sum and the chunk's fresh gradient, and
the output layer's and the embedding's sums apart (pipeline_1f1b.py's d_head and d_embed).

The GPipe family (gpipe, interleaved) is jax.grad of the scan over ticks, so autodiff stacks one chunk's residuals
per tick, the bubble's ticks too (vpp M + pp - 1 of them), and with them the chunk's weights: each tick indexes its
chunk out of the device's layers, so the weights are a per-tick residual, not a constant. The output layer runs
after the ticks (its gradient computed in its forward). Carries of M stage inputs each: the finished outputs, their
gradient from the output layer, that gradient's way back through the scan's carry, and with vpp > 1 the
circulating inputs and their gradient.

With vpp > 1 both families place the layers in Megatron's interleaved order with an all_to_all: one more copy of
the device's layers for the whole step, and the 1F1B slots slice one chunk out of it."""

import dataclasses

from mjax.config.validate import pipeline_schedule
from mjax.parallel.pipeline_tables import one_f_one_b, zero_bubble

ONE_F_ONE_B = ("1f1b", "interleaved_1f1b", "zero_bubble")


@dataclasses.dataclass(frozen=True)
class Device:
    """One device's share, without a pipeline: residuals per micro-batch (all layers) and fixed, and the stacked
    layers' weights as the backward reads them (in the compute dtype) and as stored (param dtype)."""
    per_micro: int  # residuals that grow with the micro-batch, every layer of the model
    fixed: int  # residuals kept once (weights cast to the compute dtype)
    head_fixed: int  # of which the output layer's weight cast
    layer_weights: int  # the stacked layers' params the backward reads as they are
    layer_params: int  # the stacked layers' params as stored on this device (its stage's share)
    layer_grads: int  # their fp32 gradients
    rest_grads: int  # fp32 gradients of every other param (embedding, output layer, final norm)
    stage_input: int  # one micro-batch's [B, T, D] hand-off between stages


def buffer_slots(pcfg, micro: int) -> int:
    """[B, T, D] buffers a 1F1B-family device holds: its tables' stash, twice (a tick writes its input into a new
    stash while the carry still holds the old: measured), arriving-activation and arriving-gradient slots
    (zero_bubble: and the output gradients kept for W), plus the two in flight."""
    schedule = pipeline_schedule(pcfg)
    t = zero_bubble(pcfg.pp, micro) if schedule == "zero_bubble" else one_f_one_b(pcfg.pp, pcfg.vpp, micro)
    return 2 * t.stash + t.received + t.grads + getattr(t, "kept", 0) + 2


def _phases(pcfg, micro: int) -> list[tuple[bool, int]]:
    """(runs a backward, ticks) of each phase of a 1F1B-family schedule (a run of alike ticks, one scan each)."""
    if pipeline_schedule(pcfg) not in ("1f1b", "interleaved_1f1b"):
        return []
    return [(backward, stop - start) for _, backward, start, stop in one_f_one_b(pcfg.pp, pcfg.vpp, micro).phases()]


def hoisted_phases(pcfg, micro: int) -> int:
    """The phases of one tick that run a backward, beside another such phase. XLA inlines a scan of length 1, and
    XLA:CPU schedules the zero-filled buffers its backward writes the chunk's residuals into at the start of the
    step (a zero fill reads nothing), so they are live through the other backward phases (measured:
    tests/integration/test_plan_memory.py's pp = 2 layouts, whose cool-down is one tick)."""
    backward = [ticks for runs_backward, ticks in _phases(pcfg, micro) if runs_backward]
    return min(backward.count(1), len(backward) - 1) if backward else 0


def hoisted_bytes(cfg, micro: int, d: Device) -> int:
    """Zero-filled buffers XLA:CPU allocates at the start of the step for a later backward: the one-tick phases'
    chunk residuals, and with vpp > 1 the two [device's layers] targets the interleaved placement's transpose
    (all_to_all, then the gather's scatter) returns the gradients through (measured on the same layouts: 15 MiB of
    buffers shaped as the layers at the peak of the vpp = 2 ones, inside the pipeline)."""
    p = cfg.parallel
    chunks = p.pp * p.vpp
    phases = hoisted_phases(p, micro) * (d.per_micro + d.fixed) / chunks
    return int(phases + (2 * d.layer_params if p.vpp > 1 else 0))


def activation_bytes(cfg, micro: int, d: Device, on_gpu: bool) -> int:
    """Kept for the backward at the schedule's peak (one pipeline device; the model's residuals split evenly over
    the pp x vpp chunks)."""
    p = cfg.parallel
    chunks = p.pp * p.vpp
    chunk, chunk_fixed = d.per_micro / chunks, d.fixed / chunks
    placed = d.layer_params if p.vpp > 1 else 0  # the interleaved copy of the device's layers
    hoisted = 0 if on_gpu else hoisted_bytes(cfg, micro, d)
    if pipeline_schedule(p) in ONE_F_ONE_B:
        sliced = d.layer_params / p.vpp if p.vpp > 1 else 0  # the backward slot's chunk, sliced out of the copy
        # a chunk of one layer runs no layer scan: its residuals are freed as its backward runs, within the layer
        # working set the transient counts, rather than held in stacks until the chunk's backward ends
        held = chunk if cfg.model.num_layers > chunks else 0
        return int(buffer_slots(p, micro) * d.stage_input + held + chunk_fixed + placed + sliced + hoisted)
    ticks = p.vpp * micro + p.pp - 1
    weights = (d.fixed - d.head_fixed + d.layer_weights) / chunks  # a chunk's weights, as its backward reads them
    carries = (3 + 2 * (p.vpp > 1)) * micro * d.stage_input
    return int(ticks * (chunk + weights) + carries + placed + hoisted)


def partial_grad_bytes(cfg, micro: int, d: Device, on_gpu: bool) -> int:
    """fp32 gradient buffers besides the step's sum: the chunk's own gradient before it is added, and the output
    layer's and embedding's per-device sums (1F1B) or the output layer's, computed in its forward (GPipe). With a
    phase of one tick (inlined, as hoisted_phases says), XLA:CPU keeps the zero fill of the tick carry's gradient
    sums live beside the carry itself: one more set (measured on the pp = 2 1F1B layouts, all three remat
    policies: 9.5 MiB short without it, the sums' size)."""
    inlined = not on_gpu and any(ticks == 1 for _, ticks in _phases(cfg.parallel, micro))
    return int(d.layer_grads / cfg.parallel.vpp + d.rest_grads + (d.layer_grads + d.rest_grads) * inlined)
