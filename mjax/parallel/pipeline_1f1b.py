"""The 1F1B schedules (1f1b, and interleaved_1f1b with --vpp > 1) with explicit forward and backward slots: jax.vjp
per stage, no jax.grad of the scan. Which device runs what at each tick comes from pipeline_tables.py (Megatron's
order of operations); this module runs those tables.

Each tick every device runs (at most) the forward of one virtual chunk on one micro-batch and the backward of
another, in one shard_map manual over `pipeline`; its forward output goes to the next device (device pp - 1 hands
chunk c's output to device 0's chunk c + 1) and its input gradient to the previous one, by ppermute. What arrives
waits in a small buffer until its tick. The last virtual stage runs the head (pipeline_head.py: the output layer and
loss, and the MTP depths) inside its backward slot, right after that micro-batch's forward; the head's lookups in the
embedding table are made before the shard_map, and their gradient is taken there.

Memory: a stage keeps only the inputs of its forwards whose backward has not run yet (the tables' `stash` slots:
2 pp - 1 on the first device with vpp = 1, 2 pp - 1 + (vpp - 1) pp with interleaving), and recomputes its forward
inside the backward slot, so activation memory does not grow with the number of micro-batches. The price is one
extra forward of every stage (as with full activation recomputation).
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mjax.parallel import pipeline_placement
from mjax.parallel.pipeline_head import add_where, head, lookups, seed, sums_like
from mjax.parallel.pipeline_stage import (AXIS, embed, manual, micro_at, moe_sums_like, my_chunks, per_stage_zeros,
                                          run_layers, shift)
from mjax.parallel.pipeline_tables import one_f_one_b


def run(model, spec, use_segments, pp, vpp, layers, rest, batch, weights, moe_weight=0.0, fp8=({}, {}), plan=None):
    """Gradients of the head's terms (spec: a pipeline_head.Head) of the micro-batches in `batch` ([M, B, T] arrays),
    each times its weight in `weights`, plus moe_weight x the MoE layers' objective terms. layers: the stacked
    layers {"layers": [L, ...], "moe_layers": ...} (sharded over `pipeline` in stored order); rest: the other params;
    fp8: the FP8 scales of both ({} without FP8 layers). plan: the Placement of stages that differ
    (pipeline_placement.py), or None. Returns (grads, the FP8 amaxes observed (max over micro-batches), the head's
    (terms, sums) summed, the counted bubble, the MoE sums per device [pp, ...] in the order each device runs its
    layers ({} without MoE layers))."""
    num = batch["inputs"].shape[0]
    tables = one_f_one_b(pp, vpp, num)
    fp8_layers, fp8_rest = fp8
    chunked, to_stored = (layers, fp8_layers), None
    if plan is not None:  # stages that differ: each device's slots; the vjp takes gradients and amaxes back
        dims = pipeline_placement.stored_dims(model, layers, fp8_layers)
        place = lambda t: tuple(pipeline_placement.to_devices(plan, a, d) for a, d in zip(t, dims))  # noqa: E731
        chunked, to_stored = jax.vjp(place, chunked)
    elif vpp > 1:  # the interleaved placement; its vjp takes the gradients (and amaxes) back to the stored order
        chunked, to_stored = jax.vjp(manual(lambda l: my_chunks(l, pp, vpp), P(AXIS), P(AXIS)), chunked)
    table = {k: jnp.asarray(getattr(tables, k)) for k in (
        "f_chunk", "f_micro", "f_input", "f_stash", "b_chunk", "b_micro", "b_input", "b_stash", "f_arrive",
        "b_arrive")}  # [ticks, pp]
    x = jax.eval_shape(lambda r, f, b: embed(model, r, micro_at(b, 0), f), rest, fp8_rest, batch)  # [B, T, D]
    f32 = lambda tree, *lead: jax.tree.map(lambda a: jnp.zeros((*lead, *a.shape), jnp.float32), tree)  # noqa: E731
    carry = {"f_arriving": per_stage_zeros(pp, x), "b_arriving": per_stage_zeros(pp, x),  # [pp, B, T, D]
             "received": per_stage_zeros(pp, x, tables.received), "grads": per_stage_zeros(pp, x, tables.grads),
             "stash": per_stage_zeros(pp, x, tables.stash),  # [pp, slots, B, T, D]
             "d_head": f32(rest, pp), "amax_head": f32(fp8_rest, pp),
             "head": sums_like(model, spec, rest, x, micro_at(batch, 0), pp, fp8_rest),  # [pp, ...]
             "moe_sums": moe_sums_like(model, chunked[0], pp, x, micro_at(batch, 0), use_segments, chunked[1], vpp,
                                       None if plan is None else plan.kinds)}

    def chunk_of(tree, c):  # this device's layers [vpp Lv, ...] -> chunk c's [Lv, ...]
        return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, c * (a.shape[0] // vpp), a.shape[0] // vpp),
                            tree)

    def arrive(c, row):  # what the neighbours sent last tick, into its buffer slot (dropped at -1)
        for buffer, arriving, slot in (("received", "f_arriving", row["f_arrive"]),
                                       ("grads", "b_arriving", row["b_arrive"])):
            i = jnp.maximum(slot, 0)
            c[buffer] = c[buffer].at[i].set(jnp.where(slot >= 0, c[arriving], c[buffer][i]))

    def forward(s, c, stacks, first, row, batch):
        chunk, valid = jnp.maximum(row["f_chunk"], 0), row["f_chunk"] >= 0
        micro = micro_at(batch, jnp.maximum(row["f_micro"], 0))
        x = jnp.where(row["f_input"] >= 0, c["received"][jnp.maximum(row["f_input"], 0)], first)
        slot = jnp.maximum(row["f_stash"], 0)
        c["stash"] = c["stash"].at[slot].set(jnp.where(valid, x, c["stash"][slot]))
        layers, scales = chunk_of(stacks, chunk)
        slots = None if plan is None else plan.slots_of(s, chunk)
        c["f_arriving"] = shift(run_layers(model, layers, x, micro, use_segments, scales, slots)[0], pp, +1,
                                circular=vpp > 1)

    def backward(s, c, d_stacks, stacks, rest, fp8_rest, looked_up, row, batch, weights, moe_weight):
        chunk, valid = jnp.maximum(row["b_chunk"], 0), row["b_chunk"] >= 0
        last = valid & (s == pp - 1) & (chunk == vpp - 1)
        micro = micro_at(batch, jnp.maximum(row["b_micro"], 0))

        def at_chunk(combine):  # a [vpp Lv, ...] (this device's layers) with chunk's slice combined with d [Lv, ...]
            def update(a, d):
                size = a.shape[0] // vpp
                old = jax.lax.dynamic_slice_in_dim(a, chunk * size, size)
                return jax.lax.dynamic_update_slice_in_dim(a, combine(old, d.astype(jnp.float32)), chunk * size, 0)
            return update

        add_at_chunk, max_at_chunk = at_chunk(jnp.add), at_chunk(jnp.maximum)  # gradients and counts; amaxes

        slots = None if plan is None else plan.slots_of(s, chunk)

        def stage_fn(stack, x):  # ((y, MoE objective terms), MoE sums); the scales' cotangent is their amax
            y, obj, sums = run_layers(model, stack[0], x, micro, use_segments, stack[1], slots)
            return (y, obj), sums

        (y, obj), stage_vjp, sums = jax.vjp(stage_fn, chunk_of(stacks, chunk),
                                            c["stash"][jnp.maximum(row["b_stash"], 0)], has_aux=True)
        terms, head_vjp, head_sums = jax.vjp(lambda r, f, y, e: head(model, spec, r, y, micro, f, e), rest, fp8_rest,
                                             y, looked_up, has_aux=True)
        d_rest, amax_rest, dy, d_looked_up = head_vjp(seed(terms, weights, last))
        c["amax_head"] = jax.tree.map(lambda a, d: jnp.maximum(a, jnp.where(last, d, 0.0)), c["amax_head"], amax_rest)
        received = c["grads"][jnp.maximum(row["b_input"], 0)]
        dy = jnp.where(valid, jnp.where(last, dy, received), 0.0).astype(y.dtype)
        (d_block, amax_block), dx = stage_vjp((dy, jnp.where(valid, moe_weight, 0.0).astype(obj.dtype)))
        c["moe_sums"] = jax.tree.map(lambda a, b: add_at_chunk(a, jnp.where(valid, b, 0.0)) if a.ndim > 1
                                     else a + jnp.where(valid, b, 0.0), c["moe_sums"], sums)
        c["d_head"] = jax.tree.map(lambda a, d: a + d.astype(jnp.float32), c["d_head"], d_rest)
        c["head"] = add_where(c["head"], (terms, head_sums), last)
        c["b_arriving"] = shift(dx, pp, -1, circular=vpp > 1)

        d_layers, amaxes = d_stacks
        amax_block = jax.tree.map(lambda d: jnp.where(valid, d, 0.0), amax_block)  # idle slots observe nothing
        if plan is not None:  # nor do the slots a stage skips
            amax_block = {name: jax.tree.map(lambda d, m=plan.slot_is_layer(name, s, chunk): jnp.where(
                m.reshape(-1, *[1] * (d.ndim - 1)), d, 0.0), tree) for name, tree in amax_block.items()}
        return (jax.tree.map(add_at_chunk, d_layers, d_block), jax.tree.map(max_at_chunk, amaxes, amax_block)), dx, \
            d_looked_up

    def tick_fn(do_forward, do_backward):
        def stage(stacks, rest, fp8_rest, carry, d_stacks, first, looked_up, rows, batch, weights,
                  moe_weight):  # in shard_map
            s = jax.lax.axis_index(AXIS)
            c, row = jax.tree.map(lambda a: a[0], carry), jax.tree.map(lambda a: a[s], rows)
            arrive(c, row)
            dx, d_looked_up = jnp.zeros_like(c["f_arriving"]), looked_up
            if do_forward:
                forward(s, c, stacks, first, row, batch)
            if do_backward:
                d_stacks, dx, d_looked_up = backward(s, c, d_stacks, stacks, rest, fp8_rest, looked_up, row, batch,
                                                     weights, moe_weight)
            return jax.tree.map(lambda a: a[None], c), d_stacks, dx[None], jax.tree.map(lambda a: a[None], d_looked_up)

        run_stage = manual(stage, (P(AXIS), P(), P(), P(AXIS), P(AXIS), P(), P(), P(), P(), P(), P()), (P(AXIS),) * 4)

        def tick(state, t):
            carry, d_stacks, d_embed = state
            rows = jax.tree.map(lambda a: a[t], table)  # [pp] each
            first = (embed(model, rest, micro_at(batch, jnp.maximum(rows["f_micro"][0], 0)), fp8_rest) if do_forward
                     else jnp.zeros(x.shape, x.dtype))  # device 0's input when it runs chunk 0
            looked_up = {}  # the head's lookups for the last device's backward (pipeline_head.py)
            if do_backward and spec.inputs is not None:
                last_micro = micro_at(batch, jnp.maximum(rows["b_micro"][pp - 1], 0))
                looked_up, lookup_vjp = jax.vjp(lambda r: lookups(model, spec, r, last_micro, fp8_rest), rest)
            carry, d_stacks, dx, d_looked_up = run_stage(chunked, rest, fp8_rest, carry, d_stacks, first, looked_up,
                                                         rows, batch, weights, jnp.asarray(moe_weight, jnp.float32))
            if do_backward:  # device 0's input gradient of chunk 0 flows into the embedding lookup
                into = (rows["b_chunk"][0] == 0).astype(dx.dtype)
                micro = micro_at(batch, jnp.maximum(rows["b_micro"][0], 0))
                _, embed_vjp = jax.vjp(lambda r: embed(model, r, micro, fp8_rest), rest)
                d_embed = jax.tree.map(lambda a, d: a + d.astype(jnp.float32), d_embed, embed_vjp(dx[0] * into)[0])
            if do_backward and spec.inputs is not None:  # zero unless the last device ran its head this tick
                d_embed = jax.tree.map(lambda a, d: a + d.astype(jnp.float32), d_embed,
                                       lookup_vjp(jax.tree.map(lambda d: d[pp - 1], d_looked_up))[0])
            return (carry, d_stacks, d_embed), None

        return tick

    state = (carry, f32(chunked), f32(rest))
    for do_forward, do_backward, start, stop in tables.phases():
        state, _ = jax.lax.scan(tick_fn(do_forward, do_backward), state, jnp.arange(start, stop))
    carry, d_stacks, d_embed = state
    if to_stored is not None:  # a permutation of the layers: as right for the amaxes as for the gradients
        (d_stacks,) = to_stored(jax.tree.map(lambda g, p: g.astype(p.dtype), d_stacks, chunked))
        d_stacks = jax.tree.map(lambda g: g.astype(jnp.float32), d_stacks)
    d_layers, amax_layers = d_stacks
    d_rest = jax.tree.map(lambda h, e: h.sum(0) + e, carry["d_head"], d_embed)
    amaxes = {**jax.tree.map(lambda a: a.max(0), carry["amax_head"]), **amax_layers}
    return ({**d_rest, **d_layers}, amaxes, jax.tree.map(lambda a: a.sum(0), carry["head"]), tables.bubble(),
            carry["moe_sums"])
