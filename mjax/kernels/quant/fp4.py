"""FP4 (e2m1) training emulated on Hopper: NVFP4 and MXFP4 quantize -> dequantize around bf16 GEMMs.

Hopper has no FP4 tensor cores, so each GEMM operand is quantized to e2m1 with block scales along the dimension
that GEMM contracts, dequantized, and multiplied in bf16 with f32 accumulation. The numerics are FP4's; the speed
is not (that needs Blackwell).

    nvfp4: 16-element blocks, e4m3 block scales, and an fp32 per-tensor scale g = amax / (6 * 448)
    mxfp4: 32-element blocks, e8m0 (power-of-two) block scales, rounded up so no element overflows

This follows `jax._src.cudnn.scaled_matmul_stablehlo.quantize`. XLA folds an f32 -> e2m1 -> f32 round trip away
(SimplifyFPConversions), so the reference wraps the quantized values in `lax.optimization_barrier`; the Pallas
kernel (`fp4_pallas.py`, the fused path) is opaque to XLA and rounds to the e2m1 grid arithmetically.

`fp4_matmul` quantizes all six GEMM inputs of a linear layer: forward x, w along K; dgrad grad, w along N;
wgrad x, grad along the tokens M, optionally after a random Hadamard transform (RHT) over 16-token groups. The
RHT is orthogonal and applied to both wgrad operands, so it cancels in x^T g while spreading outliers across each
block before quantization (NVIDIA's NVFP4 recipe). Optionally the output gradient's two copies are rounded
stochastically (unbiased) instead of to nearest, as that recipe does for gradients.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

E2M1 = jnp.float4_e2m1fn
E2M1_MAX = 6.0
E4M3_MAX = 448.0
BLOCKS = {"nvfp4": 16, "mxfp4": 32}
HADAMARD_SIZE = 16


def global_scale(x) -> jax.Array:
    """NVFP4's fp32 tensor scale: amax / (6 * 448), 1 for an all-zero tensor."""
    a = jnp.max(jnp.abs(x)).astype(jnp.float32)
    return jnp.where(a > 0, a / (E2M1_MAX * E4M3_MAX), 1.0)


def e8m0_round_up(v) -> jax.Array:
    """The smallest power of two >= v (v > 0), as MX scales are stored (e8m0); exact, from the f32 bits."""
    bits = lax.bitcast_convert_type(v.astype(jnp.float32), jnp.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)  # a mantissa rounds up to the next power
    exponent = jnp.clip(exponent, 1, 254)
    return lax.bitcast_convert_type(exponent << 23, jnp.float32)


def _blocks(x, recipe: str):
    """x [..., C] -> f32 [..., C/B, B] (C must be a multiple of the block size B)."""
    b = BLOCKS[recipe]
    return x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // b, b)


def uniform_hash(index, x) -> jax.Array:
    """A uniform [0, 1) per element from its flat index and its value's bits (uint32 arithmetic; murmur3's
    finalizer): the random bits of stochastic rounding, the same in the reference and the Pallas kernel, different
    wherever the value or its position differs."""
    h = index.astype(jnp.uint32) * jnp.uint32(0x9E3779B1) ^ lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    h = h ^ (h >> 16)
    return (h >> 8).astype(jnp.float32) * 2.0**-24


def round_e2m1_stochastic(v, u) -> jax.Array:
    """|v| <= 6 rounded to one of its two neighbours on the e2m1 grid (0, 0.5, 1, 1.5, 2, 3, 4, 6), up with
    probability equal to the distance from the lower one over the spacing, given u uniform in [0, 1): unbiased,
    E[round(v)] = v. Every step is exact in f32 (power-of-two spacings), so kernel and reference agree bitwise."""
    a = jnp.abs(v)
    step = jnp.where(a < 2.0, 0.5, jnp.where(a < 4.0, 1.0, 2.0))
    lo = jnp.floor(a / step) * step
    q = jnp.minimum(lo + jnp.where(u < (a - lo) / step, step, 0.0), E2M1_MAX)
    return jnp.where(v < 0, -q, q)


