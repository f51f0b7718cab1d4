"""What both families of Mosaic GPU grouped matmul kernels (mosaic.py, mosaic_specialized.py) share: the swizzled
shared-memory layout of their operand tiles, the row kernels' deal of their visits, the row-slice stores of a visit,
the wgrad's per-group chunk bounds and its masking of rows outside a group."""

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mjax.kernels.grouped_matmul.schedule import UNUSED, group_bounds


# A swizzled tile's TMA copy moves whole 8-row tiles: its row offset must be a multiple of 8 (layout inference needs
# pl.multiple_of(row, TMA_ROWS) to prove it).
TMA_ROWS = 8


def swizzled(dtype):
    """Every tile's minor dimension is a multiple of 64 elements: 128-byte rows, the widest swizzle."""
    swizzle = plgpu.find_swizzle(64 * jnp.dtype(dtype).itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)


def live_visits(visits, groups: int):
    """int32 [1]: how many of schedule.row_tiles' visits are in use (the groups' and the padding's). They come first;
    the rest of the static grid's visits do nothing."""
    return jnp.sum(visits[0] <= groups, dtype=jnp.int32, keepdims=True)


def live_item(index, n_live, n_col_blocks: int, group_m: int):
    """A row kernel's nd_loop item -> (visit, column tile, in use). The n_live visits' items come first, in
    planar_snake order: strips of group_m column tiles, every other strip walking the visits backwards. The static
    grid's unused items come after them. A round-robin deal then gives no program more than
    ceil(n_live * n_col_blocks / programs) items in use. A snake over all the grid's visits would start every other
    strip with the unused ones, so with more than group_m column tiles some programs would get more."""
    n_items = n_live * n_col_blocks
    snake_visits = jnp.maximum(n_live, 1)  # no live visit (M = 0): every item unused, all reading visit 0
    t, j = plgpu.planar_snake(jnp.minimum(index, snake_visits * n_col_blocks - 1), (snake_visits, n_col_blocks), 1,
                              group_m)
    return t, j, index < n_items


def live_visit(visits_ref, n_live, index, n_col_blocks: int, group_m: int, groups: int):
    """A row kernel's nd_loop item -> its row_tiles entry (segment, the window's first row, the segment's first and
    last + 1 row in it) and column tile, dealt by live_item; an unused item gets segment groups + UNUSED."""
    t, j, in_use = live_item(index, n_live, n_col_blocks, group_m)
    seg = jnp.where(in_use, visits_ref[0, t], groups + UNUSED)
    return seg, visits_ref[1, t], visits_ref[2, t], visits_ref[3, t], j


def store_rows(acc, o_smem, out_gmem, row0, first, count, col0, bm: int, bn: int):
    """Issues the stores of rows [first, first + count) of the block at row0 (count <= bm, a run-time value) from
    acc through o_smem [bm, bn]; the caller waits for them."""
    o_smem[...] = acc.astype(o_smem.dtype)
    plgpu.commit_smem()
    offset = first
    size = 1 << (bm.bit_length() - 1)
    while size:  # count = the sum of its set bits: one static-shape TMA copy per bit, in order
        @pl.when(count & size != 0)
        def _(size=size, offset=offset):
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(offset, size)],
                                    out_gmem.at[pl.ds(row0 + offset, size), pl.ds(col0, bn)])

        offset = offset + (count & size)
        size //= 2


def wgrad_bounds(group_sizes, rows: int, bk: int):
    """int32 [5, G]: per group its first row, its end, the first row of its first bk-row chunk (the TMA tile row at
    or before its first row), its number of chunks (0 for an empty group), and 1 if its last chunk reaches into the
    padding rows (ends past sum(group_sizes), when rows are left over)."""
    starts, ends = group_bounds(group_sizes, rows)
    origin = starts // TMA_ROWS * TMA_ROWS
    chunks = jnp.where(ends > starts, (ends - origin + bk - 1) // bk, 0)
    used = ends[-1]  # the padding rows: [used, rows)
    into_padding = (used < rows) & (origin + chunks * bk > used)
    return jnp.stack([starts, ends, origin, chunks, into_padding.astype(jnp.int32)])


def keep_rows(ref, keep):
    """Zeroes the rows of the shared-memory tile `ref` where keep(row ids) is False (a select: NaN * 0 is NaN)."""
    rows_ids = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, ref.shape, 0), plgpu.Layout.WGMMA)
    ref[...] = jnp.where(keep(rows_ids), ref[...], jnp.zeros(ref.shape, ref.dtype))
    plgpu.commit_smem()


def mask_group_edges(c, n_chunks, start, end, origin, into_padding, bk: int, x_smem, dy_smem):
    """Zeroes, in wgrad's chunk c (of bk rows from `origin`) of a group [start, end), the rows before the group
    (first chunk) and after it (last chunk). Another group's rows need only their dy zeroed (x . 0 = 0 for finite
    x: one shared-memory pass instead of two); the padding rows may hold non-finite values, so a last chunk reaching
    into them has both operands zeroed."""
    head = start - origin  # rows of the first chunk before the group (< TMA_ROWS)
    tail = lax.rem(end - origin, bk)  # rows of the last chunk in the group (0: all of them)

    @pl.when((c == 0) & (head != 0))
    def _():
        keep_rows(dy_smem, lambda r: r >= head)

    @pl.when((c == n_chunks - 1) & (tail != 0))
    def _():
        keep_rows(dy_smem, lambda r: r < tail)

        @pl.when(into_padding != 0)
        def _():
            keep_rows(x_smem, lambda r: r < tail)
