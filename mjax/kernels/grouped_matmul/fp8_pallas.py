"""The FP8 grouped-matmul kernels (Pallas, Triton lowering): FP8 operands into the dot, float32 accumulation, the
dequantization in the epilogue (one f32 factor per group: the product of two power-of-two inverse scales, exact),
the output in the compute dtype. Interpreted off GPU.

Every operand is read K-major, as Hopper's FP8 MMAs want it (and as cuBLASLt's FP8 GEMMs do): the op quantizes each
tensor into the layouts its GEMMs read (fp8.py), so no kernel transposes an FP8 tile.

    forward  y  [M, N] = xq [M, K] . wq_t[g]^T    wq_t [G, N, K]   the row-block kernel of pallas.py, w transposed
    dgrad    dx [M, K] = gq [M, N] . wq[g]^T      wq   [G, K, N]   the same kernel
    wgrad    dw [G, K, N] = xq_t [K, M_g] . gq_t[N, M_g]^T          below: both copies transposed, rows contiguous

wgrad walks a group's rows in chunks aligned to block_k (unaligned starts would defeat vectorized loads along the
contiguous row axis): the first and last chunk of a group hold rows of its neighbours, whose x columns are zeroed
in registers (x is the MMA's A operand, which may live in registers; B stays as loaded). Rows past sum(group_sizes)
are zeros in both copies (the op zeroes them before quantizing), so only a NaN in a neighbouring group's gradient
could reach this group's dw, in a step whose gradients are then not finite anyway.

Pallas-Triton's dot takes two operands of one dtype: e4m3 x e4m3 (the forward; the backward with
--fp8_format=e4m3) goes to the FP8 MMA as it is; hybrid's e5m2 gradient against e4m3 tiles converts both tiles to
float16 in registers (`upcast`), which holds every e4m3 and e5m2 value exactly, so the products are the same.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from mjax.kernels.attention.flash_common import compiler_params, dot
from mjax.kernels.grouped_matmul.pallas import row_block_matmul
from mjax.kernels.grouped_matmul.schedule import group_bounds, swizzle
from mjax.kernels.grouped_matmul.tiling import KernelTile

UPCAST = jnp.float16  # exact for e4m3 (3 mantissa bits, 2^-9..448) and e5m2 (2 bits, 2^-16..57344)


def upcast_for(a_dtype, b_dtype, mma: str = "auto"):
    """The dtype the kernel converts its tiles to (None: the FP8 tiles go into the dot). mma="f16" converts even
    operands of one format (for measuring the FP8 MMA against the 16-bit one)."""
    if mma not in ("auto", "f16"):
        raise ValueError(f"mma={mma!r} is not auto or f16")
    return None if mma == "auto" and jnp.dtype(a_dtype) == jnp.dtype(b_dtype) else UPCAST


@functools.partial(jax.jit, static_argnames=("tile", "interpret", "out_dtype", "mma"))
def forward(xq, wq_t, group_sizes, scale, *, tile: KernelTile, interpret: bool, out_dtype, mma: str = "auto"):
    """y [M, N] = (xq [M, K] . wq_t[g] [N, K]^T) * scale[g] per group, zero rows past sum(group_sizes)."""
    return row_block_matmul(xq, wq_t, group_sizes, tile=tile, transpose_w=True, interpret=interpret,
                            name="mjax_grouped_fp8_fwd", scale=scale, upcast=upcast_for(xq.dtype, wq_t.dtype, mma),
                            out_dtype=out_dtype)


@functools.partial(jax.jit, static_argnames=("tile", "interpret", "out_dtype", "mma"))
def dgrad(gq, wq, group_sizes, scale, *, tile: KernelTile, interpret: bool, out_dtype, mma: str = "auto"):
    """dx [M, K] = (gq [M, N] . wq[g] [K, N]^T) * scale[g] per group, zero rows past sum(group_sizes)."""
    return row_block_matmul(gq, wq, group_sizes, tile=tile, transpose_w=True, interpret=interpret,
                            name="mjax_grouped_fp8_dgrad", scale=scale, upcast=upcast_for(gq.dtype, wq.dtype, mma),
                            out_dtype=out_dtype)


def _wgrad_kernel(bounds_ref, scale_ref, xt_ref, gt_ref, dw_ref, *, tile: KernelTile, n_k_blocks: int,
                  n_n_blocks: int, rows: int, upcast):
    """One [block_m, block_n] tile of dw[g] = scale[g] * x_g^T g_g from the transposed copies, block_k rows at a
    time from the aligned chunk holding the group's first row."""
    bm, bn, bk = tile.block_m, tile.block_n, tile.block_k
    i, j = swizzle(pl.program_id(0), n_k_blocks, n_n_blocks, tile.group_m)
    g = pl.program_id(1)
    start, end = bounds_ref[0, g], bounds_ref[1, g]
    first = lax.div(start, jnp.int32(bk)) * bk
    k0 = pl.multiple_of(i * bm, bm)
    n0 = pl.multiple_of(j * bn, bn)

    def body(c, acc):
        r0 = pl.multiple_of(first + c * bk, bk)
        cols = r0 + jnp.arange(bk, dtype=jnp.int32)
        # Only a chunk past the last row needs a load mask (a static fact): the arrays end there.
        past = None if rows % bk == 0 else (cols < rows)[None, :]
        xt = pltriton.load(xt_ref.at[pl.ds(k0, bm), pl.ds(r0, bk)],  # [bm, bk]
                           mask=None if past is None else jnp.broadcast_to(past, (bm, bk)),
                           other=None if past is None else jnp.zeros((), xt_ref.dtype))
        gt = pltriton.load(gt_ref.at[pl.ds(n0, bn), pl.ds(r0, bk)],  # [bn, bk]
                           mask=None if past is None else jnp.broadcast_to(past, (bn, bk)),
                           other=None if past is None else jnp.zeros((), gt_ref.dtype))
        mine = jnp.broadcast_to(((cols >= start) & (cols < end))[None, :], (bm, bk))
        xt = jnp.where(mine, xt, jnp.zeros((bm, bk), xt.dtype))  # the neighbours' rows of this chunk add nothing
        if upcast is not None:
            xt, gt = xt.astype(upcast), gt.astype(upcast)
        return acc + dot(xt, gt, trans_b=True)  # [bm, bk] . [bn, bk]^T -> [bm, bn]

    chunks = jnp.where(end > start, lax.div(end - first + (bk - 1), jnp.int32(bk)), 0)
    acc = lax.fori_loop(0, chunks, body, jnp.zeros((bm, bn), jnp.float32))
    dw_ref[g, pl.ds(k0, bm), pl.ds(n0, bn)] = (acc * scale_ref[g]).astype(dw_ref.dtype)


