"""mjax's benchmarks and GPU run scripts: tooling the library never imports.

Run from the repository root as modules:

    python -m benchmarks.benchmark --config=tiny --steps=2

harness.py holds what they share: one timing helper (`time_fn`), one matmul ceiling (`matmul_ceiling_tflops`) and the
train-step throughput table.
"""
