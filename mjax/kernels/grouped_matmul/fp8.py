"""Per-tensor FP8 grouped matmul (--fp8_recipe=delayed | tensorwise), the MoE expert GEMMs' quantized path: all three
GEMMs in FP8 through one custom_vjp, as `mjax.kernels.quant.fp8.fp8_matmul` runs a linear layer's.

    forward  y  = x @ w[g]       e4m3 x e4m3
    dgrad    dx = g @ w[g]^T     grad x e4m3   (grad is e5m2 with --fp8_format=hybrid, else e4m3)
    wgrad    dw[g] = x_g^T g_g   e4m3 x grad

Scales (Transformer Engine's convention, q = saturate(v * scale)), each rounded down to a power of two:
  - x and the output gradient: one scale per tensor, from the max |v| over the real rows only (rows past
    sum(group_sizes) are zeroed before anything reads them), as a linear layer's;
  - w [G, K, N]: one scale per expert (TE's GroupedLinear also keeps one per GEMM). A group's rows meet one expert,
    so the kernels apply 1 / (s_x s_w[g]) as one factor per program in the epilogue: no cost over a single scale.
`meta` [G, 3] f32 holds them per expert, columns (x, w, grad) as a Linear's [3]; the x and grad columns hold one
value for every expert (their history sees the same amax) and the GEMM reads their minimum. Its "gradient" is the
observed amaxes in the same layout ([G, 3]: max |x| and max |grad| in every row, max |w[g]| per row), which the
train step folds into the amax history unchanged (mjax/train/fp8_state.py); tensorwise ignores the value of meta.

Several weights may read one x (the MoE gate and up projections): x is quantized once for all of them, with the
smallest of their x scales, and every meta observes the same amax of x (so delayed histories stay equal).

Batching: MoE runs the experts under jax.vmap over dispatch groups. The amaxes go through `across_batch_max`, so
one scale covers the whole batch (the results do not depend on the number of dispatch groups) and meta's
cotangent is one max, not a sum over the batch; the rest (casts, kernels) batches as usual.

GEMMs (`gemm`, from --moe_grouped_gemm_impl): "pallas" runs the kernels of fp8_pallas.py on FP8 operands, each
operand quantized into the layouts its kernel reads K-major (the transposed copies by the cast-transpose kernel
with --quant_impl=pallas, else by XLA); "xla" dequantizes to float32 and runs lax.ragged_dot (the reference; what
CPU runs), on the same quantized values.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.custom_batching import custom_vmap

from mjax.kernels.quant import fp8
from mjax.kernels.quant.fp8 import META_G, META_W, META_X, Fp8Spec, _named_fp8, pow2_floor, scale_from_amax
from mjax.kernels.quant.cast_transpose import cast_transpose_local
from mjax.kernels.grouped_matmul import fp8_pallas
from mjax.kernels.grouped_matmul.reference import ragged_product, ragged_product_vjp
from mjax.kernels.grouped_matmul.tiling import Tiling
from mjax.kernels.options import FP8_CAST


@dataclasses.dataclass(frozen=True)
class GroupedFp8Plan:
    """The static part of one call: the recipe (spec.impl: how the transposed copies are made), the GEMMs (xla |
    pallas), each weight's tiling (pallas) and whether the GEMM kernels run interpreted."""
    spec: Fp8Spec
    gemm: str = "xla"
    tilings: tuple[Tiling | None, ...] = (None,)
    interpret: bool = False


@custom_vmap
def across_batch_max(a):
    """a itself; under jax.vmap, its max over the mapped axis, unmapped (nested vmaps reduce each axis)."""
    return a


@across_batch_max.def_vmap
def _across_batch_max_rule(axis_size, in_batched, a):
    del axis_size
    return across_batch_max(jnp.max(a, axis=0) if in_batched[0] else a), False


