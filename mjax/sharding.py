"""Logical axis names on parameters and activations. The model names axes; `mjax.parallel` maps them to a mesh.

Parameters carry `logical_axes` metadata. Activations go through `constrain`, which applies the rules set with
`logical_sharding(mesh, rules)` (done by mjax.parallel and the training loop, never by model code). A trace (jit,
grad) through `constrain` with no rules set raises instead of silently dropping every activation sharding: code that
runs the model on one device on purpose says so with `single_device()`. Eager calls need neither.
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


def single_device():
    """The context of a trace that runs the model unsharded on purpose (one device, no mesh)."""
    return logical_sharding(None, {})


def current_logical_sharding():
    """The (mesh, rules) set by `logical_sharding`, or None; (None, {}) under `single_device()`."""
    return _CONTEXT.get()


def _mesh_and_rules():
    ctx = _CONTEXT.get()
    return (None, {}) if ctx is None else ctx


def shards(name: str) -> int:
    """How many shards the mesh axes of logical name `name` split a dim into (1 without a mesh)."""
    mesh, rules = _mesh_and_rules()
    return 1 if mesh is None else math.prod(mesh.shape[a] for a in rules.get(name) or ())


def splits_evenly(name: str, size: int) -> bool:
    """Whether a dim of `size` with logical name `name` divides over its mesh axes (True without a mesh)."""
    return size % shards(name) == 0


def constrain(x, axes: tuple[str | None, ...]):
    """Sharding constraint by logical names; identity on one device (`single_device()`) and in eager calls."""
    ctx = _CONTEXT.get()
    if ctx is None:
        if isinstance(x, jax.core.Tracer):
            raise RuntimeError(
                f"a traced array with logical axes {axes} met no sharding rules: trace the model inside "
                "mjax.sharding.logical_sharding(mesh, rules) (mjax.parallel.rules.logical_rules gives the table), or "
                "inside mjax.sharding.single_device() to run it on one device on purpose")
        return x
    mesh, rules = ctx
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(axes, rules, x.shape, mesh)))
