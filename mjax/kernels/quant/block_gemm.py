"""Pallas (Triton) GEMM with blockwise FP8 scales: the fast path of `fp8_blockwise.block_gemm`.

Each program owns one [bm, bn] output tile and walks K in 128-wide blocks: an FP8 tensor-core product of the
[bm, 128] and [bn, 128] tiles, accumulated in f32 after multiplying by the row scales of A and column scales of B
for that k-block (DeepGEMM's "promotion" of each k-block's partial product to CUDA cores). B comes transposed,
[N, K]: Hopper's FP8 tensor cores read both operands K-major (the "TN" layout cuBLASLt also wants), and the
backward's operands are already laid out that way. Mixed FP8 types (hybrid format's e5m2 gradients) multiply in
f16. Scales are passed flattened k-block-major ([KB * M] and
[KB * N]) so each iteration loads two contiguous vectors.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from mjax.kernels.quant.blockwise import BLOCK
from mjax.kernels.per_shard import per_shard


@dataclasses.dataclass(frozen=True)
class GemmTiles:
    """Each k-block's product is scaled before it joins the accumulator, so a tile keeps two float32 [bm, bn]
    values in registers: the 128x64 tile with 4 warps measured fastest of eight tilings at every DeepSeek-V3
    linear-layer shape tried, 3 and 4 stages within 1% of each other (docs/deepseek.md)."""
    bm: int = 128
    bn: int = 64
    num_warps: int = 4
    num_stages: int = 4


DEFAULT_TILES = GemmTiles()


def _kernel(a_ref, bt_ref, sa_ref, sb_ref, o_ref, *, bm: int, bn: int, m: int, n: int, k_blocks: int):
    i, j = pl.program_id(0), pl.program_id(1)

    def body(kb, acc):
        start = pl.multiple_of(kb * BLOCK, BLOCK)
        a = a_ref[:, pl.ds(start, BLOCK)]  # [bm, 128] fp8
        bt = bt_ref[:, pl.ds(start, BLOCK)]  # [bn, 128] fp8
        sa = sa_ref[pl.ds(kb * m + i * bm, bm)]  # [bm] row scales of this k-block
        sb = sb_ref[pl.ds(kb * n + j * bn, bn)]  # [bn] column scales of this k-block
        if a.dtype != bt.dtype:
            # e5m2 gradient x e4m3 operand (--fp8_format=hybrid): Triton's dot takes one FP8 type, so both tiles go
            # up to f16, which holds every e4m3 and e5m2 value exactly (at the 16-bit tensor-core rate).
            a, bt = a.astype(jnp.float16), bt.astype(jnp.float16)
        p = lax.dot_general(a, bt, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)  # [bm, bn]
        return acc + p * sa[:, None] * sb[None, :]

    acc = lax.fori_loop(0, k_blocks, body, jnp.zeros((bm, bn), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _block_gemm_local(a, sa, bt, sb, *, out_dtype, interpret: bool, tiles: GemmTiles):
    (m, k), n = a.shape, bt.shape[0]
    bm, bn = min(tiles.bm, m), min(tiles.bn, n)
    if m % bm or n % bn or k % BLOCK:
        raise ValueError(f"block_gemm_pallas: shapes [{m}, {k}] x [{k}, {n}] must tile by ({bm}, {BLOCK}, {bn})")
    sa_flat = sa.T.reshape(-1)  # [K/128 * M], k-block major
    sb_flat = sb.reshape(-1)  # [K/128 * N]
    kernel = functools.partial(_kernel, bm=bm, bn=bn, m=m, n=n, k_blocks=k // BLOCK)
    return pl.pallas_call(
        kernel,
        grid=(m // bm, n // bn),
        in_specs=[pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
                  pl.BlockSpec((bn, k), lambda i, j: (j, 0)),
                  pl.BlockSpec(sa_flat.shape, lambda i, j: (0,)),
                  pl.BlockSpec(sb_flat.shape, lambda i, j: (0,))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="mjax_fp8_block_gemm",
    )(a, bt, sa_flat, sb_flat)


@functools.cache
def _per_shard(out_dtype, interpret: bool, tiles: GemmTiles):
    def local(a, sa, bt, sb):
        return _block_gemm_local(a, sa, bt, sb, out_dtype=out_dtype, interpret=interpret, tiles=tiles)

    # Rows of a and of bt stay sharded (whole tiles per shard); K, contracted, is gathered.
    return per_shard(local, "m k, m kb, n k, kb n -> m n", replicated=("k", "kb"),
                     multiple_of={"m": tiles.bm, "n": tiles.bn})


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "tiles"))
def block_gemm_pallas(a, sa, bt, sb, *, out_dtype, interpret: bool = False, tiles: GemmTiles = DEFAULT_TILES):
    """a [M, K] fp8, sa [M, K/128] f32, bt [N, K] fp8, sb [K/128, N] f32 -> a @ bt.T [M, N] out_dtype. Under a mesh
    each device computes its [M, N] tile of the output from its rows of a and bt."""
    return _per_shard(jnp.dtype(out_dtype), bool(interpret), tiles)(a, sa, bt, sb)
