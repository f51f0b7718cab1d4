"""Logical axis names on parameters and activations. The model names axes; `mjax.parallel` maps them to a mesh.

Parameters carry `logical_axes` metadata. Activations go through `constrain`, a no-op until a mesh and rules are
set with `logical_sharding(mesh, rules)` (done by mjax.parallel, never by model code).
"""

import contextlib
import contextvars
import math

import flax
import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

# Variables are created unsharded; mjax places them itself from the logical names (see mjax.parallel).
flax.config.update("flax_always_shard_variable", False)

_CONTEXT = contextvars.ContextVar("mjax_logical_sharding", default=None)


def param(value, axes: tuple[str | None, ...]) -> nnx.Param:
    if len(axes) != value.ndim:
        raise ValueError(f"logical axes {axes} do not match a parameter of shape {value.shape}")
    return nnx.Param(value, logical_axes=tuple(axes))


def logical_to_spec(axes, rules: dict, shape=None, mesh=None) -> PartitionSpec:
    """Maps logical names to mesh axes. A mesh axis is used at most once (later uses are left unsharded); with
    `shape` and `mesh`, a dim not divisible by its mesh axes stays unsharded (e.g. KV heads fewer than tp are
    replicated) and its mesh axes stay free for later dims."""
    used, spec = set(), []
    for i, name in enumerate(axes):
        mesh_axes = tuple(a for a in (rules.get(name) or ()) if a not in used)
        if shape is not None and mesh_axes:
            size = 1
            for a in mesh_axes:
                size *= mesh.shape[a]
            if shape[i] % size:
                mesh_axes = ()
        used.update(mesh_axes)
        spec.append(mesh_axes[0] if len(mesh_axes) == 1 else (mesh_axes or None))
    return PartitionSpec(*spec)


@contextlib.contextmanager
def logical_sharding(mesh, rules: dict):
    token = _CONTEXT.set((mesh, rules))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def current_logical_sharding():
    """The (mesh, rules) set by `logical_sharding`, or None."""
    return _CONTEXT.get()


def shards(name: str) -> int:
    """How many shards the mesh axes of logical name `name` split a dim into (1 when no mesh is set)."""
    ctx = _CONTEXT.get()
    if ctx is None:
        return 1
    mesh, rules = ctx
    return math.prod(mesh.shape[a] for a in rules.get(name) or ())


def splits_evenly(name: str, size: int) -> bool:
    """Whether a dim of `size` with logical name `name` divides over its mesh axes (True when no mesh is set)."""
    ctx = _CONTEXT.get()
    if ctx is None:
        return True
    mesh, rules = ctx
    return size % math.prod(mesh.shape[a] for a in rules.get(name) or ()) == 0


def constrain(x, axes: tuple[str | None, ...]):
    """Sharding constraint by logical names; identity when no mesh is active."""
    ctx = _CONTEXT.get()
    if ctx is None:
        return x
    mesh, rules = ctx
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(axes, rules, x.shape, mesh)))
