"""The device mesh: axes (pipeline, data, fsdp, expert, context, tensor), outermost first, as Megatron's rank order."""

import jax
import numpy as np
from jax.sharding import Mesh

from mjax.parallel.layout import resolve_data_parallel

AXES = ("pipeline", "data", "fsdp", "expert", "context", "tensor")


def mesh_shape(cfg, num_devices: int) -> dict[str, int]:
    p = cfg.parallel
    dp = resolve_data_parallel(cfg, num_devices)
    return {"pipeline": p.pp, "data": dp, "fsdp": p.fsdp, "expert": p.ep, "context": p.cp, "tensor": p.tp}


def make_mesh(cfg, devices=None) -> Mesh:
    """A mesh over all devices (or `devices`); tensor is innermost so it stays within a node."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(cfg, len(devices))
    grid = np.array(devices).reshape(tuple(shape.values()))
    return Mesh(grid, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def describe(mesh: Mesh) -> str:
    return " x ".join(f"{name}={size}" for name, size in mesh.shape.items())