def _valid_rows(rows: int, group_sizes):  # [M, 1]: the rows some group owns
    return (jnp.arange(rows, dtype=jnp.int32) < jnp.sum(group_sizes.astype(jnp.int32)))[:, None]


def _layouts(v, scale, dtype, plan: GroupedFp8Plan, transposed: bool, with_amax: bool):
    """v [R, C] -> (q [R, C], q^T [C, R] or None[, max |v|]), q = saturate(v * scale)."""
    if transposed and plan.spec.impl == "pallas":
        out = cast_transpose_local(v, jnp.reshape(scale, (1,)), dtype=dtype, interpret=plan.spec.interpret,
                                   with_amax=with_amax)
        return (*out[:2], out[2][0]) if with_amax else out
    q = fp8.quantize(v, scale, dtype)
    q_t = q.T if transposed else None
    return (q, q_t, fp8.amax(v)) if with_amax else (q, q_t)


def quantize_rows(v, valid, plan: GroupedFp8Plan, meta_scales, dtype, transposed: bool):
    """v [M, C] with its rows past the groups zeroed -> (q [M, C], q^T [C, M] or None, scale, amax over the batch).
    meta_scales: the delayed scales to take the smallest of. Scale and amax are named fp8_cast (as
    fp8.quantize_operand names them) so that a remat policy keeping them skips the backward's recomputation."""
    spec = plan.spec
    v = jnp.where(valid, v, jnp.zeros((), v.dtype))
    if spec.recipe == "delayed":
        scale = checkpoint_name(pow2_floor(jnp.min(jnp.stack([jnp.min(s) for s in meta_scales]))), FP8_CAST)
        q, q_t, a = _layouts(v, scale, dtype, plan, transposed, with_amax=True)
        a = checkpoint_name(across_batch_max(a), FP8_CAST)
    else:
        a = checkpoint_name(across_batch_max(fp8.amax(v)), FP8_CAST)
        scale = checkpoint_name(pow2_floor(scale_from_amax(a, dtype, spec.margin)), FP8_CAST)
        q, q_t = _layouts(v, scale, dtype, plan, transposed, with_amax=False)
    return q, q_t, scale, a


def quantize_experts(w, plan: GroupedFp8Plan, meta, dtype, transposed: bool):
    """w [G, K, N] -> (wq [G, K, N], wq^T [G, N, K] or None, scale [G], amax [G]): one scale per expert."""
    spec = plan.spec
    expert_amax = lambda w: across_batch_max(jnp.max(jnp.abs(w), axis=(1, 2)).astype(jnp.float32))  # noqa: E731
    if spec.recipe == "delayed":
        scale = checkpoint_name(pow2_floor(meta[:, META_W]), FP8_CAST)
    else:
        a = checkpoint_name(expert_amax(w), FP8_CAST)
        scale = checkpoint_name(pow2_floor(scale_from_amax(a, dtype, spec.margin)), FP8_CAST)
    if transposed and spec.impl == "pallas":
        delayed = spec.recipe == "delayed"
        out = jax.vmap(lambda w, s: cast_transpose_local(w, jnp.reshape(s, (1,)), dtype=dtype,
                                                         interpret=spec.interpret, with_amax=delayed))(w, scale)
        wq, wq_t = out[:2]
        if delayed:  # the amax from the quantizing pass, as fp8.quantize_operand takes it
            a = checkpoint_name(across_batch_max(out[2][:, 0]), FP8_CAST)
        return wq, wq_t, scale, a
    wq = fp8.quantize(w, scale[:, None, None], dtype)
    if spec.recipe == "delayed":
        a = checkpoint_name(expert_amax(w), FP8_CAST)
    return wq, jnp.swapaxes(wq, 1, 2) if transposed else None, scale, a


