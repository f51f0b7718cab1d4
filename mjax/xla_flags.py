"""XLA flags mjax sets for GPUs before JAX starts. A flag already in XLA_FLAGS is never overridden, and
MJAX_XLA_DEFAULTS=0 turns the defaults off."""

import os

GPU_DEFAULTS = (
    # Overlap collectives (DP/FSDP gradient reductions, TP all-gathers) with compute.
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    # Combine small collectives into large ones (fewer launches per step).
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
    # Every GEMM to cuBLAS(Lt). With Triton GEMM fusions on, XLA took the FP8 output-layer GEMM of the fused loss
    # (f32 logits) into a Triton fusion: its autotuning ran past 250 s of compile, untuned it ran at 1.27 s a 1B
    # step. Off: the 3B FP8 step compiles in 27 s; 3B steps 0.75-0.8% faster, 1B unchanged (docs/performance.md).
    "--xla_gpu_enable_triton_gemm=false",
)


def apply_defaults() -> None:
    if os.environ.get("MJAX_XLA_DEFAULTS", "1") == "0":
        return
    current = os.environ.get("XLA_FLAGS", "")
    given = {f.split("=")[0] for f in current.split()}
    added = [f for f in GPU_DEFAULTS if f.split("=")[0] not in given]
    os.environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
