"""Fused FP4 quantize -> dequantize in one Pallas (Triton) pass: the fast path of `fp4.fake_quant`.

The input [R, C] is viewed as [R * C / B, B] (a free reshape), one quantization block per row, so each program
reads a contiguous [rows, B] tile once, computes block amaxes, scales, e2m1 codes and the dequantized values in
registers, and writes them once. The e2m1 rounding is arithmetic (round to nearest, ties to even, on the grid
0, 0.5, 1, 1.5, 2, 3, 4, 6; or stochastic, `fp4.round_e2m1_stochastic`): Triton has no fp4 type, and an opaque
kernel cannot be folded away by XLA.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from mjax.kernels.quant.fp4 import (BLOCKS, E2M1_MAX, E4M3_MAX, e8m0_round_up, global_scale, round_e2m1_stochastic,
                              uniform_hash)
from mjax.kernels.per_shard import per_shard

ROWS = 512  # quantization blocks per program


def round_e2m1(v):
    """|v| <= 6 -> nearest e2m1 value, ties to the even code (what an f32 -> e2m1 cast does)."""
    a = jnp.abs(v)
    q = jnp.where(a <= 0.25, 0.0,
        jnp.where(a < 0.75, 0.5,
        jnp.where(a <= 1.25, 1.0,
        jnp.where(a < 1.75, 1.5,
        jnp.where(a <= 2.5, 2.0,
        jnp.where(a < 3.5, 3.0,
        jnp.where(a <= 5.0, 4.0, 6.0)))))))  # fmt: skip
    return jnp.where(v < 0, -q, q)


def _kernel(x_ref, g_ref, o_ref, *, recipe: str, stochastic: bool):
    x = x_ref[...].astype(jnp.float32)  # [rows, B]
    block_amax = jnp.max(jnp.abs(x), axis=1)  # [rows]
    if recipe == "nvfp4":
        g = g_ref[0]
        s = jnp.clip(block_amax / g / E2M1_MAX, 0, E4M3_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32) * g
    else:
        s = e8m0_round_up(jnp.maximum(block_amax / E2M1_MAX, 2.0**-126))
    v = jnp.clip(x / jnp.where(s > 0, s, 1.0)[:, None], -E2M1_MAX, E2M1_MAX)
    if stochastic:  # the element's flat index in the [R, C] input: blocks are its contiguous rows of B
        rows, b = x.shape
        row = pl.program_id(0) * rows + lax.broadcasted_iota(jnp.int32, (rows, b), 0)
        index = row.astype(jnp.uint32) * jnp.uint32(b) + lax.broadcasted_iota(jnp.uint32, (rows, b), 1)
        q = round_e2m1_stochastic(v, uniform_hash(index, x))
    else:
        q = round_e2m1(v)
    o_ref[...] = (q * s[:, None]).astype(o_ref.dtype)


def _fake_quant_local(x, g, *, recipe: str, interpret: bool, stochastic: bool = False):
    """x [R, C] (C a multiple of the recipe's block), g [1] the NVFP4 tensor scale -> quantized-dequantized x."""
    b = BLOCKS[recipe]
    r, c = x.shape
    blocks = x.reshape(r * c // b, b)  # [R * C / B, B]: one quantization block per row
    n = blocks.shape[0]
    rows = min(ROWS, pl.next_power_of_2(n))
    pad = -n % rows
    if pad:
        blocks = jnp.pad(blocks, ((0, pad), (0, 0)))
    out = pl.pallas_call(
        functools.partial(_kernel, recipe=recipe, stochastic=stochastic),
        grid=(blocks.shape[0] // rows,),
        in_specs=[pl.BlockSpec((rows, b), lambda i: (i, 0)), pl.BlockSpec((1,), lambda i: (0,))],
        out_specs=pl.BlockSpec((rows, b), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct(blocks.shape, x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name=f"mjax_fp4_fake_quant_{recipe}",
    )(blocks, g)
    return out[:n].reshape(r, c)


@functools.cache
def _per_shard(recipe: str, interpret: bool, stochastic: bool):
    def local(x, g):
        return _fake_quant_local(x, g, recipe=recipe, interpret=interpret, stochastic=stochastic)

    return per_shard(local, "r c, s -> r c", replicated=("s",), multiple_of={"c": BLOCKS[recipe]})


@functools.partial(jax.jit, static_argnames=("recipe", "interpret", "stochastic"))
def fake_quant_pallas(x, *, recipe: str, interpret: bool = False, stochastic: bool = False):
    """x [R, C] (C a multiple of the recipe's block) -> quantized-dequantized [R, C] in x.dtype. Under a mesh each
    device runs its own shard; NVFP4's tensor scale comes from the whole x first. stochastic: as
    `fp4.fake_quant_reference` (bitwise, on one device; per shard the index is the shard's own)."""
    g = (global_scale(x) if recipe == "nvfp4" else jnp.ones((), jnp.float32)).reshape(1)
    return _per_shard(recipe, bool(interpret), bool(stochastic))(x, g)