def _dequantize(q, scale):
    """q times 1 / scale (a power of two: exact) in float32. The barrier keeps XLA's simplifier from folding the
    float -> FP8 -> float round trip away (it did under jit when q had no other user: unquantized products)."""
    return lax.optimization_barrier(q).astype(jnp.float32) * (1.0 / scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def grouped_fp8(x, ws, group_sizes, metas, plan: GroupedFp8Plan):
    """x [M, K] compute dtype, ws: tuple of w [G, K, N_i], group_sizes [G] int32, metas: tuple of [G, 3] f32 ->
    tuple of y [M, N_i] in x.dtype. Shapes and plan are checked by the caller (grouped_matmul.fp8_grouped_matmul)."""
    return _fwd(x, ws, group_sizes, metas, plan)[0]


def _fwd(x, ws, group_sizes, metas, plan):
    fwd_dtype, _ = plan.spec.dtypes
    pallas = plan.gemm == "pallas"
    valid = _valid_rows(x.shape[0], group_sizes)
    # xq_t [K, M] is wgrad's operand (pallas); the reference reads xq [M, K] again.
    xq, xq_t, sx, ax = quantize_rows(x, valid, plan, [m[:, META_X] for m in metas], fwd_dtype, transposed=pallas)
    ys, saved_w = [], []
    for w, meta, tiling in zip(ws, metas, plan.tilings):
        wq, wq_t, sw, aw = quantize_experts(w, plan, meta, fwd_dtype, transposed=pallas)  # [G, K, N], [G, N, K]
        if pallas:
            y = fp8_pallas.forward(xq, wq_t, group_sizes, 1.0 / (sx * sw), tile=tiling.forward,
                                   interpret=plan.interpret, out_dtype=x.dtype)  # [M, N]
        else:
            y = ragged_product(_dequantize(xq, sx), _dequantize(wq, sw[:, None, None]), group_sizes).astype(x.dtype)
        ys.append(y)
        saved_w.append((_named_fp8(wq), sw, aw, jnp.zeros((0,), w.dtype)))  # the w dtype rides on an empty array
    saved_x = _named_fp8(xq_t if pallas else xq)
    return tuple(ys), (saved_x, sx, ax, tuple(saved_w), group_sizes, metas, jnp.zeros((0,), x.dtype))


def _bwd(plan, res, dys):
    saved_x, sx, ax, saved_w, group_sizes, metas, x_like = res
    _, grad_dtype = plan.spec.dtypes
    pallas = plan.gemm == "pallas"
    valid = _valid_rows(dys[0].shape[0], group_sizes)
    dx, dws, observed = None, [], []
    for dy, (wq, sw, aw, w_like), meta, tiling in zip(dys, saved_w, metas, plan.tilings):
        gq, gq_t, sg, ag = quantize_rows(dy, valid, plan, [meta[:, META_G]], grad_dtype, transposed=pallas)
        if pallas:
            dx_part = fp8_pallas.dgrad(gq, wq, group_sizes, 1.0 / (sg * sw), tile=tiling.dgrad,
                                       interpret=plan.interpret, out_dtype=x_like.dtype)  # [M, K]
            dw = fp8_pallas.wgrad(saved_x, gq_t, group_sizes, jnp.broadcast_to(1.0 / (sx * sg), sw.shape),
                                  tile=tiling.wgrad, interpret=plan.interpret)  # [G, K, N]
        else:
            dx_part, dw = ragged_product_vjp(_dequantize(saved_x, sx), _dequantize(wq, sw[:, None, None]),
                                             group_sizes, _dequantize(gq, sg))
            dx_part = dx_part.astype(x_like.dtype)
        dx = dx_part if dx is None else dx + dx_part
        dws.append(dw.astype(w_like.dtype))
        observed.append(jnp.stack([jnp.broadcast_to(ax, aw.shape), aw, jnp.broadcast_to(ag, aw.shape)], axis=-1))
    return dx, tuple(dws), None, tuple(observed)  # observed [G, 3]: the amaxes in meta's layout


grouped_fp8.defvjp(_fwd, _bwd)
