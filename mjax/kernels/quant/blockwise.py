"""Blockwise FP8 (DeepSeek-V3 style): 1x128 scales for activations and gradients, 128x128 for weights.

cuBLASLt on Hopper takes only per-tensor scales, so a block-scaled GEMM is our own kernel (`block_gemm.py`,
Pallas) or this file's pure-JAX reference, which dequantizes through f32 (the oracle, and the path off GPU).

Here a block scale is the *dequantization* factor, s = amax / fp8_max, so x ~= q * s (DeepSeek's convention;
per-tensor code in fp8.py stores the reciprocal). Every GEMM is one shape of contraction:

    block_gemm(a [M, K] fp8, sa [M, K/128], bt [N, K] fp8, sb [K/128, N]) -> a @ bt.T [M, N]
        = sum over k-blocks kb of (a[:, kb] @ bt[:, kb].T) * sa[:, kb] * sb[kb, :]

so a 128x128 weight block scale is repeated over its 128 columns, and each operand is quantized in blocks along
the dimension that GEMM contracts: forward x 1x128 along K; dgrad grad 1x128 along N with the weight blocks
transposed; wgrad x and grad in 128x1 blocks along the tokens M. x is saved in compute dtype for that last
quantization (DeepSeek quantizes it twice too). Both operands are K-major (bt is B transposed), the layout FP8
tensor cores read: only the forward's weight needs a transposed copy. M, K, N must be multiples of 128 (config).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from mjax.kernels.quant.fp8 import FORMATS, fp8_max

BLOCK = 128


class BlockwiseUnsupported(ValueError):
    """A shape the blockwise recipe cannot take; the message names the option to change."""


def _check(dim: int, what: str):
    if dim % BLOCK:
        raise BlockwiseUnsupported(
            f"--fp8_recipe=blockwise needs {what} to be a multiple of {BLOCK}, got {dim}; change the model or "
            "batch sizes, or use --fp8_recipe=tensorwise")


def _block_scale(block_amax, dtype):
    return jnp.where(block_amax > 0, block_amax / fp8_max(dtype), 1.0)  # an all-zero block keeps scale 1


def quantize_rows(x, dtype):
    """1x128 blocks along the last axis: x [R, C] -> (q [R, C] fp8, s [R, C/128] f32, amax of x: f32 scalar, the
    max of the block amaxes, so that no pass of its own reads x again)."""
    r, c = x.shape
    xb = x.astype(jnp.float32).reshape(r, c // BLOCK, BLOCK)  # [R, C/128, 128]
    block_amax = jnp.max(jnp.abs(xb), axis=-1)  # [R, C/128]
    s = _block_scale(block_amax, dtype)
    m = fp8_max(dtype)
    q = jnp.clip(xb / s[..., None], -m, m).astype(dtype).reshape(r, c)
    return q, s, jnp.max(block_amax)


def quantize_tiles(w, dtype):
    """128x128 blocks: w [K, N] -> (q [K, N] fp8, s [K/128, N/128] f32, amax of w)."""
    k, n = w.shape
    wb = w.astype(jnp.float32).reshape(k // BLOCK, BLOCK, n // BLOCK, BLOCK)  # [KB, 128, NB, 128]
    block_amax = jnp.max(jnp.abs(wb), axis=(1, 3))  # [KB, NB]
    s = _block_scale(block_amax, dtype)
    m = fp8_max(dtype)
    q = jnp.clip(wb / s[:, None, :, None], -m, m).astype(dtype).reshape(k, n)
    return q, s, jnp.max(block_amax)


def expand_cols(s):
    """[KB, NB] tile scales -> [KB, N] column scales (each repeated over its 128 columns)."""
    return jnp.repeat(s, BLOCK, axis=1)


def dequantize_rows(q, s):
    return q.astype(jnp.float32) * jnp.repeat(s, BLOCK, axis=1)


def block_gemm_reference(a, sa, bt, sb, out_dtype):
    """Dequantize both operands through f32 and multiply in f32: exact up to f32 rounding."""
    ad = dequantize_rows(a, sa)  # [M, K]
    bd = bt.astype(jnp.float32).T * jnp.repeat(sb, BLOCK, axis=0)  # [K, N]
    return jnp.dot(ad, bd, precision=lax.Precision.HIGHEST).astype(out_dtype)


@dataclasses.dataclass(frozen=True)
class BlockwiseSpec:
    format: str = "hybrid"
    impl: str = "xla"  # xla (reference) | pallas
    interpret: bool = False

    @property
    def dtypes(self):
        return FORMATS[self.format]


def block_gemm(a, sa, bt, sb, out_dtype, spec: BlockwiseSpec):
    if spec.impl == "pallas":
        from mjax.kernels.quant.block_gemm import block_gemm_pallas  # noqa: PLC0415  (import only when chosen)

        return block_gemm_pallas(a, sa, bt, sb, out_dtype=out_dtype, interpret=spec.interpret)
    return block_gemm_reference(a, sa, bt, sb, out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def blockwise_matmul(x, w, meta, spec: BlockwiseSpec):
    """x [M, K], w [K, N], meta [3] (only its gradient is used: the amaxes of x, w, grad) -> [M, N] in x.dtype."""
    return _fwd(x, w, meta, spec)[0]


def _fwd(x, w, meta, spec):
    (m, k), n = x.shape, w.shape[1]
    _check(m, "the tokens per micro-batch (--micro_batch_size x --seq_length)")
    _check(k, f"every linear layer's input size (one is {k})")
    _check(n, f"every linear layer's output size (one is {n})")
    fwd_dtype, _ = spec.dtypes
    xq, sx, ax = quantize_rows(x, fwd_dtype)  # [M, K], [M, K/128]
    wq, sw, aw = quantize_tiles(w, fwd_dtype)  # [K, N], [K/128, N/128]
    y = block_gemm(xq, sx, wq.T, expand_cols(sw), x.dtype, spec)  # [M, N]
    return y, (x, wq, sw, ax, aw, jnp.zeros((0,), w.dtype))


def _bwd(spec, res, g):
    x, wq, sw, ax, aw, w_like = res
    fwd_dtype, grad_dtype = spec.dtypes
    gq, sg, ag = quantize_rows(g, grad_dtype)  # [M, N], [M, N/128]
    dx = block_gemm(gq, sg, wq, expand_cols(sw.T), x.dtype, spec)  # [M, K]: bt = (w^T)^T = w
    xtq, sxt, _ = quantize_rows(x.T, fwd_dtype)  # [K, M], [K, M/128]: 128x1 blocks of x
    gtq, sgt, _ = quantize_rows(g.T, grad_dtype)  # [N, M], [N, M/128]: 128x1 blocks of g
    dw = block_gemm(xtq, sxt, gtq, sgt.T, jnp.float32, spec).astype(w_like.dtype)  # [K, N]
    return dx, dw, jnp.stack([ax, aw, ag])


blockwise_matmul.defvjp(lambda x, w, meta, spec: _fwd(x, w, meta, spec), _bwd)
