"""The 1F1B pipeline schedule with explicit forward and backward slots (jax.vjp per stage, no jax.grad of the scan).

Device s runs the forward of micro-batch m at tick m + s and its backward at tick m + 2 (pp - 1) - s, so a
micro-batch's backward starts on the last stage in the tick its forward ends there, and the gradient w.r.t. a stage's
input reaches the previous stage one tick later. Ticks [0, pp - 1) run forwards only (warm-up), the next M run
one forward and one backward, the last pp - 1 backwards only (cool-down): (pp - 1) (F + B) idle out of
(M + pp - 1) (F + B), Megatron's 1F1B bubble.

Memory: a stage keeps only the inputs of micro-batches between their forward and backward (at most 2 pp - 1, in
a ring) and recomputes its forward inside the backward slot, so activation memory does not grow with the number
of micro-batches. The price is one extra forward of every stage (as with full activation recomputation).
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mjax.parallel.pipeline_stage import (AXIS, embed, head, manual, micro_at, moe_sums_like, per_stage_zeros,
                                          run_layers, shift)


def num_slots(pp: int, num_micro: int) -> int:
    """Forward slots (warm-up and steady ticks) plus backward slots (steady and cool-down ticks) of one device."""
    return 2 * (num_micro + pp - 1)


def run(model, token_loss, use_segments, pp, layers, rest, batch, weight, moe_weight=0.0):
    """Gradients of weight x the summed loss of the micro-batches in `batch` ([M, B, T] arrays) plus moe_weight x the
    MoE layers' objective terms. layers: the stacked layers {"layers": [L, ...], "moe_layers": ...} (sharded over
    `pipeline`); rest: the other params. Returns (grads, loss sum, z sum, useful forward + backward slots over all
    devices, the MoE sums per device [pp, ...] ({} without MoE layers))."""
    num = batch["inputs"].shape[0]
    slots = min(2 * pp - 1, num)  # stage inputs waiting for their backward
    x = jax.eval_shape(lambda r, b: embed(model, r, micro_at(b, 0)), rest, batch)  # [B, T, D]
    f32 = lambda tree, *lead: jax.tree.map(lambda a: jnp.zeros((*lead, *a.shape), jnp.float32), tree)  # noqa: E731
    carry = {"f_recv": per_stage_zeros(pp, x), "b_recv": per_stage_zeros(pp, x),  # [pp, B, T, D]
             "stash": per_stage_zeros(pp, x, slots),  # [pp, slots, B, T, D]
             "d_head": f32(rest, pp), "loss": jnp.zeros((pp,)), "z": jnp.zeros((pp,)),
             "busy": jnp.zeros((pp,), jnp.int32),
             "moe_sums": moe_sums_like(model, layers, pp, x, micro_at(batch, 0), use_segments)}

    def forward(s, c, layers, first, t, batch):
        m = t - s
        valid = (m >= 0) & (m < num)
        micro = micro_at(batch, jnp.clip(m, 0, num - 1))
        x = jnp.where(s == 0, first, c["f_recv"])
        slot = jnp.mod(m, slots)
        c["stash"] = c["stash"].at[slot].set(jnp.where(valid, x, c["stash"][slot]))
        c["f_recv"] = shift(run_layers(model, layers, x, micro, use_segments)[0], pp, +1)
        c["busy"] += valid.astype(jnp.int32)

    def backward(s, c, d_layers, layers, rest, t, batch, weight, moe_weight):
        m = t - 2 * (pp - 1) + s
        valid, last = (m >= 0) & (m < num), s == pp - 1
        micro = micro_at(batch, jnp.clip(m, 0, num - 1))
        def stage_fn(l, x):  # ((y, MoE objective terms), MoE sums)
            y, obj, sums = run_layers(model, l, x, micro, use_segments)
            return (y, obj), sums

        (y, obj), stage_vjp, sums = jax.vjp(stage_fn, layers, c["stash"][jnp.mod(m, slots)], has_aux=True)
        total, head_vjp, z = jax.vjp(lambda r, y: head(model, token_loss, r, y, micro), rest, y, has_aux=True)
        d_rest, dy = head_vjp(jnp.where(last & valid, weight, 0.0).astype(total.dtype))
        dy = jnp.where(valid, jnp.where(last, dy, c["b_recv"]), 0.0).astype(y.dtype)
        d_block, dx = stage_vjp((dy, jnp.where(valid, moe_weight, 0.0).astype(obj.dtype)))
        c["moe_sums"] = jax.tree.map(lambda a, b: a + jnp.where(valid, b, 0.0), c["moe_sums"], sums)
        c["d_head"] = jax.tree.map(lambda a, d: a + d.astype(jnp.float32), c["d_head"], d_rest)
        c["loss"] += jnp.where(last & valid, total, 0.0)
        c["z"] += jnp.where(last & valid, z, 0.0)
        c["b_recv"] = shift(dx, pp, -1)
        c["busy"] += valid.astype(jnp.int32)
        return jax.tree.map(lambda a, d: a + d.astype(jnp.float32), d_layers, d_block), dx

    def tick_fn(do_forward, do_backward):
        def stage(layers, rest, carry, d_layers, first, t, batch, weight, moe_weight):  # inside shard_map
            s = jax.lax.axis_index(AXIS)
            c = jax.tree.map(lambda a: a[0], carry)
            dx = jnp.zeros_like(c["f_recv"])
            if do_forward:
                forward(s, c, layers, first, t, batch)
            if do_backward:
                d_layers, dx = backward(s, c, d_layers, layers, rest, t, batch, weight, moe_weight)
            return jax.tree.map(lambda a: a[None], c), d_layers, dx[None]

        run_stage = manual(stage, (P(AXIS), P(), P(AXIS), P(AXIS), P(), P(), P(), P(), P()), (P(AXIS),) * 3)

        def tick(state, t):
            carry, d_layers, d_embed = state
            first = (embed(model, rest, micro_at(batch, jnp.clip(t, 0, num - 1))) if do_forward  # stage 0's input
                     else jnp.zeros(x.shape, x.dtype))
            carry, d_layers, dx = run_stage(layers, rest, carry, d_layers, first, t, batch, weight,
                                            jnp.asarray(moe_weight, jnp.float32))
            if do_backward:  # stage 0's input gradient (zero unless valid) flows into the embedding lookup
                micro = micro_at(batch, jnp.clip(t - 2 * (pp - 1), 0, num - 1))
                _, embed_vjp = jax.vjp(lambda r: embed(model, r, micro), rest)
                d_embed = jax.tree.map(lambda a, d: a + d.astype(jnp.float32), d_embed, embed_vjp(dx[0])[0])
            return (carry, d_layers, d_embed), None

        return tick

    state = (carry, f32(layers), f32(rest))
    for do_forward, do_backward, start, stop in ((True, False, 0, pp - 1), (True, True, pp - 1, num + pp - 1),
                                                 (False, True, num + pp - 1, num + 2 * (pp - 1))):
        state, _ = jax.lax.scan(tick_fn(do_forward, do_backward), state, jnp.arange(start, stop))
    carry, d_layers, d_embed = state
    d_rest = jax.tree.map(lambda h, e: h.sum(0) + e, carry["d_head"], d_embed)
    return ({**d_rest, **d_layers}, jnp.sum(carry["loss"]), jnp.sum(carry["z"]), jnp.sum(carry["busy"]),
            carry["moe_sums"])
