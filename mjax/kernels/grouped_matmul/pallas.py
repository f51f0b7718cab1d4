"""Grouped matmul in Pallas (Triton lowering): forward, input gradient (dgrad) and weight gradient (wgrad) kernels
behind a custom_vjp, float32 accumulation. Interpreted off GPU (the CPU tests).

    y [M, N] = grouped_matmul_pallas(x [M, K], w [G, K, N], group_sizes [G], tiling=..., interpret=...)

Forward and dgrad run the visits of `schedule.row_tiles` (aligned row blocks, one visit per group a block touches)
times column blocks, on a flat grid in grouped order (`schedule.swizzle`); each program loops over the depth and
stores its rows of the block under a mask, so visits that share a block write disjoint rows. dgrad reads w[g] as
[K, N] tiles and contracts them transposed: w^T is never written to memory. wgrad's grid is (K x N tiles, G);
each program walks its group's rows in block_k chunks (a run-time trip count, zero for an empty group, whose tile
is then written as zeros). The tiles are `tiling.Tiling`; shapes must be whole column and depth blocks
(`tiling.tiling_problem`, checked by the dispatch).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from mjax.kernels.attention.flash_common import compiler_params, dot
from mjax.kernels.grouped_matmul.schedule import group_bounds, max_row_tiles, row_tiles, swizzle, visit_tile
from mjax.kernels.grouped_matmul.tiling import KernelTile, Tiling


def _row_block_kernel(visits_ref, a_ref, w_ref, *refs, tile: KernelTile, n_visits: int, n_col_blocks: int,
                      rows: int, groups: int, depth: int, transpose_w: bool, upcast):
    """One (row-block visit, column block) of out = a . w[g] (forward: a = x, w[g] [K, N]) or of
    out = a . w[g]^T (dgrad: a = dy, w[g] read as [K, N] tiles and contracted transposed). With a scale operand
    (refs = scale_ref, out_ref; FP8 operands) the f32 product of group g is multiplied by scale[g] before the store;
    `upcast`: a dtype both operand tiles are converted to before the dot (FP8 of two formats, see fp8_pallas.py)."""
    scale_ref, out_ref = refs if len(refs) == 2 else (None, *refs)
    bm, bn, bk = tile.block_m, tile.block_n, tile.block_k
    group, row0, col0, row_ids, keep = visit_tile(visits_ref, tile, n_visits, n_col_blocks)
    out = out_ref.at[pl.ds(row0, bm), pl.ds(col0, bn)]

    @pl.when(group < groups)
    def _():
        # Rows of other segments are loaded and computed but never stored (a row of the product depends on that
        # row of `a` only), so only a block that runs past the array needs a load mask.
        in_bounds = None if rows % bm == 0 else jnp.broadcast_to((row_ids < rows)[:, None], (bm, bk))

        def body(i, acc):
            k0 = pl.multiple_of(i * bk, bk)
            a = pltriton.load(a_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)], mask=in_bounds,
                              other=None if in_bounds is None else jnp.zeros((), a_ref.dtype))  # [bm, bk]
            if transpose_w:
                b = w_ref[group, pl.ds(col0, bn), pl.ds(k0, bk)]  # [bn, bk] of w[g] [K, N]
            else:
                b = w_ref[group, pl.ds(k0, bk), pl.ds(col0, bn)]  # [bk, bn]
            if upcast is not None:
                a, b = a.astype(upcast), b.astype(upcast)
            return acc + dot(a, b, trans_b=transpose_w)

        acc = lax.fori_loop(0, depth // bk, body, jnp.zeros((bm, bn), jnp.float32))
        if scale_ref is not None:
            acc = acc * scale_ref[group]
        pltriton.store(out, acc.astype(out_ref.dtype), mask=keep)

    @pl.when(group == groups)
    def _():  # padding rows: zeros
        pltriton.store(out, jnp.zeros((bm, bn), out_ref.dtype), mask=keep)


def row_block_matmul(a, w, group_sizes, *, tile: KernelTile, transpose_w: bool, interpret: bool, name: str,
                     scale=None, upcast=None, out_dtype=None):
    """a [M, D], w [G, D, C] (or [G, C, D] read transposed) -> [M, C] in out_dtype (default a.dtype). `scale` [G]
    f32 multiplies group g's product (the FP8 kernels' dequantization)."""
    rows, depth = a.shape
    groups = w.shape[0]
    cols = w.shape[1] if transpose_w else w.shape[2]
    visits = row_tiles(group_sizes, rows, tile.block_m)  # [4, T]
    n_visits = max_row_tiles(rows, groups, tile.block_m)
    n_col_blocks = cols // tile.block_n
    kernel = functools.partial(_row_block_kernel, tile=tile, n_visits=n_visits, n_col_blocks=n_col_blocks,
                               rows=rows, groups=groups, depth=depth, transpose_w=transpose_w, upcast=upcast)
    return pl.pallas_call(
        kernel,
        grid=(n_visits * n_col_blocks,),
        out_shape=jax.ShapeDtypeStruct((rows, cols), out_dtype or a.dtype),
        compiler_params=compiler_params(tile.num_warps, tile.num_stages),
        interpret=interpret,
        name=name,
    )(visits, a, w, *(() if scale is None else (scale,)))


def _wgrad_kernel(bounds_ref, x_ref, dy_ref, dw_ref, *, tile: KernelTile, n_k_blocks: int, n_n_blocks: int):
    """One [block_m, block_n] tile of dw[g] [K, N] = x_g^T dy_g, walking the group's rows block_k at a time."""
    bm, bn, bk = tile.block_m, tile.block_n, tile.block_k
    i, j = swizzle(pl.program_id(0), n_k_blocks, n_n_blocks, tile.group_m)
    g = pl.program_id(1)
    start, end = bounds_ref[0, g], bounds_ref[1, g]
    k0 = pl.multiple_of(i * bm, bm)
    n0 = pl.multiple_of(j * bn, bn)

    def body(c, acc):
        r0 = start + c * bk
        keep = (r0 + jnp.arange(bk, dtype=jnp.int32) < end)[:, None]
        # Both operands masked: rows past the group belong to another group or are padding (possibly not finite).
        xt = pltriton.load(x_ref.at[pl.ds(r0, bk), pl.ds(k0, bm)], mask=jnp.broadcast_to(keep, (bk, bm)), other=0)
        dyt = pltriton.load(dy_ref.at[pl.ds(r0, bk), pl.ds(n0, bn)], mask=jnp.broadcast_to(keep, (bk, bn)), other=0)
        return acc + dot(xt, dyt, trans_a=True)  # [bk, bm]^T [bk, bn] -> [bm, bn]

    chunks = lax.div(end - start + (bk - 1), jnp.int32(bk))
    acc = lax.fori_loop(0, chunks, body, jnp.zeros((bm, bn), jnp.float32))
    dw_ref[g, pl.ds(k0, bm), pl.ds(n0, bn)] = acc.astype(dw_ref.dtype)


