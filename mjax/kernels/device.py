"""Facts about the device the kernels run on."""

import jax

# Shared memory one thread block may use on H100/H200 (227 KiB, the opt-in maximum of compute capability 9.0).
SHARED_MEMORY_BYTES = 227 * 1024
HOPPER_SMS = 132  # H100 SXM and H200


def is_hopper() -> bool:
    """Whether the default device is an NVIDIA GPU of compute capability 9.x (wgmma, TMA: the Mosaic GPU kernels)."""
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "0")).startswith("9")


def sm_count() -> int:
    """Streaming multiprocessors of the default GPU (a persistent kernel's programs); Hopper's where none is
    attached, for kernels lowered off the GPU (their tests), which never run there."""
    device = jax.devices()[0]
    return device.core_count if device.platform == "gpu" else HOPPER_SMS
