"""The blockwise FP8 cases of bench_grouped_matmul.py (--fp8_blockwise): the grouped matmul as training calls it
(--fp8_recipe=blockwise on an MoE model), its three kernels on operands quantized beforehand (to time the GEMMs
alone), and the dense blockwise GEMM of the linear layers (mjax/kernels/quant/block_gemm.py) as its ceiling."""

import jax
import jax.numpy as jnp

from mjax.kernels.quant import blockwise as dense
from mjax.kernels.quant.fp8 import FORMATS
from mjax.kernels.grouped_matmul import blockwise_grouped_matmul
from mjax.kernels.grouped_matmul import fp8_blockwise as gbw
from mjax.kernels.grouped_matmul import fp8_blockwise_pallas as kernels
from mjax.kernels.grouped_matmul.tiling import BLOCKWISE_DEPTH, Tiling, kernel_tile_problem


def shape_problem(k: int, n: int) -> str | None:
    """None if x [M, K] . w [G, K, N] can run blockwise, else why not."""
    if k % BLOCKWISE_DEPTH or n % BLOCKWISE_DEPTH:
        return f"blockwise FP8 needs K and N multiples of {BLOCKWISE_DEPTH}, got K={k}, N={n}"
    return None


def training_call(fmt: str, impl: str = "pallas"):
    """fn(x, w, gs) of the blockwise grouped matmul as training calls it: block scales, casts and GEMMs, every call."""
    return lambda x, w, gs: blockwise_grouped_matmul(x, w, gs, jnp.ones((w.shape[0], 3), jnp.float32), fmt,
                                                     impl=impl)


def operands(x, w, dy, fmt: str):
    """The kernels' FP8 operands and scales, quantized once, in the layouts the op hands them. wgrad's operands are
    quantized in the pieces of one group holding every row; kernel_calls takes the pieces of the group sizes it is
    given (their values do not change the kernels' work)."""
    fwd_dtype, grad_dtype = FORMATS[fmt]
    xq, sx, _ = dense.quantize_rows(x, fwd_dtype)
    wq, sw, _ = gbw.quantize_experts(w, fwd_dtype)
    gq, sg, _ = dense.quantize_rows(dy, grad_dtype)
    visits, _ = gbw.wgrad_pieces(jnp.asarray([x.shape[0]], jnp.int32), x.shape[0])
    xpq, sxp = gbw.quantize_pieces(x, visits, fwd_dtype)
    gpq, sgp = gbw.quantize_pieces(dy, visits, grad_dtype)
    pad = ((0, w.shape[0]), (0, 0))  # [T, C]: as many pieces as the group sizes may have (ceil(M / 128) + G)
    return dict(xq=xq, sx_t=sx.T, wq=wq, wq_t=jnp.swapaxes(wq, 1, 2), sw_cols=gbw.expand_cols(sw),
                sw_cols_t=gbw.expand_cols(jnp.swapaxes(sw, 1, 2)), gq=gq, sg_t=sg.T, xpq_t=xpq.T,
                sxp=jnp.pad(sxp, pad, constant_values=1.0), gpq_t=gpq.T, sgp=jnp.pad(sgp, pad, constant_values=1.0))


def kernel_calls(q, gs, tiling: Tiling, out_dtype, mma: str):
    """{kernel: thunk} of the three blockwise kernels on `operands` (mma: fp8_pallas.upcast_for's choice)."""
    common = dict(interpret=jax.default_backend() != "gpu", mma=mma)
    pieces = gbw.wgrad_pieces(gs, q["xq"].shape[0])[1]  # [3, G]
    return {"forward": lambda: kernels.forward(q["xq"], q["sx_t"], q["wq_t"], q["sw_cols"], gs, tile=tiling.forward,
                                               out_dtype=out_dtype, **common),
            "dgrad": lambda: kernels.dgrad(q["gq"], q["sg_t"], q["wq"], q["sw_cols_t"], gs, tile=tiling.dgrad,
                                           out_dtype=out_dtype, **common),
            "wgrad": lambda: kernels.wgrad(q["xpq_t"], q["sxp"], q["gpq_t"], q["sgp"], pieces, tile=tiling.wgrad,
                                           **common)}


def tile_problem(kernel: str, tile, k: int, n: int) -> str | None:
    """None if `tile` fits blockwise `kernel` of x [M, K] . w [G, K, N], else the reason."""
    if tile.block_k != BLOCKWISE_DEPTH:
        return f"blockwise FP8 kernels step {BLOCKWISE_DEPTH} deep (one block scale per step)"
    return kernel_tile_problem(kernel, tile, jnp.float8_e4m3fn, k, n)


def dense_calls(x, w0, dy, fmt: str):
    """(forward on operands quantized once, forward + backward of the dense blockwise linear layer) for x [M, K] and
    w0 [K, N]: the block-scaled GEMM of equal FLOPs without groups, Pallas on a GPU."""
    on_gpu = jax.default_backend() == "gpu"
    spec = dense.BlockwiseSpec(fmt, impl="pallas", interpret=not on_gpu)
    fwd_dtype = FORMATS[fmt][0]
    xq, sx, _ = dense.quantize_rows(x, fwd_dtype)
    wq, sw, _ = dense.quantize_tiles(w0, fwd_dtype)
    fwd = jax.jit(lambda a, sa, bt, sb: dense.block_gemm(a, sa, bt, sb, x.dtype, spec))

    def both(x, w0, dy):
        y, vjp = jax.vjp(lambda x, w: dense.blockwise_matmul(x, w, jnp.ones(3), spec), x, w0)
        return (y, *vjp(dy))

    return (fwd, (xq, sx, wq.T, dense.expand_cols(sw))), (jax.jit(both), (x, w0, dy))

