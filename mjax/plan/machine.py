"""The machine a plan is for: GPU count and node size, memory and GEMM rate per GPU, and the links between them."""

import dataclasses

from mjax.config import ConfigError

# name: (memory GiB, dense bf16 peak TFLOP/s, NVLink GB/s per direction per GPU, network GB/s per GPU, HBM GB/s)
# Peaks as mjax/train/metrics.py's MFU table; links: NVLink 4 (H100/H200) 450 GB/s, NVLink 5 (B200) 900 GB/s,
# one 400 Gb/s InfiniBand NIC per GPU (50 GB/s); HBM: the datasheets' 3.35 / 4.8 / 8 TB/s.
GPUS = {"h100": (80.0, 989.0, 450.0, 50.0, 3350.0), "h200": (141.0, 989.0, 450.0, 50.0, 4800.0),
        "b200": (180.0, 2250.0, 900.0, 50.0, 8000.0)}


@dataclasses.dataclass(frozen=True)
class Machine:
    num_gpus: int
    gpus_per_node: int
    memory_gib: float  # usable per GPU
    peak_tflops: float  # dense bf16 datasheet peak (the MFU denominator)
    gemm_efficiency: float = 0.6  # achieved / peak on the model's GEMMs (measure with benchmarks/benchmark.py)
    intra_node_gbps: float = 450.0  # GB/s per GPU within a node
    inter_node_gbps: float = 50.0  # GB/s per GPU across nodes
    comm_overlap: float = 0.5  # fraction of data-parallel / pipeline traffic hidden behind compute
    hbm_gbps: float = 3350.0  # GB/s of device memory: the weight and gradient traffic of each micro-batch

    @property
    def gemm_tflops(self) -> float:
        return self.peak_tflops * self.gemm_efficiency


def machine_from(num_gpus: int, gpus_per_node: int, gpu: str | None = None, memory_gib: float | None = None,
                 peak_tflops: float | None = None, **links) -> Machine:
    """A Machine from a GPU name (its memory, peak and links) with any figure overridden, or from the figures
    alone; raises ConfigError naming the flag to change."""
    if num_gpus < 1 or gpus_per_node < 1:
        raise ConfigError(f"--num_gpus={num_gpus} and --gpus_per_node={gpus_per_node} must be positive")
    if num_gpus > gpus_per_node and num_gpus % gpus_per_node:
        raise ConfigError(f"--num_gpus={num_gpus} is not a multiple of --gpus_per_node={gpus_per_node}")
    if gpu is not None:
        if gpu.lower() not in GPUS:
            raise ConfigError(f"--gpu={gpu}: known GPUs are {', '.join(GPUS)}; or give --gpu_memory_gib and "
                              "--peak_tflops")
        mem, peak, intra, inter, hbm = GPUS[gpu.lower()]
        memory_gib, peak_tflops = memory_gib or mem, peak_tflops or peak
        for name, value in (("intra_node_gbps", intra), ("inter_node_gbps", inter), ("hbm_gbps", hbm)):
            if links.get(name) is None:  # unset flags arrive as None
                links[name] = value
    if memory_gib is None or peak_tflops is None:
        raise ConfigError("give --gpu=h100|h200|b200, or both --gpu_memory_gib and --peak_tflops")
    links = {k: v for k, v in links.items() if v is not None}
    for name, value in links.items():
        low_ok = name == "comm_overlap"  # 0: nothing overlaps
        if value < 0 or (value == 0 and not low_ok) or (name in ("gemm_efficiency", "comm_overlap") and value > 1):
            raise ConfigError(f"--{name}={value} is out of range")
    return Machine(num_gpus, min(gpus_per_node, num_gpus), memory_gib, peak_tflops, **links)