def _wgrad(x, dy, group_sizes, *, tile: KernelTile, interpret: bool, out_dtype):
    """x [M, K], dy [M, N] -> dw [G, K, N] in out_dtype (zeros for empty groups)."""
    (rows, k), n = x.shape, dy.shape[1]
    groups = group_sizes.shape[0]
    bounds = jnp.stack(group_bounds(group_sizes, rows))  # [2, G]
    n_k_blocks, n_n_blocks = k // tile.block_m, n // tile.block_n
    kernel = functools.partial(_wgrad_kernel, tile=tile, n_k_blocks=n_k_blocks, n_n_blocks=n_n_blocks)
    return pl.pallas_call(
        kernel,
        grid=(n_k_blocks * n_n_blocks, groups),
        out_shape=jax.ShapeDtypeStruct((groups, k, n), out_dtype),
        compiler_params=compiler_params(tile.num_warps, tile.num_stages),
        interpret=interpret,
        name="mjax_grouped_matmul_wgrad",
    )(bounds, x, dy)


@functools.partial(jax.jit, static_argnames=("tile", "interpret"))
def forward(x, w, group_sizes, *, tile: KernelTile, interpret: bool):
    """y [M, N] = x [M, K] . w[g] [K, N] per group, zero rows past sum(group_sizes); y in x.dtype."""
    return row_block_matmul(x, w, group_sizes, tile=tile, transpose_w=False, interpret=interpret,
                             name="mjax_grouped_matmul_fwd")


@functools.partial(jax.jit, static_argnames=("tile", "interpret"))
def dgrad(dy, w, group_sizes, *, tile: KernelTile, interpret: bool):
    """dx [M, K] = dy [M, N] . w[g]^T per group, zero rows past sum(group_sizes); dx in dy.dtype."""
    return row_block_matmul(dy, w, group_sizes, tile=tile, transpose_w=True, interpret=interpret,
                             name="mjax_grouped_matmul_dgrad")


@functools.partial(jax.jit, static_argnames=("tile", "interpret", "out_dtype"))
def wgrad(x, dy, group_sizes, *, tile: KernelTile, interpret: bool, out_dtype=None):
    """dw [G, K, N] = x_g^T dy_g per group (zeros for empty groups), in out_dtype (default x.dtype)."""
    return _wgrad(x, dy, group_sizes, tile=tile, interpret=interpret, out_dtype=jnp.dtype(out_dtype or x.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def grouped_matmul_pallas(x, w, group_sizes, tiling: Tiling, interpret: bool):
    """The differentiable grouped matmul; see the module docstring. Shapes and tiling are checked by the caller."""
    return forward(x, w, group_sizes, tile=tiling.forward, interpret=interpret)


def _fwd(x, w, group_sizes, tiling, interpret):
    return grouped_matmul_pallas(x, w, group_sizes, tiling, interpret), (x, w, group_sizes)


def _bwd(tiling, interpret, residuals, dy):
    x, w, group_sizes = residuals
    dy = dy.astype(x.dtype)
    dx = dgrad(dy, w, group_sizes, tile=tiling.dgrad, interpret=interpret)
    dw = wgrad(x, dy, group_sizes, tile=tiling.wgrad, interpret=interpret, out_dtype=w.dtype)
    return dx, dw, None


grouped_matmul_pallas.defvjp(_fwd, _bwd)
