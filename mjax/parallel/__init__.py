"""Parallelism from outside the model: the device mesh and the logical-axis -> mesh-axis rules."""
