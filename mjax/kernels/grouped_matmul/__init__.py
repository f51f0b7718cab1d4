"""Grouped matmul (the MoE expert GEMM): the one dispatch point, the pure-JAX reference and the Pallas kernels.

    y = grouped_matmul(x, w, group_sizes, *, impl="auto", tiling=None)

x [M, K] has its rows sorted by group: group g owns rows [sum(group_sizes[:g]), sum(group_sizes[:g + 1])); rows at
or past sum(group_sizes) are padding and give zero output rows and zero gradients. w [G, K, N]; group_sizes int32
[G], known only at run time (zeros allowed, any sum <= M). y [M, N] in x.dtype, accumulated in float32.
Differentiable in x and w: dx = grouped(dy, w^T), dw[g] = x_g^T dy_g (zeros for an empty group). Works under
jax.vmap (x [B, M, K], group_sizes [B, G], w shared or batched).

    ys = fp8_grouped_matmul(x, (w, ...), group_sizes, (meta, ...), fp8_spec, *, impl="auto", tiling=None)

is the same product with per-tensor FP8 (--fp8_recipe=delayed | tensorwise; fp8.py): meta [G, 3] f32 per weight,
whose cotangent is the amaxes observed; several weights may share one quantization of x (the MoE gate and up).

    ys = blockwise_grouped_matmul(x, (w, ...), group_sizes, (meta, ...), fp8_format, *, impl="auto", tiling=None)

is the same product with blockwise FP8 (--fp8_recipe=blockwise; fp8_blockwise.py): 1x128 activation blocks, 128x128
weight blocks, K and N multiples of 128; meta is not read, its cotangent reports the amaxes as above.

impl (the flag --moe_grouped_gemm_impl):
    xla     jax.lax.ragged_dot (reference.py); gradients by autodiff. Dense expansion on the GPU image.
    pallas  the Triton kernels (pallas.py): forward, dgrad and wgrad; interpreted off GPU.
    mosaic  the Mosaic GPU kernels (mosaic.py: TMA, wgmma; Hopper only, bfloat16 / float16, 16-bit calls only).
    auto    on a Hopper GPU mosaic for the 16-bit calls it can tile, else pallas; pallas on other GPUs; xla
            elsewhere (mosaic measured faster than pallas in all but one of the forward + backward cases of
            docs/moe.md, and moe-small trains faster on it). On a GPU a call the kernels cannot take raises GroupedMatmulUnsupported
            (never a silent fall back to the dense expansion); set --moe_grouped_gemm_impl=xla for that on purpose.
"""

import functools
import logging

import jax
import jax.numpy as jnp

from mjax.kernels.device import is_hopper
from mjax.kernels.grouped_matmul.reference import grouped_matmul_reference
from mjax.kernels.grouped_matmul.tiling import (DTYPES, KernelTile, Tiling, blockwise_tiling_problem,
                                                default_blockwise_tiling, default_fp8_tiling,
                                                default_mosaic_tiling, default_tiling,
                                                fp8_tiling_problem, tiling_problem)

__all__ = ["IMPLS", "GroupedMatmulUnsupported", "KernelTile", "Tiling", "blockwise_grouped_matmul", "choose_impl",
           "fp8_grouped_matmul", "grouped_matmul", "resolve_tiling", "why_unsupported"]

log = logging.getLogger(__name__)

IMPLS = ("auto", "pallas", "mosaic", "xla")
FLAG = "--moe_grouped_gemm_impl"
# Pallas-Triton computes element offsets in int32. Checked per call; under jax.vmap a batched operand is indexed as
# one array, so B times an operand must stay below this too (the call itself sees one item's shapes).
MAX_ELEMENTS = 2**31 - 1


class GroupedMatmulUnsupported(ValueError):
    """The requested grouped-matmul implementation cannot do this call; the message names the option to change."""


def resolve_tiling(tiling: Tiling | None, dtype, k: int, n: int, fp8_grad=None) -> Tiling | None:
    """The tiling the kernels run with: `tiling`, or the defaults for this dtype and shape (None: none fits).
    fp8_grad: the gradient's FP8 dtype when the call is an FP8 one (its backward tiles depend on it)."""
    if tiling is not None:
        return tiling
    if fp8_grad is not None:
        return default_fp8_tiling(k, n, grad_native=jnp.dtype(fp8_grad) == jnp.dtype(jnp.float8_e4m3fn))
    return default_tiling(dtype, k, n)


