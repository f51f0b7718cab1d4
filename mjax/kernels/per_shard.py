"""Run a Pallas kernel on each device's shard under a mesh.

GSPMD cannot see into a kernel's custom call, so left alone it gathers every operand onto every device (correct,
but a whole activation per device). `per_shard` wraps the kernel in `custom_partitioning` with an einsum-like
rule naming each operand and result dimension, e.g. "i j, s -> i j, j i": a dimension keeps its operand's mesh axes
in the results, unless it is listed in `replicated` (a contracted dimension, a scale) or its shard would not be a
whole number of the kernel's blocks (`multiple_of`), in which case it is gathered first. `adjust` has the last say
(a kernel that takes one dimension split only together with another); `shard_index` tells the kernel which shard
of a dimension it holds; a result that each shard holds only part of is combined over the other shards
(`max_over_shards`, `sum_over_shards`).

Inside a shard_map manual over some mesh axes (the pipeline's), the partitioner passes no mesh, only shardings over
the other axes; they are read against the mesh the call was traced under, so the kernel runs per shard there too.
Inside a shard_map whose other axes all have size 1, the kernel runs on the device's arrays directly.
`custom_partitioning` has no autodiff rule: a differentiable kernel wraps its forward and backward each.
"""

import math
from typing import Any, NamedTuple

import jax
import numpy as np
from jax import lax
from jax._src.sharding_impls import parse_flatten_op_sharding  # the decoding custom_partitioning itself uses
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


class Shard(NamedTuple):
    """Which shard of a dimension a device holds: index in [0, count) (traced int32, or 0 off the mesh)."""

    index: Any
    count: int


def _parse(rule: str) -> tuple[list[list[str]], list[list[str]]]:
    ins, outs = rule.split("->")
    return [t.split() for t in ins.split(",")], [t.split() for t in outs.split(",")]


def _as_tuple(mesh_axes) -> tuple[str, ...]:
    return () if mesh_axes is None else (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)


def _meshes_and_specs(traced, mesh, arg_shapes):
    """(the mesh to lower the shard's function on, the mesh the shardings name, each operand's PartitionSpec)."""
    shardings = [a.sharding for a in arg_shapes]
    if not mesh.empty:
        return mesh, mesh, [s.spec if isinstance(s, NamedSharding) else P() for s in shardings]
    devices = shardings[0]._device_assignment
    if traced.empty or len(devices) != traced.size:  # no mesh to read the shardings against: gather everything
        return mesh, mesh, [P()] * len(shardings)
    # Inside a shard_map the shardings name only the axes that are not manual, over the devices of one manual
    # group in mesh order; collectives and axis_index need the whole mesh (global device ids).
    auto = [(a, n) for a, n, t in zip(traced.axis_names, traced.axis_sizes, traced.axis_types) if t != AxisType.Manual]
    shape = tuple(n for _, n in auto)
    local = Mesh(np.array(devices[:math.prod(shape)]).reshape(shape), tuple(a for a, _ in auto))
    whole = Mesh(np.array(devices).reshape(traced.axis_sizes), traced.axis_names)
    return whole, local, [parse_flatten_op_sharding(s._hlo_sharding, local)[0] for s in shardings]


