"""Pieces the Mosaic GPU attention kernels share: static mask facts, the tile layout, the in-kernel position mask,
the walk over one warpgroup's runs of blocks inside the union its program streams, and the persistent kernels'
loops over their items (compute warpgroups; the memory warpgroup's K/V ring).

A program's two compute warpgroups each own a tile of rows and read its block runs from a `ranges` array
(lo, full_lo, full_hi, hi): [lo, full_lo) and [full_hi, hi) masked, [full_lo, full_hi) unmasked. The memory
warpgroup streams the union of the two tiles' runs; a warpgroup steps through the union blocks outside its own
runs without computing (`skip`: it still waits for and releases each stage, so barrier phases stay in step).
"""

import dataclasses
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mjax.kernels.device import SHARED_MEMORY_BYTES

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class MosaicMask:
    """Static mask facts the kernels need in the masked blocks (positions come from `offset` [B])."""

    causal: bool
    window: int | None
    kv_len: int  # keys at or past it are padding
    segments: bool


def tile_transforms():
    """Swizzled layout of a [rows, 64k] tile of a 16-bit dtype: 128-byte rows, the widest swizzle."""
    return plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)


def item_buffers(ring_bytes: int, item_bytes: int) -> int:
    """How many buffers of a persistent kernel's per-item operands fit beside its streamed ring: 2 (the next item's
    load while this one runs) or 1. 4 KiB stay for the rest: Pallas's reduction scratch (2 KiB, 1 KiB aligned), the
    small per-row tiles and the barriers."""
    return 2 if ring_bytes + 2 * item_bytes <= SHARED_MEMORY_BYTES - 4096 else 1


def position_mask(mask: MosaicMask, q_pos, k_pos):
    """Bool where query position q_pos may see key position k_pos (int32 arrays of one shape)."""
    keep = k_pos < mask.kv_len
    if mask.causal:
        keep = keep & (k_pos <= q_pos)
    if mask.window is not None:
        keep = keep & (q_pos - k_pos < mask.window)
    return keep


def union_of_runs(lo0, hi0, lo1, hi1):
    """[L, H) of two runs [lo0, hi0) and [lo1, hi1) (an empty run adds nothing); scalars or arrays."""
    e0, e1 = lo0 >= hi0, lo1 >= hi1
    lo = jnp.where(e0, lo1, jnp.where(e1, lo0, jnp.minimum(lo0, lo1)))
    hi = jnp.where(e0, hi1, jnp.where(e1, hi0, jnp.maximum(hi0, hi1)))
    return lo, jnp.maximum(hi, lo)


def union_range(ranges_ref, batch, first_tile):
    """[L, H) of the blocks tiles first_tile and first_tile + 1 visit."""
    return union_of_runs(ranges_ref[batch, first_tile, 0], ranges_ref[batch, first_tile, 3],
                         ranges_ref[batch, first_tile + 1, 0], ranges_ref[batch, first_tile + 1, 3])


def own_runs(ranges_ref, batch, tile):
    """This warpgroup's (lo, full_lo, full_hi, hi)."""
    return tuple(ranges_ref[batch, tile, i] for i in range(4))


def walk_union(lo_all, hi_all, own, step, skip, carry):
    """step(j, carry, masked) over own runs, skip(j, carry) over the rest of [lo_all, hi_all), in block order."""
    lo, full_lo, full_hi, hi = own
    empty = lo >= hi
    cuts = [jnp.where(empty, hi_all, c) for c in (lo, full_lo, full_hi, hi)]
    carry = lax.fori_loop(lo_all, cuts[0], skip, carry)
    carry = lax.fori_loop(cuts[0], cuts[1], lambda j, c: step(j, c, True), carry)
    carry = lax.fori_loop(cuts[1], cuts[2], lambda j, c: step(j, c, False), carry)
    carry = lax.fori_loop(cuts[2], cuts[3], lambda j, c: step(j, c, True), carry)
    return lax.fori_loop(cuts[3], hi_all, skip, carry)


def compute_items(my_works, compute_work, copy_item, buffers: int):
    """The compute warpgroups of a persistent kernel over their program's items: compute_work(i, ring position) ->
    the next ring position; with two buffers the first item's operands load here and each item loads the next's."""
    plgpu.set_max_registers(232, action="increase")
    if buffers == 2:
        pl.when(my_works > 0)(lambda: copy_item(0, 0))
    lax.fori_loop(0, my_works, compute_work, jnp.int32(0))
    plgpu.wait_smem_to_gmem(0)


def stream_kv(my_works, work, groups: int, block_kv: int, stages: int, k_ref, v_ref, k_smem, v_smem, k_bar, v_bar,
              k_free, v_free):
    """The memory warpgroup of a persistent kernel over query tiles: for each item (work(i) -> (tile, q head, batch
    row, lo, hi)) the K/V blocks [lo, hi) of its KV head into the ring, which keeps streaming across items (a stage
    is reloaded once both compute warpgroups released it)."""
    plgpu.set_max_registers(40, action="decrease")

    def item(i, base):
        _, q_head, batch, lo, hi = work(i)
        kv_head = lax.div(q_head, jnp.array(groups, q_head.dtype))

        @pl.loop(0, hi - lo)
        def _(s):
            g = base + s
            slot = lax.rem(g, jnp.array(stages, jnp.int32))
            rows = (batch, pl.ds((lo + s) * block_kv, block_kv), kv_head)

            @pl.when(g >= stages)
            def _():
                plgpu.barrier_wait(k_free.at[slot])

            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_bar.at[slot])

            @pl.when(g >= stages)
            def _():
                plgpu.barrier_wait(v_free.at[slot])

            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_bar.at[slot])

        return base + hi - lo

    lax.fori_loop(0, my_works, item, jnp.int32(0))