def fake_quant_reference(x, recipe: str, out_dtype=None, stochastic: bool = False):
    """Quantize along the last axis to e2m1 with `recipe`'s block scales, then dequantize. Same shape as x.
    stochastic: round each element stochastically (`round_e2m1_stochastic`, bits from `uniform_hash` of its flat
    index in x) instead of to nearest."""
    out_dtype = out_dtype or x.dtype
    xb = _blocks(x, recipe)  # [..., C/B, B]
    block_amax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    if recipe == "nvfp4":
        g = global_scale(x)
        s = jnp.clip(block_amax / g / E2M1_MAX, 0, E4M3_MAX).astype(jnp.float8_e4m3fn)
        s = lax.optimization_barrier(s).astype(jnp.float32) * g  # the block's dequantization factor
    else:
        s = e8m0_round_up(jnp.maximum(block_amax / E2M1_MAX, 2.0**-126))
    v = jnp.clip(xb / jnp.where(s > 0, s, 1.0), -E2M1_MAX, E2M1_MAX)
    if stochastic:
        index = lax.iota(jnp.uint32, x.size).reshape(xb.shape)
        v = round_e2m1_stochastic(v, uniform_hash(index, xb))  # on the grid: the cast below is exact
    q = lax.optimization_barrier(v.astype(E2M1))  # keeps XLA from folding the f32 -> e2m1 -> f32 round trip away
    return (q.astype(jnp.float32) * s).reshape(x.shape).astype(out_dtype)


def hadamard_matrix(seed: int = 0) -> np.ndarray:
    """A fixed random Hadamard transform: H16 (Sylvester) times random signs, orthonormal. [16, 16] f32."""
    h = np.array([[1.0]])
    while h.shape[0] < HADAMARD_SIZE:
        h = np.block([[h, h], [h, -h]])
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], HADAMARD_SIZE)
    return (h * signs[None, :] / np.sqrt(HADAMARD_SIZE)).astype(np.float32)


def hadamard_rows(x):
    """Applies the RHT over groups of 16 rows: x [M, C] -> [M, C] (M a multiple of 16)."""
    m, c = x.shape
    xg = x.astype(jnp.float32).reshape(m // HADAMARD_SIZE, HADAMARD_SIZE, c)  # [M/16, 16, C]
    return jnp.einsum("ij,gjc->gic", jnp.asarray(hadamard_matrix()), xg).reshape(m, c).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Fp4Spec:
    recipe: str = "nvfp4"  # nvfp4 | mxfp4
    hadamard: bool = False  # RHT on the wgrad operands
    stochastic: bool = False  # stochastic rounding of the output gradient (dgrad and wgrad operands)
    impl: str = "xla"  # xla (reference) | pallas (fused kernel)
    interpret: bool = False


def fake_quant(x, spec: Fp4Spec, axis: int, stochastic: bool = False):
    """Quantize-dequantize a 2-D array in blocks along `axis`; zero padding (exact) to a whole block."""
    if axis == 0:
        return fake_quant(x.T, spec, 1, stochastic).T
    b = BLOCKS[spec.recipe]
    pad = -x.shape[1] % b
    xp = jnp.pad(x, ((0, 0), (0, pad))) if pad else x
    if spec.impl == "pallas":
        from mjax.kernels.quant.fp4_pallas import fake_quant_pallas  # noqa: PLC0415  (import only when chosen)

        out = fake_quant_pallas(xp, recipe=spec.recipe, interpret=spec.interpret, stochastic=stochastic)
    else:
        out = fake_quant_reference(xp, spec.recipe, stochastic=stochastic)
    return out[:, : x.shape[1]] if pad else out


def _dot(a, b, contract, out_dtype):
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                           preferred_element_type=jnp.float32).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def fp4_matmul(x, w, spec: Fp4Spec):
    """x [M, K] (compute dtype), w [K, N] -> [M, N] in x.dtype, every GEMM input FP4-quantized."""
    return _fwd(x, w, spec)[0]


def _fwd(x, w, spec):
    wc = w.astype(x.dtype)
    y = _dot(fake_quant(x, spec, 1), fake_quant(wc, spec, 0), (1, 0), x.dtype)  # [M, N]
    return y, (x, wc, jnp.zeros((0,), w.dtype))


def _bwd(spec, res, g):
    x, wc, w_like = res
    sr = spec.stochastic
    dx = _dot(fake_quant(g, spec, 1, sr), fake_quant(wc, spec, 1), (1, 1), x.dtype)  # [M, K], contracting N
    xt, gt = x, g
    if spec.hadamard:
        pad = -x.shape[0] % HADAMARD_SIZE  # zero tokens change neither the product nor any amax
        xt, gt = (hadamard_rows(jnp.pad(t, ((0, pad), (0, 0)))) for t in (x, g))
    dw = _dot(fake_quant(xt, spec, 0), fake_quant(gt, spec, 0, sr), (0, 0), jnp.float32)  # [K, N], contracting M
    return dx, dw.astype(w_like.dtype)


fp4_matmul.defvjp(lambda x, w, spec: _fwd(x, w, spec), _bwd)