def why_unsupported(impl: str, *, backend: str, dtype, k: int, n: int, tiling: Tiling | None = None,
                    m: int | None = None, groups: int | None = None, fp8_grad=None,
                    blockwise: bool = False) -> str | None:
    """The capability table: None if `impl` can do x [M, K] . w [G, K, N] in `dtype`, else the reason in words.
    Pure in its arguments (no device is consulted); M and G, when given, are checked too. fp8_grad (an FP8 dtype):
    the FP8 kernels, with `dtype` the compute dtype x and the results have and the gradient quantized to fp8_grad.
    blockwise: the blockwise FP8 kernels (fp8_blockwise_pallas.py; `tiling` None: their defaults)."""
    if impl == "xla":
        return None
    if impl == "mosaic":
        return _mosaic_problem(backend=backend, dtype=dtype, k=k, n=n, tiling=tiling, fp8_grad=fp8_grad,
                               blockwise=blockwise)
    if impl == "pallas":
        del backend  # off GPU the kernels run interpreted, with the same limits
        dtype = jnp.dtype(dtype)
        if dtype not in [jnp.dtype(d) for d in DTYPES]:
            return f"pallas takes bfloat16, float16 or float32 inputs, not {dtype}"
        largest = max(m * max(k, n) if m else 0, groups * k * n if groups else 0)
        if largest > MAX_ELEMENTS:
            return (f"pallas addresses its operands with 32-bit offsets, and x [{m}, {k}] . w [{groups}, {k}, {n}] "
                    f"has an operand of {largest} elements (more than {MAX_ELEMENTS}); split the tokens or the "
                    "experts over devices (--ep)")
        if blockwise:
            chosen = tiling or default_blockwise_tiling(k, n)
            if chosen is None:
                return (f"the blockwise FP8 kernels step through K and N in 128-wide blocks; K={k}, N={n} are not "
                        "multiples of 128")
            return blockwise_tiling_problem(chosen, k, n)
        chosen = resolve_tiling(tiling, dtype, k, n, fp8_grad)
        if fp8_grad is not None:
            if chosen is None:
                return (f"the FP8 kernels tile K and N in whole blocks of at least 32; K={k}, N={n} are not "
                        "multiples of 32")
            return fp8_tiling_problem(chosen, k, n)
        if chosen is None:
            return f"pallas tiles K and N in whole blocks of at least 16; K={k}, N={n} are not multiples of 16"
        return tiling_problem(chosen, dtype, k, n)
    raise GroupedMatmulUnsupported(f"{FLAG}={impl!r} is not one of {', '.join(IMPLS)}")


def _mosaic_problem(*, backend, dtype, k, n, tiling, fp8_grad, blockwise) -> str | None:
    from mjax.kernels.grouped_matmul.mosaic import MOSAIC_DTYPES, mosaic_tile_problem  # noqa: PLC0415

    if backend != "gpu":
        return f"mosaic runs only on a GPU (Hopper), not on {backend} (its interpreter runs in the tests only)"
    if fp8_grad is not None or blockwise:
        return "mosaic has no FP8 kernels; the FP8 recipes run on pallas"
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in MOSAIC_DTYPES]:
        return f"mosaic takes bfloat16 or float16 inputs, not {jnp.dtype(dtype)}"
    chosen = tiling or default_mosaic_tiling(k, n)
    if chosen is None:
        return f"mosaic tiles K and N in whole blocks of 64; K={k}, N={n} are not multiples of 64"
    for kernel in ("forward", "dgrad", "wgrad"):
        reason = mosaic_tile_problem(kernel, getattr(chosen, kernel), k, n)
        if reason:
            return reason
    return None


def choose_impl(impl: str, *, backend: str, dtype, k: int, n: int, tiling: Tiling | None = None,
                m: int | None = None, groups: int | None = None, fp8_grad=None, blockwise: bool = False,
                hopper: bool = False) -> str:
    """The implementation `impl` resolves to on `backend`: auto is mosaic on a Hopper GPU (`hopper`) for a call it
    can take, else pallas on a GPU (raising when the kernels cannot take the call), and xla elsewhere; an explicit
    choice is checked, never replaced. A `tiling` given with auto is a Triton tiling: auto then picks pallas."""
    if impl not in IMPLS:
        raise GroupedMatmulUnsupported(f"{FLAG}={impl!r} is not one of {', '.join(IMPLS)}")
    facts = dict(backend=backend, dtype=dtype, k=k, n=n, tiling=tiling, m=m, groups=groups, fp8_grad=fp8_grad,
                 blockwise=blockwise)
    if impl == "auto":
        if backend != "gpu":
            return "xla"
        if hopper and tiling is None and why_unsupported("mosaic", **facts) is None:
            return "mosaic"
        reason = why_unsupported("pallas", **facts)
        if reason:
            raise GroupedMatmulUnsupported(
                f"{FLAG}=auto picks the Pallas kernels on a GPU, and they cannot do this call: {reason}. Set "
                f"{FLAG}=xla to run lax.ragged_dot on purpose (a dense expansion here, far slower: docs/moe.md).")
        return "pallas"
    reason = why_unsupported(impl, **facts)
    if reason:
        raise GroupedMatmulUnsupported(f"{FLAG}={impl} cannot do this call: {reason}. Choose another tiling or "
                                       f"{FLAG}=xla.")
    return impl


