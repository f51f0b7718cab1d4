"""Blockwise FP8 grouped matmul (--fp8_recipe=blockwise on an MoE model): the expert GEMMs as DeepSeek-V3 trains
them, all three in FP8 through one custom_vjp, with float32 block scales applied inside the depth loop.

    forward  y  = x @ w[g]       x in 1x128 blocks along K, w[g] in 128x128 blocks
    dgrad    dx = dy @ w[g]^T    dy in 1x128 blocks along N, w[g]'s blocks transposed (the same values and scales)
    wgrad    dw[g] = x_g^T dy_g  x and dy in 128x1 blocks along the tokens M ("pieces", below)

A scale is the dequantization factor s = amax / fp8_max of its block (x ~= q * s; not a power of two), exactly as
the dense recipe (mjax/kernels/quant/blockwise.py, whose quantizers this uses), so both recipes agree. Forward
operands are e4m3, gradients e5m2 with --fp8_format=hybrid (DeepSeek-V3 uses e4m3 for all: --fp8_format=e4m3).

wgrad's pieces. wgrad contracts over the tokens, so its operands need blocks along M, and a block must not mix two
experts' rows: DeepSeek pads each expert's tokens to a multiple of 128, so its 128-row blocks start at each
expert's first row. mjax's dispatch (mjax/model/moe_dispatch.py) does not pad, and a group may start anywhere. Blocks
counted from each group's start would make every chunk the kernel loads unaligned (no vectorized loads along the
contiguous token axis of the transposed copies). Instead a piece is an aligned 128-row block cut at the group
boundaries: the rows of one group inside one aligned block. No scale mixes groups, the kernel's 128-row steps stay
aligned and each step has one scale per column, and a piece is never longer than DeepSeek's block (a group's first
and last piece may be shorter), so its rounding is no worse. The pieces are exactly the row-block visits of
schedule.row_tiles at block 128 (at most ceil(M / 128) + G of them, rows past sum(group_sizes) one more segment):
the scales are sxt [T, K] and sgt [T, N], row t for visit t.

Rows past sum(group_sizes) are zeroed before anything is quantized, so they give zero rows and add nothing (NaN
padding included). `meta` [G, 3] per weight is not read (blockwise has no scaling state); its cotangent reports
the observed amaxes in the per-tensor path's layout (max |x|, max |w[g]|, max |dy|; fp8.py), for the train step's
FP8 statistics as the dense blockwise layer reports its [3]. Under jax.vmap over dispatch groups those maxima are
taken over the batch (fp8.across_batch_max); the block scales themselves are per block, so nothing else couples
the items. Several weights reading one x (the MoE gate and up) share its quantizations.

GEMMs (`gemm`, from --moe_grouped_gemm_impl): "pallas" runs fp8_blockwise_pallas.py's kernels; "xla" dequantizes
the same quantized values to float32 and runs lax.ragged_dot (the reference; what CPU runs). x's wgrad copy is
quantized in the forward and saved in FP8 (1 byte an element; the dense recipe saves x in the compute dtype).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from mjax.kernels.quant.blockwise import BLOCK, _block_scale, quantize_rows, quantize_tiles
from mjax.kernels.quant.fp8 import FORMATS, fp8_max
from mjax.kernels.grouped_matmul import fp8_blockwise_pallas as kernels
from mjax.kernels.grouped_matmul.fp8 import _valid_rows, across_batch_max
from mjax.kernels.grouped_matmul.reference import ragged_product, ragged_product_vjp
from mjax.kernels.grouped_matmul.schedule import group_bounds, row_tiles
from mjax.kernels.grouped_matmul.tiling import Tiling


@dataclasses.dataclass(frozen=True)
class GroupedBlockwisePlan:
    """The static part of one call: --fp8_format, the GEMMs (xla | pallas), each weight's tiling (pallas) and
    whether the kernels run interpreted."""
    format: str = "hybrid"
    gemm: str = "xla"
    tilings: tuple[Tiling | None, ...] = (None,)
    interpret: bool = False

    @property
    def dtypes(self):
        return FORMATS[self.format]


# ---- quantization ----

def wgrad_pieces(group_sizes, rows: int):
    """The quantization pieces of wgrad's operands: (visits [4, T] of schedule.row_tiles at block 128, one per
    piece; per group [3, G]: its start row, end row and first piece)."""
    starts, ends = group_bounds(group_sizes, rows)
    first_block = starts // BLOCK
    count = jnp.where(ends > starts, (ends - 1) // BLOCK - first_block + 1, 0)  # [G] pieces per group
    return row_tiles(group_sizes, rows, BLOCK), jnp.stack([starts, ends, jnp.cumsum(count) - count])


def piece_of_row(visits, rows: int):
    """[M] int32: the piece holding each row. The pieces tile the rows in order (unused visits start at or past M),
    so a row's piece is the last one starting at or before it."""
    return (jnp.searchsorted(visits[2], jnp.arange(rows, dtype=jnp.int32), side="right") - 1).astype(jnp.int32)


