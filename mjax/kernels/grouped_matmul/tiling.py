"""Tiles of the grouped-matmul kernels and what a tiling can do: the capability facts behind `impl="pallas"`.

Each of the three kernels is a GEMM of its own, [rows of the output, columns of the output] contracting a depth:
    forward  y  [M, N] = x [M, K] . w[g] [K, N]        tile rows over M, columns over N, depth K
    dgrad    dx [M, K] = dy [M, N] . w[g]^T [N, K]     tile rows over M, columns over K, depth N
    wgrad    dw[g] [K, N] = x_g^T [K, M_g] . dy_g      tile rows over K, columns over N, depth M_g (any length)
A `KernelTile` is one kernel's [block_m, block_n] output tile and block_k depth step; `Tiling` holds all three.
Columns and depth must be whole blocks (no masks on the hot loop); rows of the grouped dimension M never need to.
"""

import dataclasses
import re

import jax.numpy as jnp

from mjax.kernels.device import SHARED_MEMORY_BYTES

DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)
# FP8 tensor-core instructions contract 32 elements at a time (mma k32, wgmma k32): depth steps of the FP8 kernels
# are at least that.
FP8_MIN_DEPTH = 32

_TILE_RE = re.compile(r"^(\d+)x(\d+)x(\d+)w(\d+)s(\d+)(?:g(\d+))?$")


@dataclasses.dataclass(frozen=True)
class KernelTile:
    """One kernel's tile: [block_m, block_k] x [block_k, block_n] per step of the depth loop; Triton launch
    parameters; group_m output row tiles are walked together so that programs running at once share operand
    tiles in L2 (grouped ordering). Written "128x128x64w4s3" (optionally "g8")."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4
    group_m: int = 8

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value % 16:
                raise ValueError(f"KernelTile.{name}={value} must be a multiple of 16")
        # 12: the Mosaic GPU kernels' memory warpgroup and two compute warpgroups (Triton takes powers of two).
        if self.num_warps not in (1, 2, 4, 8, 12, 16) or self.num_stages < 1 or self.group_m < 1:
            raise ValueError(f"KernelTile {self}: num_warps must be a power of two <= 16 or 12, num_stages and "
                             "group_m >= 1")

    @classmethod
    def parse(cls, text: str) -> "KernelTile":
        match = _TILE_RE.match(text.strip())
        if not match:
            raise ValueError(f"tile {text!r} is not of the form BMxBNxBKwWARPSsSTAGES[gGROUP], e.g. 128x128x64w4s3")
        bm, bn, bk, warps, stages, group = match.groups()
        return cls(int(bm), int(bn), int(bk), int(warps), int(stages), int(group or 8))

    def __str__(self):
        return (f"{self.block_m}x{self.block_n}x{self.block_k}w{self.num_warps}s{self.num_stages}"
                + ("" if self.group_m == 8 else f"g{self.group_m}"))

    def shared_bytes(self, itemsize: int) -> int:
        return self.num_stages * (self.block_m * self.block_k + self.block_k * self.block_n) * itemsize


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Tiles of the forward, input-gradient (dgrad) and weight-gradient (wgrad) kernels."""

    forward: KernelTile = KernelTile()
    dgrad: KernelTile = KernelTile()
    wgrad: KernelTile = KernelTile()

    @classmethod
    def uniform(cls, tile: KernelTile) -> "Tiling":
        return cls(tile, tile, tile)

    def __str__(self):
        return f"forward={self.forward} dgrad={self.dgrad} wgrad={self.wgrad}"


def _largest_dividing(size: int, options) -> int | None:
    return next((b for b in options if size % b == 0), None)


def default_tiling(dtype, k: int, n: int) -> Tiling | None:
    """The widest column block up to 256 and depth block up to 64 (32 for float32, whose tiles are twice the bytes)
    that divide the shape, for every kernel; None when K or N is not a multiple of 16. On an H200, 128x256x64 with
    8 warps and 3 stages was the fastest of the tiles swept for all three kernels at every MoE shape measured
    (docs/moe.md, `python -m benchmarks.bench_grouped_matmul --tilings`)."""
    f32 = jnp.dtype(dtype) == jnp.float32
    depths = (32, 16) if f32 else (64, 32, 16)

    def gemm(cols: int, depth: int) -> KernelTile | None:
        bn, bk = _largest_dividing(cols, (256, 128, 64, 32, 16)), _largest_dividing(depth, depths)
        if bn is None or bk is None:
            return None
        wide = bn == 256
        return KernelTile(128, bn, bk, num_warps=8 if wide else 4, num_stages=3 if wide else 4)

    forward, dgrad = gemm(n, k), gemm(k, n)
    bm, bn = _largest_dividing(k, (128, 64, 32, 16)), _largest_dividing(n, (256, 128, 64, 32, 16))
    if forward is None or dgrad is None or bm is None or bn is None:
        return None
    wide = bn == 256
    return Tiling(forward, dgrad, KernelTile(bm, bn, depths[0], num_warps=8 if wide else 4,
                                             num_stages=3 if wide else 4))


