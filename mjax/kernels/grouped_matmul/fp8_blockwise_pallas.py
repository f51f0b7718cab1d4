"""The blockwise FP8 grouped-matmul kernels (Pallas, Triton lowering): FP8 operands into the dot 128 deep at a time,
each step's float32 product multiplied by its block scales before it joins the float32 accumulator (DeepGEMM's
"promotion"), the output in the compute dtype. Interpreted off GPU. Scales are dequantization factors (x ~= q * s).

    forward  y  [M, N] = sum_kb (xq[:, kb] . wq_t[g][:, kb]^T) * sx[kb, rows] * sw[g, kb, cols]    row_block
    dgrad    dx [M, K] = sum_nb (gq[:, nb] . wq[g][:, nb]^T)   * sg[nb, rows] * sw^T[g, nb, cols]  row_block
    wgrad    dw [G, K, N] = sum over g's pieces t of (xq_t[:, t] . gq_t[:, t]^T) * sxt[t, K] * sgt[t, N]  wgrad

Every operand is read with its contracted dimension contiguous (K-major), as Hopper's FP8 MMAs want. A row scale
(1x128 block of x or dy) is one value per row and depth step, passed depth-major ([KB, M] flattened) so a step
loads one contiguous vector; a 128x128 weight block's scale is repeated over its 128 output columns ([G, KB, C]),
so any column tile reads one vector too.

forward and dgrad walk the row-block visits of schedule.row_tiles as the 16-bit kernels do (pallas.py): a block
that straddles groups is visited once per group, loads and computes all its rows and stores only the group's.

wgrad walks group g's rows in the aligned 128-row chunks that hold them. The chunk's rows of g are one
quantization piece of the transposed operands (fp8_blockwise.py: pieces are aligned 128-row blocks cut at group
boundaries, so no scale mixes two groups' rows); `pieces` [3, G] holds each group's row bounds and the index of
its first piece, and piece t's scales are rows t of sxt [T, K] and sgt [T, N]. The neighbours' rows of a chunk are
zeroed in x's tile (finite FP8 values, quantized with their own pieces' scales; the op zeroes padding rows before
quantizing, so nothing non-finite can enter).

Hybrid's e5m2 gradient against e4m3 tiles converts both tiles to float16 in registers (fp8_pallas.upcast_for), the
same products exactly.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from mjax.kernels.attention.flash_common import compiler_params, dot
from mjax.kernels.grouped_matmul.fp8_pallas import upcast_for
from mjax.kernels.grouped_matmul.schedule import max_row_tiles, row_tiles, swizzle, visit_tile
from mjax.kernels.grouped_matmul.tiling import BLOCKWISE_DEPTH, KernelTile

STEP = BLOCKWISE_DEPTH


def _row_block_kernel(visits_ref, a_ref, sa_ref, b_ref, sb_ref, out_ref, *, tile: KernelTile, n_visits: int,
                      n_col_blocks: int, rows: int, groups: int, depth_steps: int, upcast):
    """One (row-block visit, column block) of out = sum_d (a[:, d] . b[g][:, d]^T) * sa[d, rows] * sb[g, d, cols]
    with a [M, D], b [G, C, D], sa flattened from [D/128, M], sb [G, D/128, C]."""
    bm, bn = tile.block_m, tile.block_n
    group, row0, col0, row_ids, keep = visit_tile(visits_ref, tile, n_visits, n_col_blocks)
    out = out_ref.at[pl.ds(row0, bm), pl.ds(col0, bn)]

    @pl.when(group < groups)
    def _():
        # Only a block that runs past the array needs load masks (a static fact); its extra rows are never stored.
        inside = None if rows % bm == 0 else row_ids < rows

        def body(d, acc):
            d0 = pl.multiple_of(d * STEP, STEP)
            a = pltriton.load(a_ref.at[pl.ds(row0, bm), pl.ds(d0, STEP)],  # [bm, 128]
                              mask=None if inside is None else jnp.broadcast_to(inside[:, None], (bm, STEP)),
                              other=None if inside is None else jnp.zeros((), a_ref.dtype))
            sa = pltriton.load(sa_ref.at[pl.ds(d * rows + row0, bm)], mask=inside,  # [bm]: this step's row scales
                               other=None if inside is None else jnp.ones((), sa_ref.dtype))
            b = b_ref[group, pl.ds(col0, bn), pl.ds(d0, STEP)]  # [bn, 128]
            sb = sb_ref[group, d, pl.ds(col0, bn)]  # [bn]: this step's column scales
            if upcast is not None:
                a, b = a.astype(upcast), b.astype(upcast)
            return acc + dot(a, b, trans_b=True) * sa[:, None] * sb[None, :]  # [bm, 128] . [bn, 128]^T -> [bm, bn]

        acc = lax.fori_loop(0, depth_steps, body, jnp.zeros((bm, bn), jnp.float32))
        pltriton.store(out, acc.astype(out_ref.dtype), mask=keep)

    @pl.when(group == groups)
    def _():  # padding rows: zeros
        pltriton.store(out, jnp.zeros((bm, bn), out_ref.dtype), mask=keep)


def _row_block(a, sa_t, b, sb, group_sizes, *, tile: KernelTile, interpret: bool, name: str, out_dtype, mma: str):
    """a [M, D] fp8, sa_t [D/128, M] f32, b [G, C, D] fp8, sb [G, D/128, C] f32 -> [M, C] out_dtype."""
    rows, depth = a.shape
    groups, cols = b.shape[:2]
    visits = row_tiles(group_sizes, rows, tile.block_m)  # [4, T]
    n_visits = max_row_tiles(rows, groups, tile.block_m)
    n_col_blocks = cols // tile.block_n
    kernel = functools.partial(_row_block_kernel, tile=tile, n_visits=n_visits, n_col_blocks=n_col_blocks, rows=rows,
                               groups=groups, depth_steps=depth // STEP, upcast=upcast_for(a.dtype, b.dtype, mma))
    return pl.pallas_call(
        kernel,
        grid=(n_visits * n_col_blocks,),
        out_shape=jax.ShapeDtypeStruct((rows, cols), out_dtype),
        compiler_params=compiler_params(tile.num_warps, tile.num_stages),
        interpret=interpret,
        name=name,
    )(visits, a, sa_t.reshape(-1), b, sb)


@functools.partial(jax.jit, static_argnames=("tile", "interpret", "out_dtype", "mma"))
def forward(xq, sx_t, wq_t, sw_cols, group_sizes, *, tile: KernelTile, interpret: bool, out_dtype, mma="auto"):
    """y [M, N] from xq [M, K], sx_t [K/128, M], wq_t [G, N, K] and sw_cols [G, K/128, N]; zero rows past
    sum(group_sizes)."""
    return _row_block(xq, sx_t, wq_t, sw_cols, group_sizes, tile=tile, interpret=interpret,
                      name="mjax_grouped_fp8_blockwise_fwd", out_dtype=out_dtype, mma=mma)


@functools.partial(jax.jit, static_argnames=("tile", "interpret", "out_dtype", "mma"))
def dgrad(gq, sg_t, wq, sw_cols_t, group_sizes, *, tile: KernelTile, interpret: bool, out_dtype, mma="auto"):
    """dx [M, K] from gq [M, N], sg_t [N/128, M], wq [G, K, N] and sw_cols_t [G, N/128, K]; zero rows past
    sum(group_sizes)."""
    return _row_block(gq, sg_t, wq, sw_cols_t, group_sizes, tile=tile, interpret=interpret,
                      name="mjax_grouped_fp8_blockwise_dgrad", out_dtype=out_dtype, mma=mma)


def _wgrad_kernel(pieces_ref, xt_ref, sxt_ref, gt_ref, sgt_ref, dw_ref, *, tile: KernelTile, n_k_blocks: int,
                  n_n_blocks: int, rows: int, k: int, n: int, upcast):
    """One [block_m, block_n] tile of dw[g], one aligned 128-row chunk (one quantization piece) at a time."""
    bm, bn = tile.block_m, tile.block_n
    i, j = swizzle(pl.program_id(0), n_k_blocks, n_n_blocks, tile.group_m)
    g = pl.program_id(1)
    start, end, piece0 = pieces_ref[0, g], pieces_ref[1, g], pieces_ref[2, g]
    first = lax.div(start, jnp.int32(STEP)) * STEP
    k0 = pl.multiple_of(i * bm, bm)
    n0 = pl.multiple_of(j * bn, bn)

    def body(c, acc):
        r0 = pl.multiple_of(first + c * STEP, STEP)
        cols = r0 + jnp.arange(STEP, dtype=jnp.int32)
        # Only a chunk past the last row needs a load mask (a static fact): the arrays end there.
        past = None if rows % STEP == 0 else (cols < rows)[None, :]
        xt = pltriton.load(xt_ref.at[pl.ds(k0, bm), pl.ds(r0, STEP)],  # [bm, 128]
                           mask=None if past is None else jnp.broadcast_to(past, (bm, STEP)),
                           other=None if past is None else jnp.zeros((), xt_ref.dtype))
        gt = pltriton.load(gt_ref.at[pl.ds(n0, bn), pl.ds(r0, STEP)],  # [bn, 128]
                           mask=None if past is None else jnp.broadcast_to(past, (bn, STEP)),
                           other=None if past is None else jnp.zeros((), gt_ref.dtype))
        mine = jnp.broadcast_to(((cols >= start) & (cols < end))[None, :], (bm, STEP))
        xt = jnp.where(mine, xt, jnp.zeros((bm, STEP), xt.dtype))  # the neighbours' rows of this chunk add nothing
        piece = piece0 + c
        sx = sxt_ref[pl.ds(piece * k + k0, bm)]  # [bm]: the piece's scales of x's columns
        sg = sgt_ref[pl.ds(piece * n + n0, bn)]  # [bn]
        if upcast is not None:
            xt, gt = xt.astype(upcast), gt.astype(upcast)
        return acc + dot(xt, gt, trans_b=True) * sx[:, None] * sg[None, :]  # [bm, 128] . [bn, 128]^T -> [bm, bn]

    chunks = jnp.where(end > start, lax.div(end - first + (STEP - 1), jnp.int32(STEP)), 0)
    acc = lax.fori_loop(0, chunks, body, jnp.zeros((bm, bn), jnp.float32))
    dw_ref[g, pl.ds(k0, bm), pl.ds(n0, bn)] = acc


@functools.partial(jax.jit, static_argnames=("tile", "interpret", "mma"))
def wgrad(xq_t, sxt, gq_t, sgt, pieces, *, tile: KernelTile, interpret: bool, mma: str = "auto"):
    """dw [G, K, N] float32 from xq_t [K, M], sxt [T, K], gq_t [N, M], sgt [T, N] (piece-quantized along M) and
    pieces [3, G] int32 (each group's start row, end row and first piece); zeros for an empty group."""
    (k, rows), n = xq_t.shape, gq_t.shape[0]
    groups = pieces.shape[1]
    n_k_blocks, n_n_blocks = k // tile.block_m, n // tile.block_n
    kernel = functools.partial(_wgrad_kernel, tile=tile, n_k_blocks=n_k_blocks, n_n_blocks=n_n_blocks, rows=rows,
                               k=k, n=n, upcast=upcast_for(xq_t.dtype, gq_t.dtype, mma))
    return pl.pallas_call(
        kernel,
        grid=(n_k_blocks * n_n_blocks, groups),
        out_shape=jax.ShapeDtypeStruct((groups, k, n), jnp.float32),
        compiler_params=compiler_params(tile.num_warps, tile.num_stages),
        interpret=interpret,
        name="mjax_grouped_fp8_blockwise_wgrad",
    )(pieces, xq_t, sxt.reshape(-1), gq_t, sgt.reshape(-1))
