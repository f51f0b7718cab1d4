"""How a model runs, apart from what it is: kernel choices, the recomputation policy, the layer loop. Changing these
never changes what a checkpoint means: a checkpoint's config holds the choices it was trained (or converted) with,
and any run may pick others."""

import dataclasses

from mjax.config.base import field


@dataclasses.dataclass(frozen=True)
class ExecutionConfig:
    attention_impl: str = field("auto", "attention_impl", "auto | xla | cudnn | mosaic | pallas "
                                "(mjax/kernels/attention; mosaic: Hopper only).")
    qkv_grad_impl: str = field("auto", "qkv_grad_impl", "auto | xla | pallas: the fused QKV projection's gradient "
                               "assembly (auto: pallas on a GPU where it tiles).")
    cross_entropy_impl: str = field("reference", "cross_entropy_impl",
                                    "reference (whole fp32 logits) | fused (output layer + loss in sequence chunks).")
    cross_entropy_chunk: int = field(1024, "cross_entropy_chunk", "Sequence positions per chunk when fused.")
    moe_grouped_gemm_impl: str = field("auto", "moe_grouped_gemm_impl",
                                       "auto | pallas | mosaic | xla: the MoE expert GEMMs (auto: mosaic on "
                                       "Hopper, else pallas, on a GPU).")
    moe_alltoall_impl: str = field("auto", "moe_alltoall_impl",
                                   "auto | ragged | padded: the alltoall dispatcher's exchange (auto: ragged on a GPU).")
    remat_policy: str = field("none", "remat_policy", "none | selective | full: activation recomputation.")
    # Default: every matmul output and the attention kernel's results are kept, only elementwise work (norms,
    # RoPE, SwiGLU product) is recomputed: the fastest selective set measured (docs/performance.md).
    remat_save_names: tuple[str, ...] = field(
        ("qkv_proj", "attn_core", "attn_context", "attn_out", "mlp_up", "mlp_out"), "remat_save_names",
        "With --remat_policy=selective: the named activations kept (the rest is recomputed).")
    scan_layers: bool = field(True, "scan_layers", "Run the layer stack with lax.scan (one compiled layer).")
    deterministic_mode: bool = field(False, "deterministic_mode",
                                     "Compile every program of the run with xla_gpu_deterministic_ops (XLA's "
                                     "run-to-run determinism: no timing-based autotuning, no atomic scatter-adds); "
                                     "potentially slower. Not with cuDNN attention (auto skips it).")
