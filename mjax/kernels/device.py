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


def mosaic_interpreter_problem() -> str | None:
    """Why the Mosaic GPU kernels cannot run interpreted here (None: they can). The interpreter is jax >= 0.12's,
    in a private module; 0.11's cannot lower mjax's kernels (their effects, their chained pipelines)."""
    if jax.__version_info__ < (0, 12):
        return f"the Mosaic GPU interpreter these kernels run under is jax >= 0.12's (this is jax {jax.__version__})"
    try:
        from jax._src.pallas.mosaic_gpu.interpret import params  # noqa: F401, PLC0415 (private)
    except ImportError as e:
        return f"no Mosaic GPU interpreter in jax {jax.__version__} ({e})"
    return None


def mosaic_interpreter(*, detect_races: bool = True):
    """The Mosaic GPU interpreter's parameters for a kernel's `interpret`: simulated warpgroups, barriers and TMA
    copies, the race detector (happens-before, PTX's proxies included), shared memory NaN until written. Call only
    where mosaic_interpreter_problem() is None."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # noqa: PLC0415 (private)

    return InterpretGPUParams(detect_races=detect_races, uninitialized_memory="nan")