def quantize_pieces(v, visits, dtype):
    """v [M, C] -> (q [M, C] fp8, s [T, C] f32): each column of each piece is one block, s = its amax / fp8_max."""
    rows, c = v.shape
    _, row0, first, last = visits
    n_blocks = -(-rows // BLOCK)
    vb = jnp.pad(v, ((0, n_blocks * BLOCK - rows), (0, 0))).reshape(n_blocks, BLOCK, c)  # [M/128, 128, C]
    block = jnp.clip(row0 // BLOCK, 0, n_blocks - 1)  # unused visits own no rows (first >= last): any block will do
    row = block[:, None] * BLOCK + jnp.arange(BLOCK, dtype=jnp.int32)  # [T, 128]
    inside = ((row >= first[:, None]) & (row < last[:, None]))[..., None]  # [T, 128, 1]
    piece_amax = jnp.max(jnp.where(inside, jnp.abs(vb[block].astype(jnp.float32)), 0.0), axis=1)  # [T, C]
    s = _block_scale(piece_amax, dtype)
    m = fp8_max(dtype)
    q = jnp.clip(v.astype(jnp.float32) / s[piece_of_row(visits, rows)], -m, m).astype(dtype)  # [M, C]
    return q, s


def quantize_experts(w, dtype):
    """w [G, K, N] -> (q [G, K, N] fp8, s [G, K/128, N/128] f32, amax [G]): 128x128 blocks per expert."""
    return jax.vmap(lambda w: quantize_tiles(w, dtype))(w)


def expand_cols(s):
    """[G, D/128, C/128] block scales -> [G, D/128, C]: each repeated over its 128 columns (the kernels' layout)."""
    return jnp.repeat(s, BLOCK, axis=2)


def _exact(q):
    """The FP8 values in float32. The barrier keeps XLA's simplifier from folding the float -> FP8 -> float round
    trip away (as fp8._dequantize explains)."""
    return lax.optimization_barrier(q).astype(jnp.float32)


def dequantize_rows(q, s):  # q [R, C], s [R, C/128] -> [R, C] f32
    return _exact(q) * jnp.repeat(s, BLOCK, axis=1)


def dequantize_experts(q, s):  # q [G, K, N], s [G, K/128, N/128] -> [G, K, N] f32
    return _exact(q) * jnp.repeat(expand_cols(s), BLOCK, axis=1)


def dequantize_pieces(q, s, visits):  # q [M, C], s [T, C] -> [M, C] f32
    return _exact(q) * s[piece_of_row(visits, q.shape[0])]


# ---- the op ----

@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def grouped_blockwise(x, ws, group_sizes, metas, plan: GroupedBlockwisePlan):
    """x [M, K] compute dtype, ws: tuple of w [G, K, N_i], group_sizes [G] int32, metas: tuple of [G, 3] f32 (unread)
    -> tuple of y [M, N_i] in x.dtype. Shapes and plan are checked by the caller (blockwise_grouped_matmul)."""
    return _fwd(x, ws, group_sizes, metas, plan)[0]


def _fwd(x, ws, group_sizes, metas, plan):
    del metas
    fwd_dtype, _ = plan.dtypes
    pallas = plan.gemm == "pallas"
    rows = x.shape[0]
    x = jnp.where(_valid_rows(rows, group_sizes), x, jnp.zeros((), x.dtype))
    xq, sx, ax = quantize_rows(x, fwd_dtype)  # [M, K], [M, K/128]: the forward's 1x128 blocks
    visits, pieces = wgrad_pieces(group_sizes, rows)
    xpq, sxp = quantize_pieces(x, visits, fwd_dtype)  # [M, K], [T, K]: wgrad's blocks along M
    ys, saved_w = [], []
    for w, tiling in zip(ws, plan.tilings):
        wq, sw, aw = quantize_experts(w, fwd_dtype)  # [G, K, N], [G, K/128, N/128], [G]
        if pallas:
            y = kernels.forward(xq, sx.T, jnp.swapaxes(wq, 1, 2), expand_cols(sw), group_sizes, tile=tiling.forward,
                                interpret=plan.interpret, out_dtype=x.dtype)  # [M, N]
        else:
            y = ragged_product(dequantize_rows(xq, sx), dequantize_experts(wq, sw), group_sizes).astype(x.dtype)
        ys.append(y)
        saved_w.append((wq, sw, across_batch_max(aw), jnp.zeros((0,), w.dtype)))  # the w dtype rides on an array
    saved_x = (xpq.T if pallas else xpq, sxp, across_batch_max(ax))
    return tuple(ys), (saved_x, tuple(saved_w), visits, pieces, group_sizes, jnp.zeros((0,), x.dtype))


def _bwd(plan, res, dys):
    (xpq, sxp, ax), saved_w, visits, pieces, group_sizes, x_like = res
    _, grad_dtype = plan.dtypes
    pallas = plan.gemm == "pallas"
    valid = _valid_rows(dys[0].shape[0], group_sizes)
    dx, dws, observed = None, [], []
    for dy, (wq, sw, aw, w_like), tiling in zip(dys, saved_w, plan.tilings):
        dy = jnp.where(valid, dy, jnp.zeros((), dy.dtype))
        gq, sg, ag = quantize_rows(dy, grad_dtype)  # [M, N], [M, N/128]: dgrad's 1x128 blocks along N
        gpq, sgp = quantize_pieces(dy, visits, grad_dtype)  # [M, N], [T, N]: wgrad's blocks along M
        if pallas:
            dx_part = kernels.dgrad(gq, sg.T, wq, expand_cols(jnp.swapaxes(sw, 1, 2)), group_sizes,
                                    tile=tiling.dgrad, interpret=plan.interpret, out_dtype=x_like.dtype)  # [M, K]
            dw = kernels.wgrad(xpq, sxp, gpq.T, sgp, pieces, tile=tiling.wgrad, interpret=plan.interpret)
        else:
            wd = dequantize_experts(wq, sw)  # [G, K, N]
            dx_part = ragged_product(dequantize_rows(gq, sg), jnp.swapaxes(wd, 1, 2), group_sizes)  # [M, K]
            _, dw = ragged_product_vjp(dequantize_pieces(xpq, sxp, visits), wd, group_sizes,
                                       dequantize_pieces(gpq, sgp, visits))  # [G, K, N]; its dx is unused
        dx_part = dx_part.astype(x_like.dtype)
        dx = dx_part if dx is None else dx + dx_part
        dws.append(dw.astype(w_like.dtype))
        ag = across_batch_max(ag)
        observed.append(jnp.stack([jnp.broadcast_to(ax, aw.shape), aw, jnp.broadcast_to(ag, aw.shape)], axis=-1))
    return dx, tuple(dws), None, tuple(observed)  # observed [G, 3]: the amaxes in meta's layout


grouped_blockwise.defvjp(_fwd, _bwd)
