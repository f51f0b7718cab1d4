"""The benchmarks' shared harness: one timing helper, one per-pass ratio, one matmul ceiling, the GPU's clock, and
the throughput of the real train step on synthetic data (with the ceiling measured in the same run), printed as one
table."""

import dataclasses
import os
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from mjax.train.loop import build
from mjax.train.startup import compiled_memory
from mjax.train.metrics import flops_per_step, peak_memory_bytes, peak_tflops


def time_fn(f, *args, min_s=0.25, max_iters=50) -> float:
    """Mean seconds per call of f(*args) after compile and warm-up; one block at the end of the timed loop."""
    jax.block_until_ready(f(*args))
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    one = max(time.perf_counter() - t, 1e-6)
    n = int(min(max_iters, max(3, min_s / one)))
    t = time.perf_counter()
    for _ in range(n):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / n


def pass_ratios(mine, reference):
    """(median, [min, max]) of reference seconds / mine over the passes where both ran (> 1: mine is faster; each
    ratio within one pass, so a clock drifting between passes cancels), or None if no pass ran both."""
    ratios = [r / m for m, r in zip(mine, reference) if m is not None and r is not None]
    return (float(np.median(ratios)), [min(ratios), max(ratios)]) if ratios else None


def sm_clock_mhz() -> int | None:
    """The SM clock now of JAX's first GPU (the first of CUDA_VISIBLE_DEVICES where set; nvidia-smi takes its index
    or UUID), by nvidia-smi; None where there is no nvidia-smi or it reports none. Read right after a timed loop
    (nvidia-smi takes tens of ms to answer, the GPU idle meanwhile), it tells which clock state the loop ended in:
    under sustained load the clock falls well below its boost, by different amounts for different kernels."""
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip() or "0"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits", f"--id={gpu}"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = (out.split() or [""])[0]
    return int(first) if first.isdigit() else None


def matmul_ceiling_tflops(n: int | None = None, dtype=jnp.bfloat16) -> float:
    """TFLOP/s of one n^3 matmul per device through JAX (8192 on GPU, 1024 elsewhere), random data."""
    n = n or (8192 if jax.default_backend() == "gpu" else 1024)
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    return 2 * n**3 / time_fn(jax.jit(lambda x, y: x @ y), a, b) / 1e12


def synthetic_batch(cfg, setup, seed=0):
    rng = np.random.default_rng(seed)
    b, t = cfg.train.global_batch_size // jax.process_count(), cfg.train.seq_length
    tokens = rng.integers(0, cfg.model.vocab_size, (b, t + 1), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": np.ones((b, t), np.float32),
             "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
             "segment_ids": np.ones((b, t), np.int32)}
    return setup.place_batch(batch)


@dataclasses.dataclass
class Result:
    name: str
    step_time_s: float
    tokens_per_s: float
    tflops_per_device: float
    mfu: float | None
    mfu_vs_ceiling: float
    peak_memory_gib: float
    compile_s: float
    loss: float
    compiled_gib: float = float("nan")  # XLA's own estimate for this step: arguments + outputs + temporaries
    error: str | None = None
    profile: object = None  # benchmarks.profile.Profile when asked for


def compiled_memory_gib(compiled) -> float:
    analysis = compiled_memory(compiled)
    return float("nan") if analysis is None else analysis[1] / 2**30


