"""Quantize to FP8 and write both layouts in one pass (Transformer Engine's cast-transpose), in Pallas (Triton).

cuBLASLt's FP8 GEMMs read both operands K-major, so a linear layer needs x as [M, K] (forward) and [K, M] (wgrad),
w as [N, K] (forward) and [K, N] (dgrad), and its output gradient as [M, N] (dgrad) and [N, M] (wgrad). Left to
XLA, the transposed copy is a pass of its own over the FP8 tensor (and XLA re-derives it that way even when the
code asks for quantize(x.T)); weights came out at ~300 GB/s. Here each program reads one [B, B] tile once and writes
the quantized tile and its transpose.

Sharding: `per_shard` with the rule "i j, s -> i j, j i", so under a mesh each device quantizes its own shard and
the transposed copy is sharded transposed (no gather).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from mjax.kernels.per_shard import per_shard

BLOCK = 128  # tile side: 128 FP8 bytes per stored row in both layouts


def _kernel(x_ref, s_ref, q_ref, qt_ref, *, fmax: float):
    v = jnp.clip(x_ref[...].astype(jnp.float32) * s_ref[0], -fmax, fmax)  # [B, B]
    q_ref[...] = v.astype(q_ref.dtype)
    qt_ref[...] = v.T.astype(qt_ref.dtype)


def _cast_transpose_local(x, scale, *, dtype, interpret: bool):
    """x [R, C], scale [1] f32 -> (saturate(x * scale) [R, C], its transpose [C, R]), both `dtype`."""
    r, c = x.shape
    rp, cp = -(-r // BLOCK) * BLOCK, -(-c // BLOCK) * BLOCK
    xp = jnp.pad(x, ((0, rp - r), (0, cp - c))) if (rp, cp) != (r, c) else x  # [Rp, Cp]
    q, qt = pl.pallas_call(
        functools.partial(_kernel, fmax=float(jnp.finfo(dtype).max)),
        grid=(rp // BLOCK, cp // BLOCK),
        in_specs=[pl.BlockSpec((BLOCK, BLOCK), lambda i, j: (i, j)), pl.BlockSpec((1,), lambda i, j: (0,))],
        out_specs=[pl.BlockSpec((BLOCK, BLOCK), lambda i, j: (i, j)),
                   pl.BlockSpec((BLOCK, BLOCK), lambda i, j: (j, i))],
        out_shape=[jax.ShapeDtypeStruct((rp, cp), dtype), jax.ShapeDtypeStruct((cp, rp), dtype)],
        compiler_params=pltriton.CompilerParams(num_warps=8, num_stages=1),
        interpret=interpret,
        name="mjax_fp8_cast_transpose",
    )(xp, scale)
    return q[:r, :c], qt[:c, :r]


@functools.cache
def _per_shard(dtype, interpret: bool):
    def local(x, scale):
        return _cast_transpose_local(x, scale, dtype=dtype, interpret=interpret)

    return per_shard(local, "i j, s -> i j, j i", replicated=("s",))


def cast_transpose(x, scale, dtype, *, interpret: bool = False):
    """x [R, C] (any float dtype), scale f32 scalar -> (q [R, C], q^T [C, R]) in `dtype`, q = saturate(x * scale):
    the same values as `fp8.quantize(x, scale, dtype)` and its transpose."""
    return _per_shard(jnp.dtype(dtype), bool(interpret))(x, jnp.reshape(scale.astype(jnp.float32), (1,)))