@functools.partial(jax.jit, static_argnames=("tile", "interpret", "mma"))
def wgrad(xq_t, gq_t, group_sizes, scale, *, tile: KernelTile, interpret: bool, mma: str = "auto"):
    """dw [G, K, N] float32 = scale[g] * xq_t[:, rows of g] . gq_t[:, rows of g]^T per group (zeros for an empty
    group), from xq_t [K, M] and gq_t [N, M]."""
    (k, rows), n = xq_t.shape, gq_t.shape[0]
    groups = group_sizes.shape[0]
    bounds = jnp.stack(group_bounds(group_sizes, rows))  # [2, G]
    n_k_blocks, n_n_blocks = k // tile.block_m, n // tile.block_n
    kernel = functools.partial(_wgrad_kernel, tile=tile, n_k_blocks=n_k_blocks, n_n_blocks=n_n_blocks, rows=rows,
                               upcast=upcast_for(xq_t.dtype, gq_t.dtype, mma))
    return pl.pallas_call(
        kernel,
        grid=(n_k_blocks * n_n_blocks, groups),
        out_shape=jax.ShapeDtypeStruct((groups, k, n), jnp.float32),
        compiler_params=compiler_params(tile.num_warps, tile.num_stages),
        interpret=interpret,
        name="mjax_grouped_fp8_wgrad",
    )(bounds, scale, xq_t, gq_t)
