"""Lower Pallas kernels through Triton for an abstract H200 on a machine without a GPU.

Interpreted kernels (the CPU tests) run the kernel body as plain JAX, so whatever only the Triton lowering rejects
(operand types of a dot, block shapes, unsupported ops, invalid IR) would first show up on the GPU. This runs that
lowering here and the MLIR verifier on every Triton module it produces.
"""

import jax
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

H200 = AbstractMesh((), (), abstract_device=AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132))


def lower_for_h200(f, *args) -> int:
    """Lowers jit(f)(*args) for CUDA; returns how many Triton modules were produced (each verified)."""
    try:
        from jax._src.pallas.triton import pallas_call_registration as registration  # noqa: PLC0415
    except ImportError as e:  # a private module: skip rather than break on a jax that moved it
        pytest.skip(f"jax internals moved: {e}")
    lower = registration.lowering.lower_jaxpr_to_triton_module
    verified = []

    def lower_and_verify(*a, **k):
        result = lower(*a, **k)
        with result.module.context:
            result.module.operation.verify()  # raises MLIRError on invalid IR
        verified.append(True)
        return result

    registration.lowering.lower_jaxpr_to_triton_module = lower_and_verify
    try:
        with jax.sharding.use_abstract_mesh(H200):
            jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower
    return len(verified)


def assert_grouped_fwd_bwd_lowers(fwd_bwd, rows: int, k: int, ns, groups: int, modules: int) -> None:
    """fwd_bwd(x, ws, group_sizes, metas, dys) of a grouped matmul over weights [groups, k, n] for n in ns lowers to
    `modules` Triton modules, alone and under jax.vmap over two dispatch groups (as MoE runs it)."""
    import jax.numpy as jnp  # noqa: PLC0415

    args = (jnp.zeros((rows, k), jnp.bfloat16), tuple(jnp.zeros((groups, k, n)) for n in ns),
            jnp.zeros((groups,), jnp.int32), tuple(jnp.ones((groups, 3)) for _ in ns),
            tuple(jnp.zeros((rows, n), jnp.bfloat16) for n in ns))
    assert lower_for_h200(fwd_bwd, *args) == modules
    batched = jax.vmap(fwd_bwd, in_axes=(0, None, 0, None, 0))  # MoE's dispatch groups
    args = (jnp.zeros((2,) + args[0].shape, jnp.bfloat16), args[1], jnp.zeros((2, groups), jnp.int32), args[3],
            tuple(jnp.zeros((2,) + d.shape, jnp.bfloat16) for d in args[4]))
    assert lower_for_h200(batched, *args) == modules
