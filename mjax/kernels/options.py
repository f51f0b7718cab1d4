"""The kernels' option names and static capability facts, importable without JAX (config validation reads them)."""

ATTENTION_IMPLS = ("auto", "xla", "cudnn", "mosaic", "pallas")
QUANT_IMPLS = ("auto", "xla", "pallas")
QKV_GRAD_IMPLS = ("auto", "xla", "pallas")
CROSS_ENTROPY_IMPLS = ("reference", "fused")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise")
FP4_RECIPES = ("nvfp4", "mxfp4")

# Remat names the kernels give their results: an attention kernel's output and softmax statistics (saving them
# keeps the backward from rerunning the forward kernel), and a per-tensor FP8 GEMM's quantized operands and scales.
ATTN_CORE = "attn_core"
FP8_CAST = "fp8_cast"


def qkv_kernel_tiles(head_dim: int) -> bool:
    """Whether the QKV gradient kernel can tile this head dim: Triton's tiles need half of it a power of two."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half > 0 and half & (half - 1) == 0
