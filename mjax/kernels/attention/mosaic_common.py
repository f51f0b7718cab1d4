"""Pieces the Mosaic GPU attention kernels share: static mask facts, the tile layout, the in-kernel position mask,
and the walk over one warpgroup's runs of blocks inside the union its program streams.

A program's two compute warpgroups each own a tile of rows and read its block runs from a `ranges` array
(lo, full_lo, full_hi, hi): [lo, full_lo) and [full_hi, hi) masked, [full_lo, full_hi) unmasked. The memory
warpgroup streams the union of the two tiles' runs; a warpgroup steps through the union blocks outside its own
runs without computing (`skip`: it still waits for and releases each stage, so barrier phases stay in step).
"""

import dataclasses
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

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


def position_mask(mask: MosaicMask, q_pos, k_pos):
    """Bool where query position q_pos may see key position k_pos (int32 arrays of one shape)."""
    keep = k_pos < mask.kv_len
    if mask.causal:
        keep = keep & (k_pos <= q_pos)
    if mask.window is not None:
        keep = keep & (q_pos - k_pos < mask.window)
    return keep


def union_range(ranges_ref, batch, first_tile):
    """[L, H) of the blocks tiles first_tile and first_tile + 1 visit (an empty run adds nothing)."""
    lo0, hi0 = ranges_ref[batch, first_tile, 0], ranges_ref[batch, first_tile, 3]
    lo1, hi1 = ranges_ref[batch, first_tile + 1, 0], ranges_ref[batch, first_tile + 1, 3]
    e0, e1 = lo0 >= hi0, lo1 >= hi1
    lo = jnp.where(e0, lo1, jnp.where(e1, lo0, jnp.minimum(lo0, lo1)))
    hi = jnp.where(e0, hi1, jnp.where(e1, hi0, jnp.maximum(hi0, hi1)))
    return lo, jnp.maximum(hi, lo)


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
