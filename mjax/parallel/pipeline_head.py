"""What the pipeline runs where the output layer runs: the head of a finished micro-batch (the final norm, the loss,
and whatever else the train step's loss side computes from the final hidden states, such as multi-token prediction)
and its GPipe-order form, run after the pipeline on the finished micro-batches.

A Head's loss gives two dicts per micro-batch: `terms`, which the schedules differentiate, each seeded with its
weight (a tree of the same keys: the loss sum's 1 / the step's tokens, the MTP depths' factors, the MoE weight of the
MoE blocks among them), and `sums`, which they only add up over the micro-batches (the z-loss, router counts). Its
`inputs` are the arrays the loss reads that are looked up in the embedding table (the MTP depths' embeddings of the
tokens ahead): the 1F1B schedules look them up under GSPMD, outside a stage's shard_map, for the reason the first
stage's embedding is (pipeline_stage.py), and take their gradient there.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mjax.parallel.pipeline_stage import AXIS, manual


@dataclasses.dataclass(frozen=True)
class Head:
    """loss(module, h, micro, inputs) -> (terms, sums) of one micro-batch from its final-norm output h [B, T, D];
    inputs(module, micro) -> the lookups `loss` takes as `inputs` (None: there are none, `loss` gets {})."""
    loss: Callable
    inputs: Callable | None = None


def head(model, spec: Head, rest: dict, y, micro: dict, fp8=None, inputs=None):
    """The last layer's output [B, T, D] -> spec.loss's (terms, sums). `rest`: the params other than the layers,
    `fp8` their FP8 scales; inputs: spec.inputs' arrays when looked up elsewhere (None: here)."""
    module = model.bind(rest, fp8)
    if inputs is None:
        inputs = {} if spec.inputs is None else spec.inputs(module, micro)
    return spec.loss(module, module.final_norm(y), micro, inputs)


def lookups(model, spec: Head, rest: dict, micro: dict, fp8=None):
    """spec.inputs of one micro-batch (under GSPMD, before the stage's shard_map)."""
    return spec.inputs(model.bind(rest, fp8), micro)


def sums_like(model, spec: Head, rest: dict, x, micro: dict, pp: int, fp8=None):
    """fp32 zeros [pp, ...] shaped as one micro-batch's (terms, sums): one running total per pipeline device."""
    out = jax.eval_shape(lambda r, f, y, m: head(model, spec, r, y, m, f), rest, fp8, x, micro)
    return jax.tree.map(lambda a: jnp.zeros((pp, *a.shape), jnp.float32), out)


def seed(terms: dict, weights: dict, on):
    """The cotangent of terms: each term's weight where `on` (this device ran the head), else 0."""
    return jax.tree.map(lambda t, w: jnp.broadcast_to(jnp.where(on, w, 0.0), t.shape).astype(t.dtype), terms, weights)


def add_where(total, part, on):
    """Running totals plus part where `on`."""
    return jax.tree.map(lambda a, b: a + jnp.where(on, b, 0.0).astype(a.dtype), total, part)


def _weighted(terms: dict, weights: dict):
    return sum(jax.tree.leaves(jax.tree.map(lambda t, w: jnp.sum(t * w), terms, weights)))


