"""Logical axis names -> mesh axes, and the shardings of parameters, optimizer state and batches."""

import jax
from jax.sharding import NamedSharding, PartitionSpec

from mjax.sharding import logical_to_spec

BATCH_AXES = ("data", "fsdp", "expert")


def logical_rules(cfg) -> dict[str, tuple[str, ...]]:
    """The one table mapping logical names to mesh axes (docs/design.md)."""
    seq_parallel = cfg.parallel.sequence_parallel and cfg.parallel.tp > 1
    # MoE parallel folding: with --expert_tensor_parallel_size=1 the experts are split over expert x tensor.
    expert_tp = cfg.parallel.expert_tensor_parallel_size in (None, cfg.parallel.tp)
    return {
        "batch": BATCH_AXES,
        "seq": ("context",),
        "residual_seq": ("context", "tensor") if seq_parallel else ("context",),
        "act_embed": (),
        "embed": ("fsdp",),
        "heads": ("tensor",),
        "kv_heads": ("tensor",),
        "mlp": ("tensor",),
        "vocab": ("tensor",),
        "head_dim": (),
        "norm": (),
        "layers": ("pipeline",),
        "experts": ("expert",) if expert_tp else ("expert", "tensor"),
        "expert_mlp": ("tensor",) if expert_tp else (),
    }


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x)


def param_shardings(mesh, logical_axes: dict, rules: dict, abstract_params: dict):
    """NamedShardings for a params tree (dims not divisible by their mesh axes stay unsharded). A layer stack whose
    layer count does not divide over `pipeline` (an uneven pipeline split) is split over it on another dim, so each
    pipeline device still stores 1 / pp of it (mjax/parallel/pipeline_placement.py moves the layers to their stage)."""
    def one(axes, leaf):
        sharding = NamedSharding(mesh, logical_to_spec(axes, rules, leaf.shape, mesh))
        return add_axis(sharding, leaf.shape, "pipeline") if "layers" in axes and "pipeline" in mesh.shape else sharding

    return jax.tree.map(one, logical_axes, abstract_params, is_leaf=_is_axes)


def add_axis(sharding: NamedSharding, shape, axis: str) -> NamedSharding:
    """Also shard over mesh `axis` (ZeRO-1): on the first dim that stays divisible, else unchanged."""
    mesh, spec = sharding.mesh, list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    if mesh.shape[axis] == 1 or any(axis in ((e,) if isinstance(e, str) else (e or ())) for e in spec):
        return sharding
    for i, entry in enumerate(spec):
        current = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
        size = mesh.shape[axis]
        for a in current:
            size *= mesh.shape[a]
        if shape[i] % size == 0:
            spec[i] = (axis, *current) if current else axis
            return NamedSharding(mesh, PartitionSpec(*spec))
    return sharding


def batch_sharding(mesh, ndim: int = 3, leading: bool = True) -> NamedSharding:
    """Train batches are [micro-batches, batch, seq] (`leading`), eval batches [batch, seq]: the batch dim is split
    over the data-parallel axes."""
    lead = (None,) if leading else ()
    return NamedSharding(mesh, PartitionSpec(*lead, BATCH_AXES, *([None] * (ndim - 1 - len(lead)))))


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def _dict_keys(path) -> tuple:
    return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))


def state_shardings(mesh, abstract_state, params_sharding: dict, zero1: bool = False):
    """Shardings of the train state. `params` keep their own; a leaf elsewhere (optimizer moments) whose dict-key
    path ends with a parameter's path and has its shape gets that parameter's sharding, additionally split over
    the `data` and `context` axes with ZeRO-1 (the ranks holding the same parameters: Megatron's distributed
    optimizer shards over dp x cp); everything else is replicated."""
    flat = jax.tree_util.tree_flatten_with_path(params_sharding)[0]
    by_path = {_dict_keys(p): s for p, s in flat}

    def one(path, leaf):
        keys = _dict_keys(path)
        in_params = any(getattr(k, "name", None) == "params" for k in path)
        for start in range(len(keys)):
            sharding = by_path.get(keys[start:])
            if sharding is not None and len(sharding.spec) <= len(getattr(leaf, "shape", ())):
                if zero1 and not in_params:
                    for axis in ("data", "context"):
                        sharding = add_axis(sharding, leaf.shape, axis)
                return sharding
        return replicated(mesh)

    return jax.tree_util.tree_map_with_path(one, abstract_state)


def bytes_per_device(abstract_tree, shardings) -> int:
    """Bytes one device holds of a tree placed with `shardings` (the largest shard of each leaf)."""
    total = 0
    for leaf, sharding in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(shardings)):
        shape = sharding.shard_shape(leaf.shape)
        n = 1
        for d in shape:
            n *= d
        total += n * leaf.dtype.itemsize
    return total