def _check_operands(x, w, group_sizes, same_dtype: bool = True):
    if x.ndim != 2 or w.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(f"grouped_matmul expects x [M, K], w [G, K, N] and group_sizes [G] (a batch goes through "
                         f"jax.vmap); got x{x.shape}, w{w.shape}, group_sizes{group_sizes.shape}")
    if x.shape[1] != w.shape[1] or group_sizes.shape[0] != w.shape[0] or w.shape[0] == 0:
        raise ValueError(f"grouped_matmul: x{x.shape} . w{w.shape} needs K equal and G >= 1 group_sizes, got "
                         f"group_sizes{group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"grouped_matmul: group_sizes must be integers, not {group_sizes.dtype}")
    if same_dtype and x.dtype != w.dtype:
        raise ValueError(f"grouped_matmul needs x and w of one dtype; got {x.dtype} and {w.dtype}")


def grouped_matmul(x, w, group_sizes, *, impl: str = "auto", tiling: Tiling | None = None):
    """See the module docstring; raises GroupedMatmulUnsupported (naming --moe_grouped_gemm_impl) when `impl`
    cannot do the call."""
    _check_operands(x, w, group_sizes)
    (m, k), n = x.shape, w.shape[2]
    backend = jax.default_backend()
    chosen = choose_impl(impl, backend=backend, dtype=x.dtype, k=k, n=n, tiling=tiling, m=m, groups=w.shape[0],
                         hopper=is_hopper())
    _log_choice(impl, chosen, (m, k), tuple(w.shape), str(x.dtype))
    if chosen == "xla":
        return grouped_matmul_reference(x, w, group_sizes)
    if chosen == "mosaic":
        from mjax.kernels.grouped_matmul.mosaic import grouped_matmul_mosaic  # noqa: PLC0415

        return grouped_matmul_mosaic(x, w, group_sizes.astype(jnp.int32), tiling or default_mosaic_tiling(k, n),
                                     jax.devices()[0].core_count)
    from mjax.kernels.grouped_matmul.pallas import grouped_matmul_pallas  # noqa: PLC0415  (import only when chosen)

    return grouped_matmul_pallas(x, w, group_sizes.astype(jnp.int32), resolve_tiling(tiling, x.dtype, k, n),
                                 backend != "gpu")


def _one_impl(choices: set, op: str) -> str:
    """The implementation every weight of one call resolved to (they share x, so one kernel family runs them)."""
    if len(choices) != 1:
        raise ValueError(f"{op}: the weights resolve to different implementations ({', '.join(sorted(choices))}); "
                         "set --moe_grouped_gemm_impl explicitly")
    return next(iter(choices))


def fp8_grouped_matmul(x, w, group_sizes, meta, spec, *, impl: str = "auto", tiling: Tiling | None = None):
    """The grouped matmul in per-tensor FP8 (fp8.py): x [M, K] in the compute dtype, w one [G, K, N] (any float
    dtype; the master weights) or a tuple of them reading the same x, meta [G, 3] f32 (a tuple with w's), spec an
    mjax.kernels.quant.fp8.Fp8Spec -> y [M, N] in x.dtype (a tuple with w's). Raises GroupedMatmulUnsupported (naming
    --moe_grouped_gemm_impl) when `impl` cannot do the call."""
    from mjax.kernels.grouped_matmul.fp8 import GroupedFp8Plan, grouped_fp8  # noqa: PLC0415  (imports the kernels)

    many = isinstance(w, (tuple, list))
    ws, metas = (tuple(w), tuple(meta)) if many else ((w,), (meta,))
    if len(ws) != len(metas) or not ws:
        raise ValueError(f"fp8_grouped_matmul: one meta per weight, got {len(ws)} weights and {len(metas)} metas")
    if spec.recipe not in ("delayed", "tensorwise"):
        raise ValueError(f"fp8_grouped_matmul takes --fp8_recipe=delayed|tensorwise, not {spec.recipe!r}")
    for wi, mi in zip(ws, metas):
        _check_operands(x, wi, group_sizes, same_dtype=False)  # w: the master weights, quantized here
        if mi.shape != (wi.shape[0], 3):
            raise ValueError(f"fp8_grouped_matmul: meta must be [G, 3] = [{wi.shape[0]}, 3] for w{wi.shape}, got "
                             f"{mi.shape}")
    (m, k), backend = x.shape, jax.default_backend()
    grad_dtype = spec.dtypes[1]
    chosen = _one_impl({choose_impl(impl, backend=backend, dtype=x.dtype, k=k, n=wi.shape[2], tiling=tiling, m=m,
                                    groups=wi.shape[0], fp8_grad=grad_dtype) for wi in ws}, "fp8_grouped_matmul")
    for wi in ws:
        _log_choice(impl, chosen, (m, k), tuple(wi.shape), f"{x.dtype} fp8 {spec.recipe} {spec.format}")
    tilings = tuple(resolve_tiling(tiling, x.dtype, k, wi.shape[2], grad_dtype) if chosen == "pallas" else None
                    for wi in ws)
    plan = GroupedFp8Plan(spec, chosen, tilings, interpret=chosen == "pallas" and backend != "gpu")
    ys = grouped_fp8(x, ws, group_sizes.astype(jnp.int32), tuple(jnp.asarray(mi, jnp.float32) for mi in metas), plan)
    return ys if many else ys[0]


def blockwise_grouped_matmul(x, w, group_sizes, meta, fp8_format: str = "hybrid", *, impl: str = "auto",
                             tiling: Tiling | None = None):
    """The grouped matmul in blockwise FP8 (fp8_blockwise.py): x [M, K] in the compute dtype, w one [G, K, N] (the
    master weights) or a tuple of them reading the same x, meta [G, 3] f32 (a tuple with w's; only its cotangent is
    used), fp8_format --fp8_format -> y [M, N] in x.dtype (a tuple with w's). K and N must be multiples of 128
    (mjax.kernels.quant.blockwise.BlockwiseUnsupported otherwise, naming --fp8_recipe=blockwise); raises
    GroupedMatmulUnsupported (naming --moe_grouped_gemm_impl) when `impl` cannot do the call."""
    from mjax.kernels.grouped_matmul.fp8_blockwise import GroupedBlockwisePlan, grouped_blockwise  # noqa: PLC0415
    from mjax.kernels.quant.blockwise import BlockwiseUnsupported  # noqa: PLC0415
    from mjax.kernels.quant.fp8 import FORMATS  # noqa: PLC0415

    if fp8_format not in FORMATS:
        raise ValueError(f"--fp8_format={fp8_format!r} is not one of {', '.join(FORMATS)}")
    many = isinstance(w, (tuple, list))
    ws, metas = (tuple(w), tuple(meta)) if many else ((w,), (meta,))
    if len(ws) != len(metas) or not ws:
        raise ValueError(f"blockwise_grouped_matmul: one meta per weight, got {len(ws)} weights and {len(metas)} "
                         "metas")
    (m, k), backend = x.shape, jax.default_backend()
    for wi, mi in zip(ws, metas):
        _check_operands(x, wi, group_sizes, same_dtype=False)  # w: the master weights, quantized here
        if mi.shape != (wi.shape[0], 3):
            raise ValueError(f"blockwise_grouped_matmul: meta must be [G, 3] = [{wi.shape[0]}, 3] for w{wi.shape}, "
                             f"got {mi.shape}")
        if k % 128 or wi.shape[2] % 128:
            raise BlockwiseUnsupported(
                f"--fp8_recipe=blockwise needs the expert GEMMs' sizes to be multiples of 128 (x [{m}, {k}] . "
                f"w{tuple(wi.shape)}); change --hidden_size / --moe_ffn_hidden_size or use --fp8_recipe=tensorwise")
    chosen = _one_impl({choose_impl(impl, backend=backend, dtype=x.dtype, k=k, n=wi.shape[2], tiling=tiling, m=m,
                                    groups=wi.shape[0], blockwise=True) for wi in ws}, "blockwise_grouped_matmul")
    for wi in ws:
        _log_choice(impl, chosen, (m, k), tuple(wi.shape), f"{x.dtype} fp8 blockwise {fp8_format}")
    tilings = tuple((tiling or default_blockwise_tiling(k, wi.shape[2])) if chosen == "pallas" else None for wi in ws)
    plan = GroupedBlockwisePlan(fp8_format, chosen, tilings, interpret=chosen == "pallas" and backend != "gpu")
    ys = grouped_blockwise(x, ws, group_sizes.astype(jnp.int32), tuple(jnp.asarray(mi, jnp.float32) for mi in metas),
                           plan)
    return ys if many else ys[0]



@functools.cache
def _log_choice(requested, chosen, x_shape, w_shape, dtype):
    log.info("grouped matmul: %s (requested %s) for x%s . w%s %s", chosen, requested, x_shape, w_shape, dtype)
