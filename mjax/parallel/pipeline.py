"""Pipeline parallelism on the `pipeline` mesh axis: the layer stack split into stages, micro-batches streamed
through them by a `lax.scan` over ticks whose stage work is a `jax.shard_map` (manual over `pipeline` only, so
TP/SP/FSDP/DP on the other axes still come from GSPMD), activations handed on with `ppermute`.

Schedules (`--pipeline_schedule`), with M micro-batches per step and pp stages:
  gpipe        every forward, then every backward (jax.grad of the forward scan). Activations of all M
               micro-batches are kept. Bubble (pp - 1) / (M + pp - 1).
  1f1b         after pp - 1 warm-up ticks, each tick runs one forward and one backward (pipeline_1f1b.py). A stage
               keeps at most 2 pp - 1 stage inputs and recomputes its forward in the backward slot, so activation
               memory is bounded by the number of stages, not micro-batches. Bubble (pp - 1) / (M + pp - 1).
  interleaved_1f1b  Megatron's interleaved 1F1B: each device holds --vpp chunks of layers (Megatron's interleaved
               assignment) and runs Megatron's order of chunk forwards and backwards (pipeline_tables.py, run by
               pipeline_1f1b.py). Activation memory bounded by pp and vpp, not M; M a multiple of pp. Bubble
               (pp - 1) / (vpp M + pp - 1).
  interleaved  the same chunks, micro-batches going round the ring of devices vpp times in GPipe order (every
               activation kept). Bubble (pp - 1) / (vpp M + pp - 1).
  zero_bubble  ZB-H1: the backward split into input and weight gradients, the weight gradients run where 1F1B idles
               (pipeline_zero_bubble.py). Keeps 1f1b's stage inputs plus as many output gradients, whatever M;
               bubble (pp - 1) / (3 M + pp - 1) in ticks of one F, B or W.

Layer placement: the train state and checkpoints keep the stacked layers as [num_layers, ...], sharded in
contiguous blocks over `pipeline`, so they restore onto any pp/vpp and the shard_maps take them as they are. With
vpp = 1 each device's block is its stage. With vpp > 1, chunk c of device s is virtual stage v = c pp + s and holds
layers [v Lv, (v + 1) Lv), Lv = num_layers / (pp vpp) (Megatron's assignment); a shard_map before the ticks moves
the blocks there with one all_to_all of the layer weights per step (and one of their gradients), about the traffic
of an FSDP gather, rather than storing a pp/vpp-dependent layer order.

Every tick, the micro-batch entering stage 0 is embedded under GSPMD (see pipeline_stage.py for why not inside the
shard_map). With gpipe and interleaved the head (the output layer and loss, and multi-token prediction's depths:
pipeline_head.py) runs after the pipeline on the finished micro-batches, split over the pipeline devices; with the
1F1B schedules and zero_bubble the last stage runs it inside the tick, since the backward of a micro-batch starts
right after its forward. The head's params (the MTP layers' among them) are not split over stages.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from mjax.config.pipeline_layout import stage_layout
from mjax.config.validate import pipeline_schedule
from mjax.sharding import current_logical_sharding
from mjax.parallel import pipeline_1f1b, pipeline_placement, pipeline_zero_bubble
from mjax.parallel.pipeline_head import Head, head_loss, head_sums
from mjax.parallel.pipeline_stage import (AXIS, embed, manual, micro_at, moe_sums_like, my_chunks, per_stage_zeros,
                                          run_layers, shift, split_params, stored_order_sums)
from mjax.parallel.rules import BATCH_AXES


def bubble_fraction(schedule: str, pp: int, vpp: int, num_micro: int) -> float:
    """The share of each device's time a schedule leaves idle, with equal stages."""
    if schedule in ("interleaved", "interleaved_1f1b"):
        return (pp - 1) / (vpp * num_micro + pp - 1)
    if schedule == "zero_bubble":  # ticks of one F, B or W each
        return (pp - 1) / (3 * num_micro + pp - 1)
    return (pp - 1) / (num_micro + pp - 1)


