"""Grouped matmul on Hopper in Pallas Mosaic GPU: TMA loads into swizzled shared memory, wgmma, one persistent
program per SM walking the output tiles. Forward, input gradient (dgrad) and weight gradient (wgrad) behind a
custom_vjp, float32 accumulation; bfloat16 / float16 operands. Runs on a Hopper GPU. On CPU the tests lower it for
a Hopper GPU and run it under JAX's Mosaic GPU interpreter (`interpret`: the interpreter's parameters; None, the
default, on a GPU).

    y [M, N] = grouped_matmul_mosaic(x [M, K], w [G, K, N], group_sizes [G], tiling, num_sms, interpret=None)

Forward and dgrad walk the visits of `schedule.row_tiles` times column blocks, the visits in use first in a snake
over them alone (`mosaic_parts.live_item`). Each visit is a block_m-row window from the
8-row tile at or before its segment's first row (TMA loads start at any 8-row tile, so a group of s rows takes
about ceil(s / block_m) visits wherever it starts): the window is loaded whole (rows outside the visited segment are
multiplied but never stored), and the visited segment's rows are stored from shared memory as a sum of
power-of-two row slices (a TMA copy needs static shapes and the row count is known only at run time). dgrad
reads w[g] as [K, N] tiles and hands wgmma their transpose: w^T is never written. wgrad walks (group, K tile,
N tile); each program steps through its group's rows in block_k chunks from the 8-row tile holding its first row
(a run-time trip count) and zeroes the rows of the first and last chunk that belong to another group (in dy) or to
the padding (in both operands: the padding may hold non-finite values).

A tiling is `tiling.Tiling` of `KernelTile`s read as: block_m x block_n output tile, block_k depth step,
num_stages pipelined loads, group_m the width (in column tiles) of the snake the programs walk the tiles in;
num_warps 4: one warpgroup loads and computes the tile (this module), 8: a memory warpgroup loads and a compute
warpgroup computes (mosaic_specialized.py), 12: as 8 with two compute warpgroups, each half of the tile's
columns. `mosaic_tile_problem` checks a tile.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mjax.kernels.device import SHARED_MEMORY_BYTES
from mjax.kernels.grouped_matmul import mosaic_specialized
from mjax.kernels.grouped_matmul.mosaic_parts import (TMA_ROWS, live_visit, live_visits, mask_group_edges, store_rows,
                                                      swizzled, wgrad_bounds)
from mjax.kernels.grouped_matmul.schedule import max_row_tiles, row_tiles
from mjax.kernels.grouped_matmul.tiling import (MOSAIC_SPECIALIZED_WARPS, KernelTile, Tiling, mosaic_compute_warpgroups,
                                                mosaic_shared_bytes)

MOSAIC_DTYPES = (jnp.bfloat16, jnp.float16)
# A warpgroup holds its float32 accumulator in registers: 128 x 192 is 192 registers a thread of the 232-255 it has.
MAX_TILE_ELEMENTS = 128 * 192


def mosaic_tile_problem(kernel: str, tile: KernelTile, k: int, n: int) -> str | None:
    """None if `tile` fits kernel ("forward", "dgrad" or "wgrad") of x [M, K] . w [G, K, N], else the reason."""
    # Forward and dgrad may end in a partial column tile (TMA zero-fills the loads past the array and clips the
    # stores; an output column depends only on its own weight column), so only their depth must be whole blocks.
    dims = {"forward": (None, None, ("K", k)), "dgrad": (None, None, ("N", n)),
            "wgrad": (("K", k), ("N", n), None)}[kernel]
    for field, dim in zip(("block_m", "block_n", "block_k"), dims):
        block = getattr(tile, field)
        if dim is not None and dim[1] % block:
            return f"the Mosaic GPU {kernel} kernel needs {dim[0]}={dim[1]} to be a multiple of {field}={block}"
    if tile.block_m % 64 or tile.block_n % 64 or tile.block_k % 64:
        return f"the Mosaic GPU {kernel} tile {tile} must have block_m, block_n and block_k multiples of 64 (wgmma)"
    if tile.num_warps not in (4, *MOSAIC_SPECIALIZED_WARPS):
        return (f"the Mosaic GPU {kernel} tile {tile} must have num_warps=4 (one warpgroup), 8 (warp-specialised) "
                "or 12 (warp-specialised, two compute warpgroups)")
    specialized = tile.num_warps in MOSAIC_SPECIALIZED_WARPS
    n_compute = mosaic_compute_warpgroups(tile) if specialized else 1
    if tile.block_n % (64 * n_compute):
        return (f"the Mosaic GPU {kernel} tile {tile} splits its columns between {n_compute} compute warpgroups: "
                f"block_n must be a multiple of {64 * n_compute}")
    if tile.block_m * tile.block_n // n_compute > MAX_TILE_ELEMENTS:
        return (f"the Mosaic GPU {kernel} tile {tile} holds {tile.block_m * tile.block_n // n_compute} accumulator "
                f"elements in one warpgroup's registers (at most {MAX_TILE_ELEMENTS})")
    if tile.num_stages < 2:  # a stage is released one step after its wgmma: one stage would wait on itself
        return f"the Mosaic GPU {kernel} tile {tile} needs num_stages >= 2"
    # The warp-specialised kernels keep their output tile's staging beside the load ring (16-bit operands).
    shared = mosaic_shared_bytes(tile, 2) if specialized else tile.shared_bytes(2)
    if shared > SHARED_MEMORY_BYTES:
        return (f"the Mosaic GPU {kernel} tile {tile} needs {shared // 1024} KiB of shared memory (at most "
                f"{SHARED_MEMORY_BYTES // 1024}); use fewer stages or smaller blocks")
    return None


def _row_block_matmul(a, w, group_sizes, *, tile: KernelTile, transpose_w: bool, num_sms: int, interpret):
    """out [M, C] = a [M, D] . w[g] [D, C] per group (transpose_w: w[g] [C, D] contracted transposed); zero rows
    past sum(group_sizes)."""
    rows, depth = a.shape
    groups = w.shape[0]
    cols = w.shape[1] if transpose_w else w.shape[2]
    bm, bn, bk = tile.block_m, tile.block_n, tile.block_k
    visits = row_tiles(group_sizes, rows, bm, TMA_ROWS)  # [4, T]
    live = live_visits(visits, groups)  # [1]
    n_visits, n_col_blocks = max_row_tiles(rows, groups, bm), -(-cols // bn)

    def body(visits_gmem, live_gmem, a_gmem, w_gmem, out_gmem):
        n_live = live_gmem[0]

        @plgpu.nd_loop((n_visits * n_col_blocks,), collective_axes="sm")
        def _(loop_info: plgpu.NDLoopInfo):
            seg, row0, first, last, j = live_visit(visits_gmem, n_live, loop_info.index[0], n_col_blocks,
                                                   tile.group_m, groups)
            w_g = w_gmem.at[jnp.minimum(seg, groups - 1)]

            def acc_scope(acc_ref):
                def step(_, a_smem, w_smem):
                    plgpu.wgmma(acc_ref, a_smem, w_smem.transpose((1, 0)) if transpose_w else w_smem)

                @pl.when(seg < groups)  # the padding segment keeps the zero accumulator
                def _():
                    plgpu.emit_pipeline(
                        step,
                        grid=(depth // bk,),
                        in_specs=[
                            plgpu.BlockSpec((bm, bk), lambda d: (0, d), delay_release=1),
                            plgpu.BlockSpec((bn, bk), lambda d: (j, d), delay_release=1) if transpose_w
                            else plgpu.BlockSpec((bk, bn), lambda d: (d, j), delay_release=1),
                        ],
                        max_concurrent_steps=tile.num_stages,
                    )(a_gmem.at[pl.ds(pl.multiple_of(row0, TMA_ROWS), bm)], w_g)  # the visit's window; past M: zeros

                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))

            @pl.when(seg <= groups)  # unused visits store nothing
            def _():
                @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), dtype=out_gmem.dtype))
                def _(o_smem):
                    store_rows(acc, o_smem, out_gmem, row0, first - row0, last - first, j * bn, bm, bn)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((rows, cols), a.dtype), grid=(num_sms,), grid_names=("sm",),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    return kernel(visits, live, a, w)


def _wgrad(x, dy, group_sizes, *, tile: KernelTile, num_sms: int, interpret):
    """dw [G, K, N] = x_g^T dy_g per group, zeros for an empty group."""
    (rows, k), n = x.shape, dy.shape[1]
    groups = group_sizes.shape[0]
    bm, bn, bk = tile.block_m, tile.block_n, tile.block_k
    bounds = wgrad_bounds(group_sizes, rows, bk)  # [5, G]
    n_k_blocks, n_n_blocks = k // bm, n // bn
    transforms = swizzled(x.dtype)

    def body(bounds_gmem, x_gmem, dy_gmem, dw_gmem):
        @plgpu.nd_loop((groups, n_k_blocks * n_n_blocks), collective_axes="sm")
        def _(loop_info: plgpu.NDLoopInfo):
            g = loop_info.index[0]
            i, j = plgpu.planar_snake(loop_info.index[1], (n_k_blocks, n_n_blocks), 1, tile.group_m)
            start, end, origin, n_chunks, into_padding = (bounds_gmem[r, g] for r in range(5))

            def acc_scope(acc_ref):
                def step(c, x_smem, dy_smem):
                    mask_group_edges(c[0], n_chunks, start, end, origin, into_padding, bk, x_smem, dy_smem)
                    plgpu.wgmma(acc_ref, x_smem.transpose((1, 0)), dy_smem)  # [bk, bm]^T [bk, bn] -> [bm, bn]

                @pl.when(n_chunks > 0)
                def _():
                    group_rows = pl.ds(pl.multiple_of(origin, TMA_ROWS), rows)  # past M: TMA reads zeros
                    plgpu.emit_pipeline(
                        step,
                        grid=(n_chunks,),
                        in_specs=[plgpu.BlockSpec((bk, bm), lambda c: (c, i), delay_release=1,
                                                  transforms=transforms),
                                  plgpu.BlockSpec((bk, bn), lambda c: (c, j), delay_release=1,
                                                  transforms=transforms)],
                        max_concurrent_steps=tile.num_stages,
                    )(x_gmem.at[group_rows, :], dy_gmem.at[group_rows, :])

                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))

            @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), dtype=dw_gmem.dtype,
                                                                  transforms=transforms))
            def _(o_smem):
                o_smem[...] = acc.astype(o_smem.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, dw_gmem.at[g, pl.ds(i * bm, bm), pl.ds(j * bn, bn)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((groups, k, n), x.dtype), grid=(num_sms,), grid_names=("sm",),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    return kernel(bounds, x, dy)


def _row_kernel(tile: KernelTile):
    return mosaic_specialized.row_block_matmul if tile.num_warps in MOSAIC_SPECIALIZED_WARPS else _row_block_matmul


@functools.partial(jax.jit, static_argnames=("tile", "num_sms", "interpret"))
def forward(x, w, group_sizes, *, tile: KernelTile, num_sms: int, interpret=None):
    """y [M, N] = x [M, K] . w[g] [K, N] per group, zero rows past sum(group_sizes); y in x.dtype."""
    return _row_kernel(tile)(x, w, group_sizes, tile=tile, transpose_w=False, num_sms=num_sms, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("tile", "num_sms", "interpret"))
def dgrad(dy, w, group_sizes, *, tile: KernelTile, num_sms: int, interpret=None):
    """dx [M, K] = dy [M, N] . w[g]^T per group, zero rows past sum(group_sizes); dx in dy.dtype."""
    return _row_kernel(tile)(dy, w, group_sizes, tile=tile, transpose_w=True, num_sms=num_sms, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("tile", "num_sms", "interpret"))
def wgrad(x, dy, group_sizes, *, tile: KernelTile, num_sms: int, interpret=None):
    """dw [G, K, N] = x_g^T dy_g per group (zeros for empty groups), in x.dtype."""
    kernel = mosaic_specialized.wgrad if tile.num_warps in MOSAIC_SPECIALIZED_WARPS else _wgrad
    return kernel(x, dy, group_sizes, tile=tile, num_sms=num_sms, interpret=interpret)


def grouped_matmul_mosaic(x, w, group_sizes, tiling: Tiling, num_sms: int, interpret=None):
    """The differentiable grouped matmul; see the module docstring. Shapes and tiling are checked by the caller.
    A row count that is no multiple of 8 (the TMA copies' row tiling), or fewer rows than one window of a kernel, is
    padded up: the added rows are padding rows, and they are cut off again."""
    rows = x.shape[0]
    window = max(tiling.forward.block_m, tiling.dgrad.block_m, tiling.wgrad.block_k)
    padded = max(-(-rows // TMA_ROWS) * TMA_ROWS, window)
    if padded == rows:
        return _grouped(x, w, group_sizes, tiling, num_sms, interpret)
    return _grouped(jnp.pad(x, ((0, padded - rows), (0, 0))), w, group_sizes, tiling, num_sms, interpret)[:rows]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _grouped(x, w, group_sizes, tiling: Tiling, num_sms: int, interpret):
    return forward(x, w, group_sizes, tile=tiling.forward, num_sms=num_sms, interpret=interpret)


def _fwd(x, w, group_sizes, tiling, num_sms, interpret):
    return _grouped(x, w, group_sizes, tiling, num_sms, interpret), (x, w, group_sizes)


def _bwd(tiling, num_sms, interpret, residuals, dy):
    x, w, group_sizes = residuals
    dy = dy.astype(x.dtype)
    dx = dgrad(dy, w, group_sizes, tile=tiling.dgrad, num_sms=num_sms, interpret=interpret)
    dw = wgrad(x, dy, group_sizes, tile=tiling.wgrad, num_sms=num_sms, interpret=interpret).astype(w.dtype)
    return dx, dw, None


_grouped.defvjp(_fwd, _bwd)
