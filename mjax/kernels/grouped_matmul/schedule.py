"""Work lists of the grouped-matmul kernels, computed from the run-time group sizes with a few cheap jnp ops.

Rows of x are sorted by group: group g owns [start_g, end_g), and rows at or past sum(group_sizes) are padding,
treated here as one more segment (id G) whose output rows are written as zeros. The forward and dgrad kernels walk
[block_m]-row windows, each visit of a window masking its stores (and the Triton kernels their loads) to one
segment's rows, so that every output row is written exactly once. A segment's windows start at the multiple of
`align` rows at or before its first row and step by block_m. The Triton kernels' windows are the row blocks
(align = block_m: a block is visited once per segment it touches); the Mosaic kernels' start on the 8-row tiles of
their TMA copies, so that a segment of s rows costs about ceil(s / block_m) visits however it sits against the
blocks. Either way at most ceil(M / block_m) + G visits: a static grid, whose trailing unused visits do nothing.
"""

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

UNUSED = 1  # offset past the padding segment's id: a visit with group id G + UNUSED does nothing


def group_bounds(group_sizes, rows: int):
    """(start, end) int32 [G] of each group's rows, clipped to the M rows there are."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    starts = ends - group_sizes.astype(jnp.int32)
    return jnp.minimum(starts, rows), jnp.minimum(ends, rows)


def max_row_tiles(rows: int, groups: int, block_m: int) -> int:
    """The row blocks, and one more visit per segment boundary inside one. It bounds windows of any `align` dividing
    block_m too: a segment's first window starts at or after the block holding its first row, so it has no more
    windows than the blocks it touches."""
    return -(-rows // block_m) + groups


def row_tiles(group_sizes, rows: int, block_m: int, align: int | None = None):
    """int32 [4, T] with T = max_row_tiles: per visit (segment id, the window's first row, the segment's first and
    last + 1 row in it). `align` divides block_m (default: block_m).

    Segment ids are groups 0..G-1, G for the padding rows (zeros), G + 1 for unused visits."""
    align = align or block_m
    assert block_m % align == 0, (block_m, align)
    groups = group_sizes.shape[0]
    starts, ends = group_bounds(group_sizes, rows)
    seg_start = jnp.concatenate([starts, ends[-1:]])  # [G + 1]: the groups, then the padding rows
    seg_end = jnp.concatenate([ends, jnp.full((1,), rows, jnp.int32)])
    origin = seg_start // align * align  # [G + 1]: the first window's first row
    visits = jnp.where(seg_end > seg_start, (seg_end - 1 - origin) // block_m + 1, 0)  # [G + 1]
    visits_end = jnp.cumsum(visits)
    t = jnp.arange(max_row_tiles(rows, groups, block_m), dtype=jnp.int32)
    # Segment of visit t: how many segments end at or before it (a compare-and-sum, which XLA fuses; T x (G + 1)).
    seg = jnp.sum(visits_end[None, :] <= t[:, None], axis=1, dtype=jnp.int32)  # [T] in [0, G + 1]
    s = jnp.minimum(seg, groups)
    row0 = origin[s] + (t - (visits_end[s] - visits[s])) * block_m
    first = jnp.maximum(seg_start[s], row0)
    last = jnp.minimum(seg_end[s], row0 + block_m)
    return jnp.stack([seg, row0, first, last])


def swizzle(pid, n_rows: int, n_cols: int, group: int):
    """Program id -> (row tile, column tile) walking `group` row tiles across all columns before the next ones, so
    that the programs running at once share their row tiles and column tiles in L2. Non-negative int32 math with
    static sizes (lax.div and lax.rem lower to Triton as they are)."""
    per_group = group * n_cols
    first = lax.div(pid, jnp.int32(per_group)) * group
    rows_here = jnp.minimum(jnp.int32(n_rows) - first, jnp.int32(group))
    local = lax.rem(pid, jnp.int32(per_group))
    return first + lax.rem(local, rows_here), lax.div(local, rows_here)


def visit_tile(visits_ref, tile, n_visits: int, n_col_blocks: int):
    """Inside a row-block kernel: this program's (row-block visit, column block) of row_tiles' work list ->
    (segment, first row, first column, the block's row ids [block_m], the store mask [block_m, block_n]: the rows of
    the visited segment). For aligned windows (row_tiles' default align)."""
    bm, bn = tile.block_m, tile.block_n
    t, j = swizzle(pl.program_id(0), n_visits, n_col_blocks, tile.group_m)
    group, row0, first, last = visits_ref[0, t], visits_ref[1, t], visits_ref[2, t], visits_ref[3, t]
    row0 = pl.multiple_of(row0, bm)  # aligned windows
    col0 = pl.multiple_of(j * bn, bn)
    row_ids = row0 + jnp.arange(bm, dtype=jnp.int32)
    keep = jnp.broadcast_to(((row_ids >= first) & (row_ids < last))[:, None], (bm, bn))
    return group, row0, col0, row_ids, keep
