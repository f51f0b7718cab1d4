"""Run a Pallas kernel on each device's shard under a mesh.

GSPMD cannot see into a kernel's custom call, so left alone it gathers every operand onto every device (correct,
but a whole activation per device). `per_shard` wraps the kernel in `custom_partitioning` with an einsum-like
rule naming each operand and result dimension, e.g. "i j, s -> i j, j i": a dimension keeps its operand's mesh axes
in the results, unless it is listed in `replicated` (a contracted dimension, a scale) or its shard would not be a
whole number of the kernel's blocks (`multiple_of`), in which case it is gathered first.
"""

import math

from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def _parse(rule: str) -> tuple[list[list[str]], list[list[str]]]:
    ins, outs = rule.split("->")
    return [t.split() for t in ins.split(",")], [t.split() for t in outs.split(",")]


def per_shard(local_fn, rule: str, *, replicated: tuple[str, ...] = (), multiple_of: dict | None = None,
              max_over_shards: tuple[int, ...] = ()):
    """local_fn(*arrays) -> array or tuple of arrays, correct on the whole arrays and on any one shard of them.
    Results listed in `max_over_shards` (by position; replicated factors only) are a shard's maximum, made the
    whole array's by a max over the devices holding the other shards."""
    ins, outs = _parse(rule)
    multiple_of = multiple_of or {}

    def factor_axes(mesh, arg_shapes) -> dict:
        axes = dict.fromkeys(replicated)  # including factors only the results have (a new dimension's size)
        for dims, arg in zip(ins, arg_shapes):
            spec = arg.sharding.spec if isinstance(arg.sharding, NamedSharding) else P()
            spec = tuple(spec) + (None,) * (len(dims) - len(spec))
            for factor, mesh_axes, size in zip(dims, spec, arg.shape):
                if factor in axes:
                    continue
                if factor in replicated or mesh_axes is None:
                    axes[factor] = None
                    continue
                shards = math.prod(mesh.shape[a] for a in (mesh_axes if isinstance(mesh_axes, tuple) else (mesh_axes,)))
                whole = size % shards == 0 and (size // shards) % multiple_of.get(factor, 1) == 0
                axes[factor] = mesh_axes if whole else None
        return axes

    def shardings(mesh, axes, groups):
        return tuple(NamedSharding(mesh, P(*(axes[f] for f in dims))) for dims in groups)

    def results(mesh, axes):
        out = shardings(mesh, axes, outs)
        return out if len(outs) > 1 else out[0]

    def infer(mesh, arg_shapes, result_shape):
        return results(mesh, factor_axes(mesh, arg_shapes))

    def partition(mesh, arg_shapes, result_shape):
        axes = factor_axes(mesh, arg_shapes)
        sharded = tuple(dict.fromkeys(a for f in axes.values() if f is not None
                                      for a in (f if isinstance(f, tuple) else (f,))))
        lower = local_fn
        if max_over_shards and sharded:
            def lower(*args):
                out = local_fn(*args)
                return tuple(lax.pmax(o, sharded) if i in max_over_shards else o for i, o in enumerate(out))
        return mesh, lower, results(mesh, axes), shardings(mesh, axes, ins)

    op = custom_partitioning(local_fn)
    op.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                     need_replication_factors=tuple(replicated))
    return op
