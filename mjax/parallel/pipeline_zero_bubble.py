"""The zero-bubble schedule ZB-H1 (--pipeline_schedule=zero_bubble, vpp = 1): the backward of each stage split into B,
the input gradient the previous stage waits for, and W, the weight gradient nobody waits for, which the tables
(pipeline_tables.zero_bubble) run where 1F1B would idle. Each tick a device runs one of F, B, W (one shard_map
manual over `pipeline`, as pipeline_1f1b.py); F hands its output to the next device, B its input gradient to the
previous one, by ppermute. The operation is a lax.switch per device (the pipeline axis is manual, and a stage's
tensor-parallel peers take the same branch), not the masking of pipeline_1f1b.py: masked, every tick would pay F,
B and W, and hold B's and W's recomputed activations at once.

B and W both recompute the stage's forward from its kept input, as 1F1B's backward slot does: B takes the vjp with
respect to the input only, W the vjp with respect to the layers only (so neither computes the other's product).
Keeping the vjp's residuals from B for W instead would hold every pending W's full layer activations, which is what
the recompute exists to avoid; the price is a third forward of every stage per micro-batch (1F1B: two).

Memory: a stage keeps its inputs from F to W (the tables' `stash`, at most 2 pp - 1 as 1F1B's tables) and the output
gradient of each B until its W (`kept`, at most as many), so activation memory does not grow with the micro-batches.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mjax.parallel.pipeline_head import add_where, head, lookups, seed, sums_like
from mjax.parallel.pipeline_stage import AXIS, embed, manual, micro_at, per_stage_zeros, run_layers, shift
from mjax.parallel.pipeline_tables import zero_bubble

ROWS = ("f_micro", "f_input", "f_stash", "b_micro", "b_input", "b_stash", "b_keep", "w_micro", "w_stash", "w_keep",
        "f_arrive", "b_arrive")


def run(model, spec, use_segments, pp, layers, rest, batch, weights):
    """Gradients of the head's terms (spec: a pipeline_head.Head) of the micro-batches in `batch` ([M, B, T] arrays),
    each times its weight in `weights`. layers: the stacked layers {"layers": [L, ...]} (sharded over `pipeline`,
    each device's block its stage); rest: the other params. The last device's B runs the head, its lookups in the
    embedding table made before the shard_map (as pipeline_1f1b.py). Returns (grads, {} (no FP8 amaxes), the head's
    (terms, sums) summed, the tables' bubble, {} (no MoE sums))."""
    tables = zero_bubble(pp, batch["inputs"].shape[0])
    table = {k: jnp.asarray(getattr(tables, k)) for k in ROWS}  # [ticks, pp]
    x = jax.eval_shape(lambda r, b: embed(model, r, micro_at(b, 0)), rest, batch)  # [B, T, D]
    f32 = lambda tree, *lead: jax.tree.map(lambda a: jnp.zeros((*lead, *a.shape), jnp.float32), tree)  # noqa: E731
    carry = {"f_arriving": per_stage_zeros(pp, x), "b_arriving": per_stage_zeros(pp, x),  # [pp, B, T, D]
             "received": per_stage_zeros(pp, x, tables.received), "grads": per_stage_zeros(pp, x, tables.grads),
             "stash": per_stage_zeros(pp, x, tables.stash), "kept": per_stage_zeros(pp, x, tables.kept),
             "d_head": f32(rest, pp), "head": sums_like(model, spec, rest, x, micro_at(batch, 0), pp)}  # [pp, ...]

    def slot(i):
        return jnp.maximum(i, 0)

    def stage_out(stacks, x, micro):
        return run_layers(model, stacks, x, micro, use_segments)[0]

    def arrive(c, row):  # what the neighbours sent last tick, into its buffer slot (dropped at -1)
        for buffer, arriving, at in (("received", "f_arriving", row["f_arrive"]), ("grads", "b_arriving",
                                                                                     row["b_arrive"])):
            c[buffer] = c[buffer].at[slot(at)].set(jnp.where(at >= 0, c[arriving], c[buffer][slot(at)]))

    def nothing(tree):
        return jax.tree.map(jnp.zeros_like, tree)

    # Each operation returns (carry, weight gradients, what goes to the next and the previous device, the gradient of
    # the head's lookups).
    def forward(c, d_stacks, stacks, rest, first, looked_up, row, batch, weights):  # F
        micro = micro_at(batch, slot(row["f_micro"]))
        x = jnp.where(row["f_input"] >= 0, c["received"][slot(row["f_input"])], first)
        c["stash"] = c["stash"].at[slot(row["f_stash"])].set(x)
        return c, d_stacks, stage_out(stacks, x, micro), jnp.zeros_like(x), nothing(looked_up)

    def input_grad(c, d_stacks, stacks, rest, first, looked_up, row, batch, weights):  # B
        last = jax.lax.axis_index(AXIS) == pp - 1
        micro = micro_at(batch, slot(row["b_micro"]))
        y, x_vjp = jax.vjp(lambda x: stage_out(stacks, x, micro), c["stash"][slot(row["b_stash"])])
        terms, head_vjp, sums = jax.vjp(lambda r, y, e: head(model, spec, r, y, micro, inputs=e), rest, y, looked_up,
                                        has_aux=True)
        d_rest, dy, d_looked_up = head_vjp(seed(terms, weights, last))
        dy = jnp.where(last, dy, c["grads"][slot(row["b_input"])]).astype(y.dtype)
        (dx,) = x_vjp(dy)
        c["kept"] = c["kept"].at[slot(row["b_keep"])].set(dy)
        c["d_head"] = jax.tree.map(lambda a, d: a + d.astype(jnp.float32), c["d_head"], d_rest)
        c["head"] = add_where(c["head"], (terms, sums), last)
        return c, d_stacks, jnp.zeros_like(dx), dx, d_looked_up

    def weight_grad(c, d_stacks, stacks, rest, first, looked_up, row, batch, weights):  # W
        micro = micro_at(batch, slot(row["w_micro"]))
        _, w_vjp = jax.vjp(lambda w: stage_out(w, c["stash"][slot(row["w_stash"])], micro), stacks)
        (d_block,) = w_vjp(c["kept"][slot(row["w_keep"])])
        d_stacks = jax.tree.map(lambda a, d: a + d.astype(jnp.float32), d_stacks, d_block)
        return c, d_stacks, jnp.zeros_like(first), jnp.zeros_like(first), nothing(looked_up)

    def idle(c, d_stacks, stacks, rest, first, looked_up, row, batch, weights):
        return c, d_stacks, jnp.zeros_like(first), jnp.zeros_like(first), nothing(looked_up)

    def tick_fn(do_forward, do_input, do_weight):
        ops = [(op, name) for op, name, do in ((forward, "f_micro", do_forward), (input_grad, "b_micro", do_input),
                                               (weight_grad, "w_micro", do_weight)) if do]

        def stage(stacks, rest, carry, d_stacks, first, looked_up, rows, batch, weights):  # inside shard_map
            s = jax.lax.axis_index(AXIS)
            c, row = jax.tree.map(lambda a: a[0], carry), jax.tree.map(lambda a: a[s], rows)
            arrive(c, row)
            # Each device runs only its own operation (the pipeline axis is manual: the branch is per device).
            which = len(ops)  # idle
            for i, (_, name) in enumerate(ops):
                which = jnp.where(row[name] >= 0, i, which)
            c, d_stacks, to_next, to_previous, d_looked_up = jax.lax.switch(
                which, [op for op, _ in ops] + [idle], c, d_stacks, stacks, rest, first, looked_up, row, batch, weights)
            c["f_arriving"], c["b_arriving"] = shift(to_next, pp, +1), shift(to_previous, pp, -1)
            return (jax.tree.map(lambda a: a[None], c), d_stacks, to_previous[None],
                    jax.tree.map(lambda a: a[None], d_looked_up))

        run_stage = manual(stage, (P(AXIS), P(), P(AXIS), P(AXIS), P(), P(), P(), P(), P()), (P(AXIS),) * 4)

        def tick(state, t):
            carry, d_stacks, d_embed = state
            rows = jax.tree.map(lambda a: a[t], table)  # [pp] each
            first = (embed(model, rest, micro_at(batch, slot(rows["f_micro"][0]))) if do_forward
                     else jnp.zeros(x.shape, x.dtype))  # device 0's input
            looked_up = {}  # the head's lookups for the last device's B (pipeline_head.py)
            if do_input and spec.inputs is not None:
                last_micro = micro_at(batch, slot(rows["b_micro"][pp - 1]))
                looked_up, lookup_vjp = jax.vjp(lambda r: lookups(model, spec, r, last_micro), rest)
            carry, d_stacks, dx, d_looked_up = run_stage(layers, rest, carry, d_stacks, first, looked_up, rows, batch,
                                                         weights)
            if do_input:  # device 0's input gradient flows into the embedding lookup
                into = (rows["b_micro"][0] >= 0).astype(dx.dtype)
                micro = micro_at(batch, slot(rows["b_micro"][0]))
                _, embed_vjp = jax.vjp(lambda r: embed(model, r, micro), rest)
                d_embed = jax.tree.map(lambda a, d: a + d.astype(jnp.float32), d_embed, embed_vjp(dx[0] * into)[0])
            if do_input and spec.inputs is not None:  # zero unless the last device ran its B this tick
                d_embed = jax.tree.map(lambda a, d: a + d.astype(jnp.float32), d_embed,
                                       lookup_vjp(jax.tree.map(lambda d: d[pp - 1], d_looked_up))[0])
            return (carry, d_stacks, d_embed), None

        return tick

    state = (carry, f32(layers), f32(rest))
    for do_forward, do_input, do_weight, start, stop in tables.phases():
        state, _ = jax.lax.scan(tick_fn(do_forward, do_input, do_weight), state, jnp.arange(start, stop))
    carry, d_layers, d_embed = state
    d_rest = jax.tree.map(lambda h, e: h.sum(0) + e, carry["d_head"], d_embed)
    return {**d_rest, **d_layers}, {}, jax.tree.map(lambda a: a.sum(0), carry["head"]), tables.bubble(), {}
