"""Quantize to FP8 and write both layouts in one pass (Transformer Engine's cast-transpose), in Pallas (Triton).

cuBLASLt's FP8 GEMMs read both operands K-major, so a linear layer needs x as [M, K] (forward) and [K, M] (wgrad),
w as [N, K] (forward) and [K, N] (dgrad), and its output gradient as [M, N] (dgrad) and [N, M] (wgrad). Left to
XLA, the transposed copy is a pass of its own over the FP8 tensor (and XLA re-derives it that way even when the
code asks for quantize(x.T)); weights came out at ~300 GB/s. Here each program reads one [64, 256] tile once and
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

# [rows, cols] of a tile. Measured on an H200 against 128 x 128 (the square tile): 3,749 vs 3,560 GB/s on
# [32768, 16384] bf16, 3,578 vs 3,350 on [32768, 3072], 3,376 vs 3,003 on an f32 [3072, 16384] weight; a copy
# of the same bytes ran at 3,213-4,012 (docs/fp8.md).
TILE = (64, 256)


def _kernel(x_ref, s_ref, q_ref, qt_ref, *, fmax: float):
    v = jnp.clip(x_ref[...].astype(jnp.float32) * s_ref[0], -fmax, fmax)  # [64, 256]
    q_ref[...] = v.astype(q_ref.dtype)
    qt_ref[...] = v.T.astype(qt_ref.dtype)


def cast_transpose_local(x, scale, *, dtype, interpret: bool, tile=TILE, num_warps: int = 8):
    """x [R, C], scale [1] f32 -> (saturate(x * scale) [R, C], its transpose [C, R]), both `dtype`. `tile` and
    `num_warps` are parameters for the sweep in scripts/bench_fp8.py (--sections=ct_tiles)."""
    r, c = x.shape
    br, bc = tile
    rp, cp = -(-r // br) * br, -(-c // bc) * bc
    xp = jnp.pad(x, ((0, rp - r), (0, cp - c))) if (rp, cp) != (r, c) else x  # [Rp, Cp]
    q, qt = pl.pallas_call(
        functools.partial(_kernel, fmax=float(jnp.finfo(dtype).max)),
        grid=(rp // br, cp // bc),
        in_specs=[pl.BlockSpec((br, bc), lambda i, j: (i, j)), pl.BlockSpec((1,), lambda i, j: (0,))],
        out_specs=[pl.BlockSpec((br, bc), lambda i, j: (i, j)),
                   pl.BlockSpec((bc, br), lambda i, j: (j, i))],
        out_shape=[jax.ShapeDtypeStruct((rp, cp), dtype), jax.ShapeDtypeStruct((cp, rp), dtype)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="mjax_fp8_cast_transpose",
    )(xp, scale)
    return q[:r, :c], qt[:c, :r]


@functools.cache
def _per_shard(dtype, interpret: bool):
    def local(x, scale):
        return cast_transpose_local(x, scale, dtype=dtype, interpret=interpret)

    return per_shard(local, "i j, s -> i j, j i", replicated=("s",))


def cast_transpose(x, scale, dtype, *, interpret: bool = False):
    """x [R, C] (any float dtype), scale f32 scalar -> (q [R, C], q^T [C, R]) in `dtype`, q = saturate(x * scale):
    the same values as `fp8.quantize(x, scale, dtype)` and its transpose."""
    return _per_shard(jnp.dtype(dtype), bool(interpret))(x, jnp.reshape(scale.astype(jnp.float32), (1,)))
