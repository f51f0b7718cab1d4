"""Facts about the device the kernels run on."""

import jax


def is_hopper() -> bool:
    """Whether the default device is an NVIDIA GPU of compute capability 9.x (wgmma, TMA: the Mosaic GPU kernels)."""
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "0")).startswith("9")
