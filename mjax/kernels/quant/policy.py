"""The precision policy of linear layers: the one dispatch point every quantized matmul goes through.

`QuantPolicy` is built from PrecisionConfig (`policy_from_precision`) and handed to each `Linear` at construction;
None means the plain compute-dtype matmul. `quantized_matmul` picks the implementation:

| recipe (flag)              | GEMMs                                   | kernels (--quant_impl)                        |
|----------------------------|-----------------------------------------|-----------------------------------------------|
| --fp8_recipe=delayed       | cuBLASLt FP8 via XLA, per-tensor scales | pallas: cast-transpose; xla: casts            |
| --fp8_recipe=tensorwise    | cuBLASLt FP8 via XLA, per-tensor scales | pallas: cast-transpose; xla: casts            |
| --fp8_recipe=blockwise     | 1x128 / 128x128 block scales            | pallas: fp8_block_gemm; xla: f32 dequant GEMM |
| --fp4_recipe=nvfp4 / mxfp4 | e2m1 quantize -> dequantize, bf16 GEMM  | pallas: fused fake-quant; xla: casts+barriers |

`--quant_impl=auto` takes pallas on GPU and xla elsewhere; `pallas` off GPU runs the kernels interpreted (tests).
"""

import dataclasses

import jax
import jax.numpy as jnp

from mjax.kernels.quant.fp4 import Fp4Spec, fp4_matmul
from mjax.kernels.quant.fp8 import FP8_CAST, Fp8Spec, fp8_matmul
from mjax.kernels.quant.blockwise import BLOCK, BlockwiseSpec, blockwise_matmul
from mjax.kernels.options import FP4_RECIPES, QUANT_IMPLS

IMPLS = QUANT_IMPLS
META_SIZE = 3  # scales / observed amaxes of (input, weight, output gradient)


@dataclasses.dataclass(frozen=True)
class QuantPolicy:
    fp8_recipe: str | None = None
    fp8_format: str = "hybrid"
    fp8_margin: int = 0
    fp4_recipe: str | None = None
    fp4_hadamard: bool = False
    fp4_stochastic_rounding: bool = False
    quant_impl: str = "auto"
    bf16_layers: tuple[int, int] = (0, 0)  # transformer layers kept in compute dtype at the (start, end)
    quantize_output_layer: bool = False  # quantize the LM head too (Megatron keeps it in bf16)
    fp8_keep_casts: bool = False  # selective remat keeps the per-tensor FP8 operands (remat name fp8_cast)

    @property
    def remat_keeps(self) -> tuple[str, ...]:
        """Remat names a selective policy keeps on top of the model's: the FP8 copies of per-tensor GEMMs."""
        return (FP8_CAST,) if self.fp8_keep_casts and self.fp8_recipe in ("delayed", "tensorwise") else ()

    @property
    def has_fp8_meta(self) -> bool:
        """FP8 layers carry a [3] scale variable whose gradient is the observed amax (see kernels/quant/fp8.py)."""
        return self.fp8_recipe is not None


def policy_from_precision(precision) -> QuantPolicy | None:
    """None unless --fp8_recipe or --fp4_recipe is set (accepts any object with PrecisionConfig's fields)."""
    fp8, fp4 = getattr(precision, "fp8_recipe", None), getattr(precision, "fp4_recipe", None)
    if fp8 is None and fp4 is None:
        return None
    keep = ((precision.num_layers_at_start_in_bf16, precision.num_layers_at_end_in_bf16)
            if precision.first_last_layers_bf16 else (0, 0))
    return QuantPolicy(fp8_recipe=fp8, fp8_format=precision.fp8_format, fp8_margin=precision.fp8_margin,
                       fp4_recipe=fp4, fp4_hadamard=precision.fp4_hadamard,
                       fp4_stochastic_rounding=precision.fp4_stochastic_rounding, quant_impl=precision.quant_impl,
                       bf16_layers=keep, quantize_output_layer=precision.quantize_output_layer,
                       fp8_keep_casts=precision.fp8_keep_casts)


def _resolve_impl(impl: str) -> tuple[str, bool]:
    """(xla | pallas, interpret)."""
    if impl not in IMPLS:
        raise ValueError(f"--quant_impl={impl!r} is not one of {', '.join(IMPLS)}")
    on_gpu = jax.default_backend() == "gpu"
    if impl == "auto":
        return ("pallas" if on_gpu else "xla"), False
    return impl, impl == "pallas" and not on_gpu


def per_tensor_spec(policy: QuantPolicy) -> Fp8Spec:
    """The Fp8Spec of a delayed / tensorwise policy. `auto` on a GPU makes the FP8 copies with the cast-transpose
    kernel (faster than XLA's casts and transposes, docs/fp8.md)."""
    if policy.fp8_recipe not in ("delayed", "tensorwise"):
        raise ValueError(f"per-tensor FP8 needs --fp8_recipe=delayed|tensorwise, got --fp8_recipe={policy.fp8_recipe} "
                         f"--fp4_recipe={policy.fp4_recipe}")
    impl, interpret = _resolve_impl(policy.quant_impl)
    return Fp8Spec(policy.fp8_recipe, policy.fp8_format, policy.fp8_margin, impl, interpret)


def quantized_matmul(policy: QuantPolicy, x, w, meta=None, grad_words: bool = False):
    """x [M, K] in compute dtype, w [K, N] (master dtype), meta [3] f32 for FP8 -> [M, N] in x.dtype. `grad_words`:
    the output's gradient is written as 32-bit words of 16-bit pairs (Fp8Spec.grad_words; a layout hint)."""
    if policy.fp8_recipe in ("delayed", "tensorwise"):
        return fp8_matmul(x, w, meta, dataclasses.replace(per_tensor_spec(policy), grad_words=grad_words))
    if policy.fp8_recipe == "blockwise":
        impl, interpret = _resolve_impl(policy.quant_impl)
        return _padded_to_blocks(x, w, lambda x, w: blockwise_matmul(
            x, w, meta, BlockwiseSpec(policy.fp8_format, impl, interpret)))
    if policy.fp4_recipe in FP4_RECIPES:
        impl, interpret = _resolve_impl(policy.quant_impl)
        return fp4_matmul(x, w, Fp4Spec(policy.fp4_recipe, policy.fp4_hadamard, policy.fp4_stochastic_rounding, impl,
                                         interpret))
    raise ValueError(f"no quantized matmul for --fp8_recipe={policy.fp8_recipe} --fp4_recipe={policy.fp4_recipe}")


def initial_meta() -> jax.Array:
    """Scales before the first update: 1 (Transformer Engine's start; delayed scaling warms up in one step)."""
    return jnp.ones((META_SIZE,), jnp.float32)


def _padded_to_blocks(x, w, matmul):
    """matmul(x, w) with K and N zero-padded to whole 128-blocks, the output's padding sliced off: a partial last
    block is scaled by the amax of its real entries, as DeepSeek-V3 quantizes its 576-wide KV down-projection."""
    k, n = x.shape[1], w.shape[1]
    pk, pn = -k % BLOCK, -n % BLOCK
    if not (pk or pn):
        return matmul(x, w)
    y = matmul(jnp.pad(x, ((0, 0), (0, pk))), jnp.pad(w, ((0, pk), (0, pn))))  # [M, K + pk] @ [K + pk, N + pn]
    return y[:, :n]  # [M, N + pn] -> [M, N]