def per_shard(local_fn, rule: str, *, replicated: tuple[str, ...] = (), multiple_of: dict | None = None,
              max_over_shards: tuple[int, ...] = (), sum_over_shards: tuple[int, ...] = (),
              shard_index: tuple[str, ...] = (), adjust=None):
    """local_fn(*arrays) -> array or tuple of arrays, correct on the whole arrays and on any one shard of them.

    shard_index: factors whose `Shard` local_fn receives as `shards={factor: Shard}` (Shard(0, 1) when unsplit).
    adjust(axes, sizes, mesh_shape) -> axes: given each factor's mesh axes (a tuple, or None when whole), the
    factors' sizes and the mesh's axis sizes, the axes to use (None gathers that factor first).
    max_over_shards / sum_over_shards: results (by position) that each shard holds only its part of, made the whole
    array's by a max / sum over the mesh axes the operands are split on and that result is not."""
    ins, outs = _parse(rule)
    multiple_of = multiple_of or {}

    def call(args, shards):
        return local_fn(*args, shards=shards) if shard_index else local_fn(*args)

    def whole_arrays(traced, *args):  # the function off the mesh (one device, or every axis manual)
        del traced
        return call(args, {f: Shard(0, 1) for f in shard_index})

    def factor_axes(mesh, specs, arg_shapes) -> dict:
        axes, sizes = dict.fromkeys(replicated), {}  # including factors only the results have (a new dim's size)
        for dims, spec, arg in zip(ins, specs, arg_shapes):
            spec = tuple(spec) + (None,) * (len(dims) - len(spec))
            for factor, mesh_axes, size in zip(dims, spec, arg.shape):
                sizes.setdefault(factor, size)
                if factor in axes:
                    continue
                mesh_axes = _as_tuple(mesh_axes) or None
                if factor in replicated or mesh_axes is None:
                    axes[factor] = None
                    continue
                shards = math.prod(mesh.shape[a] for a in mesh_axes)
                whole = size % shards == 0 and (size // shards) % multiple_of.get(factor, 1) == 0
                axes[factor] = mesh_axes if whole else None
        return adjust(axes, sizes, dict(mesh.shape)) if adjust else axes

    def shardings(mesh, axes, groups):
        return tuple(NamedSharding(mesh, P(*(axes[f] for f in dims))) for dims in groups)

    def results(mesh, axes):
        out = shardings(mesh, axes, outs)
        return out if len(outs) > 1 else out[0]

    def infer(traced, mesh, arg_shapes, result_shape):
        _, named, specs = _meshes_and_specs(traced, mesh, arg_shapes)
        return results(named, factor_axes(named, specs, arg_shapes))

    def partition(traced, mesh, arg_shapes, result_shape):
        lowering, named, specs = _meshes_and_specs(traced, mesh, arg_shapes)
        axes = factor_axes(named, specs, arg_shapes)
        split = set().union(*(_as_tuple(a) for a in axes.values()))

        def lower(*args):  # traced with the lowering mesh's axes bound
            shards = {f: Shard(lax.axis_index(axes[f]) if axes[f] else 0,
                               math.prod(named.shape[a] for a in _as_tuple(axes[f]))) for f in shard_index}
            out = call(args, shards)
            combined = list(out) if len(outs) > 1 else [out]
            for i, dims in enumerate(outs):
                kept = set().union(*(_as_tuple(axes[f]) for f in dims))
                over = tuple(a for a in named.axis_names if a in split - kept)
                if over and i in max_over_shards:
                    combined[i] = lax.pmax(combined[i], over)
                elif over and i in sum_over_shards:
                    combined[i] = lax.psum(combined[i], over)
            return tuple(combined) if len(outs) > 1 else combined[0]

        return lowering, lower, results(named, axes), shardings(named, axes, ins)

    order = list(dict.fromkeys(f for dims in ins + outs for f in dims))  # Shardy takes them in the rule's order
    op = custom_partitioning(whole_arrays, static_argnums=(0,))
    op.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                     need_replication_factors=tuple(sorted(replicated, key=order.index)))
    def run(*args):
        context = jax.sharding.get_abstract_mesh()
        if _all_manual(context):  # every axis that splits anything is manual here: the arrays are this device's
            return whole_arrays(context, *args)
        return op(context, *args)

    return run


def _all_manual(context) -> bool:
    """Inside a shard_map whose auto axes all have size 1, custom_partitioning sees only manual shardings, which
    it cannot take (jax 0.11/0.12 assert): there is nothing left to partition."""
    if context.empty:
        return False
    kinds = list(zip(context.axis_sizes, context.axis_types))
    return any(t == AxisType.Manual for _, t in kinds) and all(t == AxisType.Manual or n == 1 for n, t in kinds)
