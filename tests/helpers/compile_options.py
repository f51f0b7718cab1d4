"""XLA:CPU options for train steps that run many times or through a pipeline.

FAST_COMPILE (train_utils: backend -O0) compiles fastest, but at -O0 a step heavy on FP8 casts, or a pipeline's scan
over ticks, runs several times slower than at -O1; there these options pay for their extra compile time. Programs
compared to rounding are compiled alike: both with FAST_COMPILE or both with these."""

STEP_COMPILE = {"xla_backend_optimization_level": 1, "xla_llvm_disable_expensive_passes": True}