def default_fp8_tiling(k: int, n: int, grad_native: bool) -> Tiling | None:
    """Tiles of the FP8 kernels (fp8_pallas.py); None when K or N is not a multiple of 32. A dot of FP8 operands
    steps 128 deep (128 bytes a row, as the 16-bit kernels' 64); the backward of --fp8_format=hybrid converts its
    e5m2 x e4m3 tiles to float16 (`grad_native` False) and so steps 64 deep, like the 16-bit kernels. Untuned: the
    sweep is `python -m benchmarks.bench_grouped_matmul --fp8 --tilings=...` on the GPU."""
    native, upcast = (128, 64, 32), (64, 32)

    def gemm(cols: int, depth: int, depths) -> KernelTile | None:
        bn, bk = _largest_dividing(cols, (256, 128, 64, 32)), _largest_dividing(depth, depths)
        if bn is None or bk is None:
            return None
        wide = bn == 256
        return KernelTile(128, bn, bk, num_warps=8 if wide else 4, num_stages=3 if wide else 4)

    back = native if grad_native else upcast
    forward, dgrad = gemm(n, k, native), gemm(k, n, back)
    bm, bn = _largest_dividing(k, (128, 64, 32)), _largest_dividing(n, (256, 128, 64, 32))
    if forward is None or dgrad is None or bm is None or bn is None:
        return None
    wide = bn == 256
    return Tiling(forward, dgrad, KernelTile(bm, bn, back[0], num_warps=8 if wide else 4,
                                             num_stages=3 if wide else 4))


def fp8_tiling_problem(tiling: Tiling, k: int, n: int) -> str | None:
    """None if every FP8 kernel of `tiling` can run x [M, K] . w [G, K, N] (1-byte operands), else the reason."""
    for kernel in ("forward", "dgrad", "wgrad"):
        tile = getattr(tiling, kernel)
        if tile.block_k < FP8_MIN_DEPTH:
            return f"the FP8 {kernel} tile {tile} steps {tile.block_k} deep; FP8 dots need block_k >= {FP8_MIN_DEPTH}"
    return tiling_problem(tiling, jnp.float8_e4m3fn, k, n)


def kernel_tile_problem(kernel: str, tile: KernelTile, dtype, k: int, n: int) -> str | None:
    """None if `tile` fits kernel ("forward", "dgrad" or "wgrad") of x [M, K] . w [G, K, N] in `dtype`, else the
    reason in words."""
    # The tile's (block_m, block_n, block_k) run over: forward (M, N, K), dgrad (M, K, N), wgrad (K, N, M_g).
    dims = {"forward": (None, ("N", n), ("K", k)), "dgrad": (None, ("K", k), ("N", n)),
            "wgrad": (("K", k), ("N", n), None)}[kernel]
    for field, dim in zip(("block_m", "block_n", "block_k"), dims):
        block = getattr(tile, field)
        if block & (block - 1):
            return f"the Triton {kernel} tile {tile} needs {field}={block} to be a power of two"
        if dim is not None and dim[1] % block:
            return f"the {kernel} kernel needs {dim[0]}={dim[1]} to be a multiple of {field}={block}"
    if tile.num_warps & (tile.num_warps - 1):
        return f"the Triton {kernel} tile {tile} needs num_warps to be a power of two"
    itemsize = jnp.dtype(dtype).itemsize
    # The pipelined loads hold num_stages copies of an operand tile pair; a tile that needs more shared memory than
    # a block may use fails inside Triton's compiler with an opaque resource error.
    if tile.shared_bytes(itemsize) > SHARED_MEMORY_BYTES:
        return (f"the {kernel} tile {tile} needs {tile.shared_bytes(itemsize) // 1024} KiB of shared memory for "
                f"{jnp.dtype(dtype).name} (at most {SHARED_MEMORY_BYTES // 1024}); use fewer stages or smaller blocks")
    return None


def tiling_problem(tiling: Tiling, dtype, k: int, n: int) -> str | None:
    """None if every kernel of `tiling` can run x [M, K] . w [G, K, N] in `dtype`, else the first reason."""
    for kernel in ("forward", "dgrad", "wgrad"):
        reason = kernel_tile_problem(kernel, getattr(tiling, kernel), dtype, k, n)
        if reason:
            return reason
    return None


MOSAIC_EPILOGUE_COLS = 64  # the column slices a warp-specialised output tile is staged in when it does not fit whole
MOSAIC_SPECIALIZED_WARPS = (8, 12)  # Mosaic GPU tiles of these many warps run the warp-specialised kernels
MOSAIC_MIN_STAGES = 4  # fewer measured 10-15% slower at 128 x 256 (docs/moe.md); slicing the staging buys them


def mosaic_compute_warpgroups(tile: KernelTile) -> int:
    """Compute warpgroups of a warp-specialised Mosaic GPU tile (num_warps 8 or 12): all but its memory warpgroup."""
    assert tile.num_warps in MOSAIC_SPECIALIZED_WARPS, tile
    return tile.num_warps // 4 - 1