def run_case(name: str, cfg, steps: int, ceiling: float, devices=None, hlo_path=None, compiler_options=None,
             profile_steps: int = 0) -> Result:
    """Compiles the step, runs 2 warm-up steps, then times `steps` steps (blocking once at the end).
    `hlo_path` receives the compiled (scheduled) HLO, gzipped, to see which collectives overlap compute;
    `compiler_options` are XLA options for this case's compile; `profile_steps` > 0 traces that many more steps
    and attaches where their device time went (benchmarks/profile.py)."""
    setup = build(cfg, devices)
    state = setup.init_state(cfg.train.seed)
    batch = synthetic_batch(cfg, setup)
    compiled, compile_s = setup.compile_step(state, batch, compiler_options)
    if hlo_path:
        import gzip  # noqa: PLC0415

        with gzip.open(hlo_path, "wt") as f:
            f.write(compiled.as_text())
    for _ in range(2):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, metrics = compiled(state, batch)
    loss = float(metrics["loss"])  # blocks
    dt = (time.perf_counter() - t0) / steps
    profile = None
    if profile_steps:
        from benchmarks.profile import profile_step  # noqa: PLC0415

        box = [state]

        def one_step():
            box[0], m = compiled(box[0], batch)
            jax.block_until_ready(m)

        profile = profile_step(one_step, profile_steps, compiled.as_text())
    n = setup.mesh.size
    tflops = flops_per_step(cfg.model, cfg.train.global_batch_size, cfg.train.seq_length) / dt / n / 1e12
    peak = peak_tflops(override=cfg.logging.peak_tflops)
    return Result(name, dt, cfg.train.global_batch_size * cfg.train.seq_length / dt, tflops,
                  tflops / peak if peak else None, tflops / ceiling, peak_memory_bytes() / 2**30, compile_s, loss,
                  compiled_memory_gib(compiled), profile=profile)


def run_baseline(cfg, steps: int, ceiling: float) -> Result:
    """The plain-JAX step of benchmarks/baseline.py on cfg's shapes, on one device, timed like run_case."""
    from benchmarks import baseline  # noqa: PLC0415

    m, t = cfg.model, cfg.train
    params = baseline.init(m, jax.random.key(0))
    tx, step = baseline.make_step(m)
    opt_state = tx.init(params)
    tokens = jax.random.randint(jax.random.key(1), (t.global_batch_size, t.seq_length + 1), 0, m.vocab_size)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    t0 = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, inputs, targets).compile()
    compile_s = time.perf_counter() - t0
    for _ in range(2):
        params, opt_state, loss = compiled(params, opt_state, inputs, targets)
    jax.block_until_ready(loss)
    t0 = time.perf_counter()
    for _ in range(steps):
        params, opt_state, loss = compiled(params, opt_state, inputs, targets)
    loss = float(loss)
    dt = (time.perf_counter() - t0) / steps
    tflops = flops_per_step(m, t.global_batch_size, t.seq_length) / dt / 1e12
    peak = peak_tflops(override=cfg.logging.peak_tflops)
    return Result("plain-JAX baseline (1 device)", dt, t.global_batch_size * t.seq_length / dt, tflops,
                  tflops / peak if peak else None, tflops / ceiling, peak_memory_bytes() / 2**30, compile_s, loss,
                  compiled_memory_gib(compiled))


def format_table(results, ceiling: float) -> str:
    head = (f"{'case':<40} {'step s':>8} {'tokens/s':>11} {'TFLOP/s/dev':>11} {'MFU(989)':>8} "
            f"{'of ceiling':>10} {'step GiB':>9} {'compile s':>9}")
    lines = [f"bf16 matmul ceiling measured in this run: {ceiling:.1f} TFLOP/s per device; step GiB: XLA's estimate "
             "of the compiled step's memory (arguments + outputs + temporaries)", head, "-" * len(head)]
    for r in results:
        if r.error:
            lines.append(f"{r.name:<40} failed: {r.error[:90]}")
            continue
        mfu = f"{r.mfu:.1%}" if r.mfu is not None else "n/a"
        lines.append(f"{r.name:<40} {r.step_time_s:>8.4f} {r.tokens_per_s:>11,.0f} {r.tflops_per_device:>11.1f} "
                     f"{mfu:>8} {r.mfu_vs_ceiling:>10.1%} {r.compiled_gib:>9.2f} {r.compile_s:>9.1f}")
    return "\n".join(lines)