def loss_and_grads(model, pcfg, params: dict, batch: dict, spec: Head, weights: dict, use_segments: bool,
                   moe_weight=0.0, fp8=None):
    """The pipelined counterpart of train/step.py's accumulation scan: the gradients of the head's terms of the
    micro-batches in `batch` (arrays [M, B, T]), each times its weight in `weights` (pipeline_head.py), plus
    moe_weight x the stages' MoE objective terms. fp8: the FP8 scales (TrainState.fp8.scales; the 1F1B schedules
    only). Returns (grads, the FP8 amaxes observed ({} without), the head's (terms, sums) summed over the
    micro-batches, measured bubble, the stages' MoE sums in stored layer order ({} without MoE))."""
    pp, vpp, num = pcfg.pp, pcfg.vpp, batch["inputs"].shape[0]
    stacks, rest = split_params(params)
    plan = placement(model, pcfg)
    if pipeline_schedule(pcfg) == "zero_bubble":
        grads, amaxes, head_out, bubble, moe_sums = pipeline_zero_bubble.run(
            model, spec, use_segments, pp, stacks, rest, batch, weights)
    elif pipeline_schedule(pcfg) in ("1f1b", "interleaved_1f1b"):
        grads, amaxes, head_out, bubble, moe_sums = pipeline_1f1b.run(
            model, spec, use_segments, pp, vpp, stacks, rest, batch, weights, moe_weight, split_params(fp8 or {}),
            plan)
    else:
        if fp8:
            raise ValueError(f"FP8 layers under --pipeline_schedule={pipeline_schedule(pcfg)}: use 1f1b or "
                             "interleaved_1f1b, whose explicit backward slots take each layer's amax")

        def loss(stacks, rest):
            outputs, busy, moe_obj, moe_sums = _forward(model, use_segments, pp, vpp, stacks, rest, batch, plan)
            value, head_out = head_loss(model, spec, rest, outputs, batch, weights, pp)
            return value + moe_weight * moe_obj, (head_out, busy, moe_sums)

        (d_stacks, d_rest), (head_out, busy, moe_sums) = jax.grad(loss, argnums=(0, 1), has_aux=True)(stacks, rest)
        grads, amaxes = {**d_rest, **d_stacks}, {}
        bubble = 1.0 - busy / ((vpp * num + pp - 1) * pp)  # ticks; the backward mirrors them
    moe_sums = (stored_order_sums(moe_sums, pp, vpp) if plan is None
                else pipeline_placement.stored_order_sums(plan, moe_sums))
    return grads, amaxes, head_out, bubble, moe_sums


def placement(model, pcfg):
    """The Placement of the configured stage layout when its stages differ in length or in dense/MoE pattern
    (pipeline_placement.py), or None when every stage holds alike layers (each device's stored block, or Megatron's
    interleaved chunks)."""
    layout, pattern = stage_layout(pcfg, model.cfg.num_layers), tuple(model.cfg.moe_layer_pattern())
    return pipeline_placement.placement(layout, pattern) if pipeline_placement.needs_placement(layout, pattern) \
        else None


