"""Quantize to FP8 and write both layouts in one pass (Transformer Engine's cast-transpose), in Pallas (Triton).

cuBLASLt's FP8 GEMMs read both operands K-major, so a linear layer needs x as [M, K] (forward) and [K, M] (wgrad),
w as [N, K] (forward) and [K, N] (dgrad), and its output gradient as [M, N] (dgrad) and [N, M] (wgrad). Left to
XLA, the transposed copy is a pass of its own over the FP8 tensor (and XLA re-derives it that way even when the
code asks for quantize(x.T)), slowest for the weights (docs/fp8.md). Here each program reads one [64, 256] tile once and
writes the quantized tile and its transpose.

Sharding: `per_shard` with the rule "i j, s -> i j, j i", so under a mesh each device quantizes its own shard and
the transposed copy is sharded transposed (no gather).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from mjax.kernels.per_shard import per_shard

# [rows, cols] of a tile: faster on a GPU than the square 128 x 128 on the activation, gradient and f32 weight shapes
# of a step (the sweep is in docs/fp8.md).
TILE = (64, 256)


def _kernel(x_ref, s_ref, q_ref, qt_ref, *amax_ref, fmax: float):
    x = x_ref[...].astype(jnp.float32)  # [64, 256]
    v = jnp.clip(x * s_ref[0], -fmax, fmax)
    q_ref[...] = v.astype(q_ref.dtype)
    qt_ref[...] = v.T.astype(qt_ref.dtype)
    if amax_ref:  # the tile's max |x|, NaN counted as inf (either way not finite, as the reference's NaN)
        amax_ref[0][...] = jnp.max(jnp.where(x != x, jnp.inf, jnp.abs(x))).reshape(1, 1)


def cast_transpose_local(x, scale, *, dtype, interpret: bool, with_amax: bool = False, tile=TILE,
                         num_warps: int = 8):
    """x [R, C], scale [1] f32 -> (saturate(x * scale) [R, C], its transpose [C, R]), both `dtype`, and with_amax:
    max |x| [1] f32 too, from the same pass. `tile` and `num_warps` are parameters for the sweep in
    `python -m benchmarks.bench_fp8 --sections=ct_tiles`."""
    r, c = x.shape
    br, bc = tile
    rp, cp = -(-r // br) * br, -(-c // bc) * bc
    xp = jnp.pad(x, ((0, rp - r), (0, cp - c))) if (rp, cp) != (r, c) else x  # [Rp, Cp]; zeros leave the max
    grid = (rp // br, cp // bc)
    out_specs = [pl.BlockSpec((br, bc), lambda i, j: (i, j)), pl.BlockSpec((bc, br), lambda i, j: (j, i))]
    out_shape = [jax.ShapeDtypeStruct((rp, cp), dtype), jax.ShapeDtypeStruct((cp, rp), dtype)]
    if with_amax:
        out_specs.append(pl.BlockSpec((1, 1), lambda i, j: (i, j)))
        out_shape.append(jax.ShapeDtypeStruct(grid, jnp.float32))  # one max per tile
    out = pl.pallas_call(
        functools.partial(_kernel, fmax=float(jnp.finfo(dtype).max)),
        grid=grid,
        in_specs=[pl.BlockSpec((br, bc), lambda i, j: (i, j)), pl.BlockSpec((1,), lambda i, j: (0,))],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="mjax_fp8_cast_transpose",
    )(xp, scale)
    q, qt = out[0][:r, :c], out[1][:c, :r]
    return (q, qt, jnp.max(out[2]).reshape(1)) if with_amax else (q, qt)


@functools.cache
def _per_shard(dtype, interpret: bool, with_amax: bool):
    def local(x, scale):
        return cast_transpose_local(x, scale, dtype=dtype, interpret=interpret, with_amax=with_amax)

    if with_amax:  # the amax is the max over every shard's
        return per_shard(local, "i j, s -> i j, j i, a", replicated=("s", "a"), max_over_shards=(2,))
    return per_shard(local, "i j, s -> i j, j i", replicated=("s",))


def cast_transpose(x, scale, dtype, *, interpret: bool = False, with_amax: bool = False):
    """x [R, C] (any float dtype), scale f32 scalar -> (q [R, C], q^T [C, R]) in `dtype`, q = saturate(x * scale):
    the same values as `fp8.quantize(x, scale, dtype)` and its transpose; with_amax: also max |x| (f32 scalar)."""
    out = _per_shard(jnp.dtype(dtype), bool(interpret), bool(with_amax))(
        x, jnp.reshape(scale.astype(jnp.float32), (1,)))
    return (*out[:2], out[2][0]) if with_amax else out
