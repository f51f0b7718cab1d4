"""Logical axis names -> mesh axes, and the shardings of parameters, optimizer state and batches."""

import jax
from jax.sharding import NamedSharding, PartitionSpec

from mjax.model.sharding import logical_to_spec

BATCH_AXES = ("data", "fsdp", "expert")


def logical_rules(cfg) -> dict[str, tuple[str, ...]]:
    """The one table mapping logical names to mesh axes (see DESIGN.md)."""
    seq_parallel = cfg.parallel.sequence_parallel and cfg.parallel.tp > 1
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
        "experts": ("expert",),
    }


def param_shardings(mesh, logical_axes: dict, rules: dict, abstract_params: dict | None = None):
    """NamedShardings for a params tree. A dim not divisible by its mesh axes is left unsharded on that axis
    (e.g. KV heads fewer than tp are replicated)."""

    def one(axes, leaf=None):
        spec = logical_to_spec(axes, rules)
        if leaf is not None:
            spec = PartitionSpec(*(_fit(s, dim, mesh) for s, dim in zip(spec, leaf.shape)))
        return NamedSharding(mesh, spec)

    is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x)  # noqa: E731
    if abstract_params is None:
        return jax.tree.map(one, logical_axes, is_leaf=is_axes)
    return jax.tree.map(one, logical_axes, abstract_params, is_leaf=is_axes)


def _fit(spec_entry, dim: int, mesh):
    if spec_entry is None:
        return None
    axes = (spec_entry,) if isinstance(spec_entry, str) else tuple(spec_entry)
    size = 1
    for a in axes:
        size *= mesh.shape[a]
    return spec_entry if dim % size == 0 else None


def batch_sharding(mesh, ndim: int = 3, leading: bool = True) -> NamedSharding:
    """Train batches are [micro-batches, batch, seq] (`leading`), eval batches [batch, seq]: the batch dim is split
    over the data-parallel axes."""
    lead = (None,) if leading else ()
    return NamedSharding(mesh, PartitionSpec(*lead, BATCH_AXES, *([None] * (ndim - 1 - len(lead)))))


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def _dict_keys(path) -> tuple:
    return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))


def state_shardings(mesh, abstract_state, params_sharding: dict):
    """Shardings for any pytree holding params-shaped subtrees (optimizer moments): a leaf whose dict-key path
    ends with a parameter's path and has its shape gets that parameter's sharding; everything else is replicated."""
    by_path = {_dict_keys(p): s for p, s in jax.tree_util.tree_flatten_with_path(params_sharding)[0]}

    def one(path, leaf):
        keys = _dict_keys(path)
        for start in range(len(keys)):
            sharding = by_path.get(keys[start:])
            if sharding is not None and len(sharding.spec) <= len(getattr(leaf, "shape", ())):
                return sharding
        return replicated(mesh)

    return jax.tree_util.tree_map_with_path(one, abstract_state)
