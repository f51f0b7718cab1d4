"""The FP8 cases of bench_grouped_matmul.py (--fp8): the scales a delayed step would hold, the grouped matmul as
training calls it, and the three FP8 kernels on operands quantized beforehand (to time the GEMMs alone)."""

import jax
import jax.numpy as jnp

from mjax.kernels.quant import fp8
from mjax.kernels.grouped_matmul import fp8_grouped_matmul
from mjax.kernels.grouped_matmul import fp8_pallas
from mjax.kernels.grouped_matmul.tiling import FP8_MIN_DEPTH, kernel_tile_problem


def _expert_amax(w):  # [G, K, N] -> [G]
    return jnp.max(jnp.abs(w.astype(jnp.float32)), (1, 2))


def meta(w, x, dy, spec):
    """[G, 3] scales: delayed scaling's as if the last step had had these amaxes (none saturates); tensorwise reads
    none of them."""
    fwd_max, grad_max = (fp8.fp8_max(d) for d in spec.dtypes)
    groups = w.shape[:1]
    amaxes = jnp.stack([jnp.broadcast_to(fp8.amax(x), groups), _expert_amax(w),
                        jnp.broadcast_to(fp8.amax(dy), groups)], -1)
    return jnp.array([fwd_max, fwd_max, grad_max]) / amaxes


def training_call(meta, spec):
    """fn(x, w, gs) of the FP8 grouped matmul as training calls it: amaxes, casts and the kernels, every call."""
    return lambda x, w, gs: fp8_grouped_matmul(x, w, gs, meta, spec, impl="pallas")


def operands(x, w, dy, spec):
    """The kernels' FP8 operands, quantized once (per-tensor x and dy, per-expert w; power-of-two scales), and the
    factors each kernel multiplies its products by: xq, xq_t, wq, wq_t, gq, gq_t; scale_fwd, scale_dgrad,
    scale_wgrad."""
    fwd_dtype, grad_dtype = spec.dtypes
    sx, sg = (fp8.pow2_floor(fp8.scale_from_amax(fp8.amax(v), d)) for v, d in ((x, fwd_dtype), (dy, grad_dtype)))
    sw = fp8.pow2_floor(fp8.scale_from_amax(_expert_amax(w), fwd_dtype))  # [G]
    xq, gq = fp8.quantize(x, sx, fwd_dtype), fp8.quantize(dy, sg, grad_dtype)
    wq = fp8.quantize(w, sw[:, None, None], fwd_dtype)
    return dict(xq=xq, xq_t=xq.T, wq=wq, wq_t=jnp.swapaxes(wq, 1, 2), gq=gq, gq_t=gq.T, scale_fwd=1 / (sx * sw),
                scale_dgrad=1 / (sg * sw), scale_wgrad=jnp.broadcast_to(1 / (sx * sg), sw.shape))


def kernel_calls(q, gs, tiling, out_dtype, mma: str):
    """{kernel: thunk} of the three FP8 kernels on `operands` (mma: fp8_pallas.upcast_for's choice)."""
    common = dict(interpret=jax.default_backend() != "gpu", mma=mma)
    return {"forward": lambda: fp8_pallas.forward(q["xq"], q["wq_t"], gs, q["scale_fwd"], tile=tiling.forward,
                                                  out_dtype=out_dtype, **common),
            "dgrad": lambda: fp8_pallas.dgrad(q["gq"], q["wq"], gs, q["scale_dgrad"], tile=tiling.dgrad,
                                              out_dtype=out_dtype, **common),
            "wgrad": lambda: fp8_pallas.wgrad(q["xq_t"], q["gq_t"], gs, q["scale_wgrad"], tile=tiling.wgrad,
                                              **common)}


def tile_problem(kernel: str, tile, k: int, n: int) -> str | None:
    """None if `tile` fits FP8 `kernel` of x [M, K] . w [G, K, N], else the reason."""
    if tile.block_k < FP8_MIN_DEPTH:
        return f"FP8 dots need block_k >= {FP8_MIN_DEPTH}"
    return kernel_tile_problem(kernel, tile, jnp.float8_e4m3fn, k, n)
