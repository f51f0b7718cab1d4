"""XLA flags and the GPU memory fraction mjax sets before JAX creates a backend. A flag already in XLA_FLAGS, or a
XLA_PYTHON_CLIENT_MEM_FRACTION already set, is never overridden; MJAX_XLA_DEFAULTS=0 turns the defaults off."""

import os

GPU_DEFAULTS = (
    # Overlap collectives (DP/FSDP gradient reductions, TP all-gathers) with compute.
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    # Combine small collectives into large ones (fewer launches per step).
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
    # Every GEMM to cuBLAS(Lt). With Triton GEMM fusions on, XLA took the FP8 output-layer GEMM of the fused loss
    # (f32 logits) into a Triton fusion whose autotuning stalled the compile and which ran far slower untuned; off,
    # FP8 steps compile quickly and no step is slower (docs/performance.md "XLA flags", docs/fp8.md).
    "--xla_gpu_enable_triton_gemm=false",
)


# --deterministic_mode, per compile: scatter-adds (the embedding's gradient) in a fixed order instead of by atomics,
# and none of XLA's timing-based choices (its fusion autotuner picks one of two emitters per reduction by measuring
# both, so two processes could sum in different orders).
DETERMINISTIC_OPTIONS = {"xla_gpu_deterministic_ops": True}


# XLA's options that compile a GPU program with deterministic ops only, whether --deterministic_mode or the user
# set them: kernels that fail under them (cuDNN's attention) are then not chosen.
DETERMINISTIC_FLAGS = ("xla_gpu_deterministic_ops", "xla_gpu_exclude_nondeterministic_ops")


def compile_options(execution) -> dict | None:
    """The XLA options every compile of a run takes (`execution`: the run's ExecutionConfig)."""
    return dict(DETERMINISTIC_OPTIONS) if execution.deterministic_mode else None


def given_flags() -> dict[str, str]:
    """XLA_FLAGS as {name without dashes: value}; a bare flag is a boolean set true, as XLA reads it."""
    return dict((f.lstrip("-").split("=", 1) + ["true"])[:2] for f in os.environ.get("XLA_FLAGS", "").split())


def deterministic_ops_in_xla_flags() -> bool:
    """Whether XLA_FLAGS sets one of DETERMINISTIC_FLAGS true."""
    flags = given_flags()
    return any(flags.get(name, "false").lower() in ("true", "1") for name in DETERMINISTIC_FLAGS)


def deterministic_run(execution) -> bool:
    """Whether a run's programs compile with deterministic ops only: --deterministic_mode, or XLA_FLAGS."""
    return execution.deterministic_mode or deterministic_ops_in_xla_flags()


# JAX's allocator takes 75% of GPU memory by default, too little for the llama3.2-3b preset at 8 x 4096 tokens
# (XLA's estimate of its step: docs/performance.md). mjax's training and benchmark scripts let the allocator take
# 95% (the rest: CUDA context, cuDNN/cuBLAS workspaces and NCCL buffers).
GPU_MEM_FRACTION = "0.95"


def apply_defaults() -> None:
    if os.environ.get("MJAX_XLA_DEFAULTS", "1") == "0":
        return
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEM_FRACTION)
    current = os.environ.get("XLA_FLAGS", "")
    given = given_flags()
    added = [f for f in GPU_DEFAULTS if f.lstrip("-").split("=")[0] not in given]
    os.environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
