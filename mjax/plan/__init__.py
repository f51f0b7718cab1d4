"""The layout planner: every layout train.py would accept for a config on a machine, its memory per device, step
time and throughput predicted, ranked, and (optionally) checked against XLA's compiled memory (docs/planner.md)."""