def mosaic_epilogue_cols(tile: KernelTile, itemsize: int) -> int:
    """Columns of a compute warpgroup's accumulator a warp-specialised kernel stages in shared memory at once: all
    of them when the whole output tile fits beside the load ring, else MOSAIC_EPILOGUE_COLS at a time."""
    whole = tile.shared_bytes(itemsize) + tile.block_m * tile.block_n * itemsize <= SHARED_MEMORY_BYTES
    return tile.block_n // mosaic_compute_warpgroups(tile) if whole else MOSAIC_EPILOGUE_COLS


def mosaic_shared_bytes(tile: KernelTile, itemsize: int) -> int:
    """A warp-specialised Mosaic GPU tile's shared memory: the load ring and every compute warpgroup's staging."""
    staged = mosaic_compute_warpgroups(tile) * tile.block_m * mosaic_epilogue_cols(tile, itemsize) * itemsize
    return tile.shared_bytes(itemsize) + staged


def default_mosaic_tiling(k: int, n: int, specialized: bool = True) -> Tiling | None:
    """Tiles of the Mosaic GPU kernels (mosaic.py), None unless K and N are multiples of 64: 128-row tiles, 64 deep.
    Forward and dgrad may end in a partial column tile: their width maximises the columns used times the tile's
    operand reuse bn / (bm + bn). specialized (the default): the warp-specialised kernels, 256 columns wide on two
    compute warpgroups (12 warps) or up to 192 on one (8 warps), with as many stages (at most 6) as fit beside the
    output staging in shared memory; wgrad 128 columns wide first (6 stages; wider tiles leave a large group's
    long tiles to fewer programs). Otherwise one warpgroup (4 warps, at most 192 columns), 4 stages, wgrad as wide
    as divides. H200 measurements behind both: docs/moe.md."""
    if k % 64 or n % 64:
        return None

    def tile(rows: int, cols: int, partial: bool, widths) -> KernelTile:
        bm = 128 if rows % 128 == 0 else 64
        if partial:
            bn = max(widths, key=lambda b: cols / (-(-cols // b) * b) * b / (bm + b))
        else:
            bn = next(b for b in widths if cols % b == 0)
        if not specialized:
            return KernelTile(bm, bn, 64, num_warps=4, num_stages=4, group_m=4)
        # As many stages as fit beside the whole output tile; where that is under MOSAIC_MIN_STAGES, as many as fit
        # beside its staging slices (128 x 192 keeps 4 stages whole, 128 x 256 takes 4 sliced instead of 3 whole).
        warps = 12 if bn > 192 else 8
        tiles = [KernelTile(bm, bn, 64, num_warps=warps, num_stages=s, group_m=4) for s in range(2, 7)]
        whole = [t for t in tiles if t.shared_bytes(2) + 2 * bm * bn <= SHARED_MEMORY_BYTES]
        if whole and whole[-1].num_stages >= MOSAIC_MIN_STAGES:
            return whole[-1]
        return [t for t in tiles if mosaic_shared_bytes(t, 2) <= SHARED_MEMORY_BYTES][-1]

    rows_widths = (256, 192, 128, 64) if specialized else (192, 128, 64)
    wgrad_widths = (128, 192, 64) if specialized else (192, 128, 64)
    return Tiling(forward=tile(128, n, True, rows_widths), dgrad=tile(128, k, True, rows_widths),
                  wgrad=tile(k, n, False, wgrad_widths))


BLOCKWISE_DEPTH = 128  # --fp8_recipe=blockwise: one 1x128 / 128x128 block scale per depth step


def default_blockwise_tiling(k: int, n: int) -> Tiling | None:
    """Tiles of the blockwise FP8 kernels (fp8_blockwise_pallas.py), None unless K and N are multiples of 128:
    small output tiles stepping 128 deep (one scale per step), 4 warps, 4 stages. Each step's product is scaled
    before it joins the accumulator, so a tile holds two float32 [bm, bn] values in registers: the 128x64 (forward,
    dgrad) and 64x128 (wgrad) tiles measured fastest of eight at DeepSeek-V3's expert shapes (docs/deepseek.md)."""
    if k % BLOCKWISE_DEPTH or n % BLOCKWISE_DEPTH:
        return None
    rows = KernelTile(128, 64, BLOCKWISE_DEPTH, num_warps=4, num_stages=4)
    return Tiling(forward=rows, dgrad=rows, wgrad=KernelTile(64, 128, BLOCKWISE_DEPTH, num_warps=4, num_stages=4))


def blockwise_tiling_problem(tiling: Tiling, k: int, n: int) -> str | None:
    """None if every blockwise FP8 kernel of `tiling` can run x [M, K] . w [G, K, N], else the reason."""
    for kernel in ("forward", "dgrad", "wgrad"):
        tile = getattr(tiling, kernel)
        if tile.block_k != BLOCKWISE_DEPTH:
            return (f"the blockwise FP8 {kernel} tile {tile} steps {tile.block_k} deep; it must step "
                    f"{BLOCKWISE_DEPTH} (one block scale per step)")
    return tiling_problem(tiling, jnp.float8_e4m3fn, k, n)
