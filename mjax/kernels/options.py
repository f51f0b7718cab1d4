"""The kernels' option names and static capability facts, importable without JAX (config validation reads them)."""

ATTENTION_IMPLS = ("auto", "xla", "cudnn", "mosaic", "pallas")
QUANT_IMPLS = ("auto", "xla", "pallas")
QKV_GRAD_IMPLS = ("auto", "xla", "pallas")
CROSS_ENTROPY_IMPLS = ("reference", "fused")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise")
FP4_RECIPES = ("nvfp4", "mxfp4")
# Why --deterministic_mode excludes cuDNN attention (docs/performance.md, "Determinism")
CUDNN_NOT_DETERMINISTIC = ("cuDNN's attention fails at run time under XLA's deterministic ops (jax 0.11.2 on an "
                           "H100: IndexError raw_hash_map::at)")

# Remat names the kernels give their results: an attention kernel's output and softmax statistics (saving them
# keeps the backward from rerunning the forward kernel), and a per-tensor FP8 GEMM's quantized operands and scales.
ATTN_CORE = "attn_core"
FP8_CAST = "fp8_cast"


def qkv_kernel_tiles(head_dim: int) -> bool:
    """Whether the QKV gradient kernel can tile this head dim: Triton's tiles need half of it a power of two."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half > 0 and half & (half - 1) == 0