def loss_sums(model, pcfg, params: dict, batch: dict, spec: Head, use_segments: bool):
    """Forward only (evaluation) of batch arrays [B, T]: split into micro-batches, streamed through the stages in
    GPipe order, so no device ever holds more than its own layers. Returns the head's (terms, sums) summed over B."""
    mesh = current_logical_sharding()[0]
    shards = int(np.prod([mesh.shape[a] for a in BATCH_AXES]))
    size = batch["inputs"].shape[0]
    num = next((n for n in range(pcfg.pp, size + 1) if size % (n * shards) == 0), None)
    if num is None:
        raise ValueError(f"an evaluation batch of {size} cannot be split into >= {pcfg.pp} micro-batches for "
                         f"{shards} data-parallel shards")
    # [B, T] -> [M, B / M, T]: row i of micro-batch m is sample i M + m, so no sample changes device.
    micro = jax.tree.map(lambda a: jnp.swapaxes(a.reshape(size // num, num, *a.shape[1:]), 0, 1), batch)
    stacks, rest = split_params(params)
    outputs = _forward(model, use_segments, pcfg.pp, pcfg.vpp, stacks, rest, micro, placement(model, pcfg))[0]
    return head_sums(model, spec, rest, outputs, micro, pcfg.pp)


def _forward(model, use_segments, pp, vpp, layers, rest, batch, plan=None):
    """Runs the M micro-batches through the pp x vpp virtual stages in GPipe order. Returns the last virtual stage's
    outputs [M, B, T, D], the number of (device, tick) slots that did useful work, the MoE objective terms summed
    over stages and micro-batches, and the MoE sums per device [pp, ...] ({} without MoE layers). plan: the
    Placement of stages that differ (pipeline_placement.py), or None."""
    num = batch["inputs"].shape[0]
    if plan is not None:
        layers = pipeline_placement.to_devices(plan, layers, pipeline_placement.stored_dims(model, layers, {})[0])
    elif vpp > 1:
        layers = manual(lambda l: my_chunks(l, pp, vpp), P(AXIS), P(AXIS))(layers)
    x = jax.eval_shape(lambda r, b: embed(model, r, micro_at(b, 0)), rest, batch)  # [B, T, D]
    carry = {"received": per_stage_zeros(pp, x), "outputs": per_stage_zeros(pp, x, num),  # [pp, (M,) B, T, D]
             "busy": jnp.zeros((pp,), jnp.int32), "moe_obj": jnp.zeros((pp,), jnp.float32),
             "moe_sums": moe_sums_like(model, layers, pp, x, micro_at(batch, 0), use_segments, vpp=vpp,
                                       kinds=None if plan is None else plan.kinds)}
    if vpp > 1:  # device 0 keeps what the last device finished until its next round starts
        carry["circulating"] = per_stage_zeros(pp, x, num)

    def stage(layers, carry, first, t, batch):  # inside shard_map: this device's slices
        s = jax.lax.axis_index(AXIS)
        c, first = jax.tree.map(lambda a: a[0], carry), first[0]
        chunks = jax.tree.map(lambda a: a.reshape(vpp, a.shape[0] // vpp, *a.shape[1:]), layers)  # [vpp, Lv, ...]
        item = t - s  # this device runs round item // M of micro-batch item % M
        valid = (item >= 0) & (item < vpp * num)
        r, m = jnp.clip(item // num, 0, vpp - 1), jnp.mod(item, num)
        if vpp > 1:
            first = jnp.where(r == 0, first, c["circulating"][m])
        x = jnp.where(s == 0, first, c["received"])
        y, obj, sums = run_layers(model, jax.tree.map(lambda a: a[r], chunks), x, micro_at(batch, m), use_segments,
                                  slots=None if plan is None else plan.slots_of(s, r))
        c["moe_obj"] += jnp.where(valid, obj, 0.0)
        c["moe_sums"] = jax.tree.map(lambda a, b: _add_at_chunk(a, jnp.where(valid, b, 0.0), r), c["moe_sums"], sums)
        done = valid & (s == pp - 1) & (r == vpp - 1)
        c["outputs"] = c["outputs"].at[m].set(jnp.where(done, y, c["outputs"][m]))
        c["received"] = shift(y, pp, +1, circular=vpp > 1)
        if vpp > 1:  # what device 0 just received is round (t - pp + 1) // M of micro-batch (t - pp + 1) % M
            back = t - (pp - 1)
            keep = (s == 0) & (back >= 0) & (back < (vpp - 1) * num)
            mb = jnp.mod(back, num)
            c["circulating"] = c["circulating"].at[mb].set(jnp.where(keep, c["received"], c["circulating"][mb]))
        c["busy"] += valid.astype(jnp.int32)
        return jax.tree.map(lambda a: a[None], c)

    run_stage = manual(stage, (P(AXIS), P(AXIS), P(AXIS), P(), P()), P(AXIS))

    def tick(carry, t):  # stage 0 starts round t // M of micro-batch t % M
        first = embed(model, rest, micro_at(batch, jnp.mod(t, num)))  # [B, T, D]
        # Handed in as device 0's slice of a per-stage array rather than replicated: the gradient then reaches the
        # embedding through GSPMD instead of a psum of the replicated input, whose bf16 form XLA:CPU's all-reduce
        # promotion pass aborts on ("Invalid binary instruction opcode copy", jax 0.12).
        return run_stage(layers, carry, per_stage_zeros(pp, x).at[0].set(first), t, batch), None

    carry, _ = jax.lax.scan(tick, carry, jnp.arange(vpp * num + pp - 1))
    return carry["outputs"][pp - 1], jnp.sum(carry["busy"]), jnp.sum(carry["moe_obj"]), carry["moe_sums"]


def _add_at_chunk(total, part, chunk):
    """A device's MoE sums plus one chunk's: per-layer sums [vpp S, E] take [S, E] at chunk's slots, scalars add."""
    if total.shape == part.shape:
        return total + part
    size = part.shape[0]
    return jax.lax.dynamic_update_slice_in_dim(
        total, jax.lax.dynamic_slice_in_dim(total, chunk * size, size) + part, chunk * size, 0)