def _grouped(x, pp: int):
    """[M, ...] -> [ceil(M / pp), pp, ...], zero-padded."""
    groups = -(-x.shape[0] // pp)
    x = jnp.pad(x, [(0, groups * pp - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
    return x.reshape(groups, pp, *x.shape[1:])


def _groups(hs, batch: dict, pp: int):
    """The finished micro-batches hs [M, B, T, D] and their batch arrays as groups of one per pipeline device, [G, pp,
    ...], with [G, pp] whether each slot holds a micro-batch (a padding slot's MTP or MoE blocks would route
    tokens)."""
    real = _grouped(jnp.ones((hs.shape[0],), bool), pp)
    return _grouped(hs, pp), jax.tree.map(lambda a: _grouped(a, pp), batch), real


def _on_devices(fn):
    """fn(rest, weights, y, micro, looked_up, real) of one micro-batch -> the same of a group's [pp, ...] slots, each
    pipeline device running its own slot, outputs [pp, ...]. A shard_map manual over `pipeline` (rather than a vmap
    with spmd_axis_name): the MoE blocks of MTP depths cannot run under vmap (jax 0.12's ragged_dot batches dim 0
    only)."""
    def body(rest, weights, *slot):
        return jax.tree.map(lambda a: a[None], fn(rest, weights, *jax.tree.map(lambda a: a[0], slot)))

    return manual(body, (P(), P(), P(AXIS), P(AXIS), P(AXIS), P(AXIS)), P(AXIS))


def _group_lookups(model, spec: Head, rest: dict, micro: dict):
    """spec.inputs of a group's micro-batches [pp, B, T] (under GSPMD), {} without."""
    return {} if spec.inputs is None else jax.vmap(lambda m: lookups(model, spec, rest, m))(micro)


def _masked_head(model, spec: Head, rest: dict, y, micro: dict, looked_up, real):
    """head's (terms, sums), zero where `real` is False."""
    out = head(model, spec, rest, y, micro, inputs=looked_up)
    return jax.tree.map(lambda a: jnp.where(real, a, jnp.zeros_like(a)), out)


def head_sums(model, spec: Head, rest: dict, hs, batch: dict, pp: int):
    """The (terms, sums) of the finished micro-batches hs [M, B, T, D] summed (forward only, under GSPMD), the
    micro-batches split over the pipeline devices as in head_loss."""
    per_device = _on_devices(lambda r, _, y, b, e, real: _masked_head(model, spec, r, y, b, e, real))

    def group(xs):
        y, b, real = xs
        return per_device(rest, {}, y, b, _group_lookups(model, spec, rest, b), real)  # [pp, ...]

    return jax.tree.map(lambda a: jnp.sum(a, (0, 1)), jax.lax.map(group, _groups(hs, batch, pp)))


def head_loss(model, spec: Head, rest: dict, hs, batch: dict, weights: dict, pp: int):
    """(the weighted sum of the terms, (terms, sums) summed over the micro-batches) of the finished micro-batches hs
    [M, B, T, D], under GSPMD.

    The head runs once per micro-batch rather than at every tick, with the micro-batches split over the pipeline
    devices, each device handling ceil(M / pp). Its gradient is computed in the forward pass and kept (custom_vjp),
    so the logits are neither stored for every micro-batch nor recomputed."""
    def weighted(r, w, y, b, e, real):
        out = _masked_head(model, spec, r, y, b, e, real)
        return _weighted(out[0], w), out

    per_device = _on_devices(jax.value_and_grad(weighted, argnums=(0, 2, 4), has_aux=True))
    _, micro, real = _groups(hs, batch, pp)
    like = jax.eval_shape(lambda y, b: head(model, spec, rest, y, b), hs[0], jax.tree.map(lambda a: a[0], batch))

    def forward(rest, hs):
        def group(acc, xs):
            y, b, is_real = xs
            looked_up, lookup_vjp = jax.vjp(lambda r: _group_lookups(model, spec, r, b), rest)
            (_, out), (d_rest, d_h, d_looked_up) = per_device(rest, weights, y, b, looked_up, is_real)  # [pp, ...]
            acc = jax.tree.map(lambda a, d: a + d.astype(jnp.float32), acc, (d_rest, out, lookup_vjp(d_looked_up)[0]))
            return acc, d_h

        f32 = lambda tree, *lead: jax.tree.map(lambda p: jnp.zeros((*lead, *p.shape), jnp.float32), tree)  # noqa: E731
        acc = (f32(rest, pp), f32(like, pp), f32(rest))  # per device partial sums [pp, ...]; the lookups' gradient
        (d_rest, out, d_lookups), d_hs = jax.lax.scan(group, acc, (_grouped(hs, pp), micro, real))
        d_rest = jax.tree.map(lambda a, e: a.sum(0) + e, d_rest, d_lookups)
        out = jax.tree.map(lambda a: a.sum(0), out)
        d_hs = d_hs.reshape(-1, *hs.shape[1:])[:hs.shape[0]]  # [G, pp, B, T, D] -> [M, B, T, D]
        return (_weighted(out[0], weights), out), (d_rest, d_hs)

    def backward(res, cotangents):
        d_rest, d_hs = res
        g = cotangents[0]
        return (jax.tree.map(lambda d, p: (g * d).astype(p.dtype), d_rest, rest), (g * d_hs).astype(hs.dtype))

    loss = jax.custom_vjp(lambda r, h: forward(r, h)[0])
    loss.defvjp(forward, backward)
    return loss(rest, hs)
