"""The precision policy of linear layers and its kernels: per-tensor FP8 (fp8.py, with the cast-transpose kernel),
blockwise FP8 (blockwise.py, block_gemm.py) and FP4 (fp4.py, fp4_pallas.py); `quantized_matmul` (policy.py) is the
one dispatch point every quantized matmul goes through."""

from mjax.kernels.quant.policy import (IMPLS, META_SIZE, QuantPolicy, initial_meta, per_tensor_spec,
                                       policy_from_precision, quantized_matmul)

__all__ = ["IMPLS", "META_SIZE", "QuantPolicy", "initial_meta", "per_tensor_spec", "policy_from_precision",
           "quantized_matmul"]
