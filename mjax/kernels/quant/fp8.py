"""FP8 GEMMs with one scale per tensor: delayed scaling (scales from an amax history) and tensorwise current scaling.

Conventions (Transformer Engine's): `scale` multiplies a tensor into FP8 range, q = saturate(x * scale), and
x ~= q / scale. `fp8_matmul(x, w, meta)` runs all three GEMMs of a linear layer in FP8 through `jax.custom_vjp`:

    forward  y  = x  @ w     e4m3 x e4m3
    dgrad    dx = g  @ w^T   grad x e4m3   (grad is e5m2 with --fp8_format=hybrid, else e4m3)
    wgrad    dw = x^T @ g    e4m3 x grad

The FP8 operands go straight into `lax.dot_general` and the product is multiplied by the inverse scales in its own
dtype: the form XLA rewrites into one cuBLASLt FP8 GEMM (`__cublas$lt$matmul$f8`) with that factor as its scale.
The GEMMs quantize with the recipe's scale rounded down to a power of two, so the factor is exact in bf16. (A bf16
dequantize would not be rewritten, docs/fp8.md; an f32 one, `convert(q) * s` at the dot, is folded away by XLA's
simplifier, which drops the FP8 round trip, unless a barrier stands between, and then was not rewritten either:
f32 GEMMs, far slower steps on jax 0.11.2, docs/fp8.md.)
Every operand is quantized into the layouts its GEMMs read; with impl=pallas one cast-transpose pass writes
both (`cast_transpose.py`). The forward saves the FP8 copies of x (transposed) and w for the backward, half the
bytes of bf16 residuals.

`meta` is an f32 [3] array per layer: the scales of (x, w, grad) for the delayed recipe. Its *gradient* is not a
gradient: the backward returns the amax observed of (x, w, grad) this call. The train step reads those "gradients"
to update the amax history (max across micro-batches), so the scaling state flows functionally through jax.grad,
`lax.scan` over layers (one meta row per layer) and remat, with no side effects. Current-scaling recipes ignore the
value of `meta` but report amaxes the same way, for statistics and overflow guards.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from mjax.kernels.options import FP8_CAST

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
FORMATS = {"e4m3": (E4M3, E4M3), "hybrid": (E4M3, E5M2)}  # --fp8_format -> (forward operands, gradients)
META_X, META_W, META_G = 0, 1, 2  # rows of `meta` and of the observed amaxes


def fp8_max(dtype) -> float:
    return float(jnp.finfo(dtype).max)  # e4m3fn 448, e5m2 57344


def amax(x, words: bool = False) -> jax.Array:
    """max |x| as f32; NaN propagates. `words`: 16-bit x [..., 2n] is read as n 32-bit words and the magnitudes
    compared as integers (the same value), for a tensor its producer writes as words (SwiGLU's packed backward):
    XLA then takes the reduction in the pass that writes them instead of reading the tensor again (docs/fp8.md)."""
    if words and x.dtype.itemsize == 2 and x.ndim and x.shape[-1] % 2 == 0:
        w = lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2), jnp.uint32)  # [..., n]
        mags = jnp.maximum(w & 0x7FFF, (w >> 16) & 0x7FFF)  # sign bits cleared; ordered like the values, NaN on top
        return lax.bitcast_convert_type(jnp.max(mags).astype(jnp.uint16), x.dtype).astype(jnp.float32)
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def scale_from_amax(amax_value, dtype, margin: int = 0, fallback=1.0) -> jax.Array:
    """fp8_max / (amax * 2^margin); `fallback` where amax is zero or not finite (a scale must stay finite)."""
    amax_value = jnp.asarray(amax_value, jnp.float32)
    ok = (amax_value > 0) & jnp.isfinite(amax_value)
    scale = fp8_max(dtype) / (jnp.where(ok, amax_value, 1.0) * 2.0**margin)
    return jnp.where(ok, scale, fallback)


def quantize(x, scale, dtype) -> jax.Array:
    """Saturating cast: values beyond the FP8 range clip to +-max (a plain cast of e4m3fn overflow gives NaN)."""
    m = fp8_max(dtype)
    return jnp.clip(x.astype(jnp.float32) * scale, -m, m).astype(dtype)


SCALE_RANGE = (2.0**-63, 2.0**63)  # scales the GEMMs use: a product of two and its inverse stay normal f32


def pow2_floor(scale) -> jax.Array:
    """The largest power of two <= scale (bit-exact through frexp), after clamping to SCALE_RANGE: a GEMM quantizes
    with this, so its product is rescaled exactly in any float dtype and values stay within the FP8 range the full
    scale allowed. (An amax so small that fp8_max / amax overflows to inf still quantizes finitely.)"""
    clamped = jnp.clip(jnp.asarray(scale, jnp.float32), *SCALE_RANGE)
    mantissa, exponent = jnp.frexp(clamped)  # clamped = mantissa * 2^exponent, mantissa in [0.5, 1)
    return jnp.ldexp(jnp.ones_like(mantissa), exponent - 1)


def scaled_dot(a_q, b_q, contract: tuple[int, int], inv_scale, out_dtype) -> jax.Array:
    """FP8 x FP8 -> out_dtype, then times inv_scale (a power of two, so exact in out_dtype). A product multiplied by
    a broadcast scalar in its own dtype is what XLA folds into the cuBLASLt FP8 GEMM as its scale: no pass of its
    own over the output (an f32 rescale with casts around it cost one whenever no consumer fusion took it in)."""
    y = lax.dot_general(a_q, b_q, (((contract[0],), (contract[1],)), ((), ())), preferred_element_type=out_dtype)
    return y * inv_scale.astype(out_dtype)


@dataclasses.dataclass(frozen=True)
class Fp8Spec:
    """The static part of a per-tensor FP8 GEMM."""
    recipe: str = "tensorwise"  # delayed | tensorwise
    format: str = "hybrid"  # e4m3 | hybrid
    margin: int = 0
    impl: str = "xla"  # how the FP8 copies are made: xla (cast, XLA transposes) | pallas (one cast-transpose pass)
    interpret: bool = False
    grad_words: bool = False  # the output gradient is written as 32-bit words of 16-bit pairs (see `amax`)

    @property
    def dtypes(self):
        return FORMATS[self.format]


def gemm_scale(spec: Fp8Spec, meta, observed, which: int, dtype):
    """The scale a GEMM quantizes operand `which` with: the recipe's (delayed: meta's; tensorwise: from this call's
    amax), rounded down to a power of two."""
    scale = meta[which] if spec.recipe == "delayed" else scale_from_amax(observed, dtype, spec.margin)
    return pow2_floor(scale)


def _named_fp8(q):
    """checkpoint_name of an FP8 array, passed as its bytes: FP8-typed saved residuals came back as NaN (CPU, jax
    0.12.0.1). XLA folds the two bitcasts away (no bitcast-convert is left in the compiled step)."""
    return lax.bitcast_convert_type(checkpoint_name(lax.bitcast_convert_type(q, jnp.uint8), FP8_CAST), q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def fp8_matmul(x, w, meta, spec: Fp8Spec):
    """x [M, K] (compute dtype), w [K, N] (any float dtype), meta [3] f32 -> y [M, N] in x.dtype."""
    return _fwd(x, w, meta, spec)[0]


def both_layouts(x, scale, dtype, spec: Fp8Spec, with_amax: bool = False):
    """x [R, C] -> its FP8 copies [R, C] and [C, R]: cuBLASLt's FP8 GEMMs read both operands K-major ("TN");
    with_amax: and max |x|, in the same pass (the kernel; XLA fuses its reduce with the cast)."""
    if spec.impl == "pallas":
        from mjax.kernels.quant.cast_transpose import cast_transpose  # noqa: PLC0415  (import only when chosen)

        return cast_transpose(x, scale, dtype, interpret=spec.interpret, with_amax=with_amax)
    q = quantize(x, scale, dtype)
    return (q, q.T, amax(x)) if with_amax else (q, q.T)


def quantize_operand(x, spec: Fp8Spec, meta, which: int, dtype, words: bool = False):
    """x's FP8 copies in both layouts, the scale they used and x's amax. Tensorwise takes the amax first (the scale
    depends on it); delayed has its scale from the history and observes the amax in the quantizing pass. Scale and
    amax are named (remat name fp8_cast) before anything uses them, so that a remat policy keeping them (and the
    FP8 operands of the backward, 1 byte an element) does not redo amaxes and casts in the backward."""
    if spec.recipe == "delayed":
        scale = checkpoint_name(gemm_scale(spec, meta, None, which, dtype), FP8_CAST)
        q, q_t, a = both_layouts(x, scale, dtype, spec, with_amax=True)
        a = checkpoint_name(a, FP8_CAST)
    else:
        a = checkpoint_name(amax(x, words), FP8_CAST)
        scale = checkpoint_name(gemm_scale(spec, meta, a, which, dtype), FP8_CAST)
        q, q_t = both_layouts(x, scale, dtype, spec)
    return q, q_t, scale, a


def _fwd(x, w, meta, spec):
    fwd_dtype, _ = spec.dtypes
    xq, xq_t, sx, ax = quantize_operand(x, spec, meta, META_X, fwd_dtype)  # [M, K] forward, [K, M] wgrad
    wq, wq_t, sw, aw = quantize_operand(w, spec, meta, META_W, fwd_dtype)  # [K, N] dgrad, [N, K] forward
    xq_t, wq = (_named_fp8(t) for t in (xq_t, wq))
    y = scaled_dot(xq, wq_t, (1, 1), 1.0 / (sx * sw), x.dtype)  # [M, N]
    # Zero-size arrays carry the primal dtypes into the backward (residuals must be arrays).
    return y, (xq_t, wq, sx, sw, ax, aw, meta, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _bwd(spec, res, g):
    xq_t, wq, sx, sw, ax, aw, meta, x_like, w_like = res
    _, grad_dtype = spec.dtypes
    # [M, N] dgrad, [N, M] wgrad
    gq, gq_t, sg, ag = quantize_operand(g, spec, meta, META_G, grad_dtype, spec.grad_words)
    dx = scaled_dot(gq, wq, (1, 1), 1.0 / (sg * sw), x_like.dtype)  # [M, K]
    dw = scaled_dot(xq_t, gq_t, (1, 1), 1.0 / (sx * sg), jnp.float32).astype(w_like.dtype)  # [K, N]
    return dx, dw, jnp.stack([ax, aw, ag])


fp8_matmul.defvjp(lambda x, w, meta, spec: _fwd(x, w, meta, spec), _bwd)
