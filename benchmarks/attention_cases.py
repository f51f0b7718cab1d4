"""Attention benchmark cases shared by bench_attention and bench_context_parallel: inputs, FLOP counts, timing."""

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import time_fn

DTYPE = jnp.bfloat16


def causal_flops(b, t, n, h, window=None):
    """Forward FLOPs of causal attention: 2 matmuls of 2*H per visible (query, key) pair."""
    pairs = t * t / 2 if window is None else t * min(window, t) - min(window, t) ** 2 / 2
    return 4 * b * n * pairs * h


def inputs(t, b, heads, seed=0):
    n, kh, h = heads
    ks = jax.random.split(jax.random.key(seed), 4)
    shapes = [(b, t, n, h), (b, t, kh, h), (b, t, kh, h), (b, t, n, h)]  # q, k, v, dO
    return [jax.random.normal(key, shape, jnp.float32).astype(DTYPE) for key, shape in zip(ks, shapes)]


def time_or_error(fn, *args, min_s: float):
    """(mean seconds per call, None), or (None, the error in one line): one failing case must not end a run."""
    try:
        return time_fn(fn, *args, min_s=min_s), None
    except Exception as e:  # noqa: BLE001  (e.g. out of memory)
        return None, f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


def rate(row, prefix, flop, seconds, ceiling):
    row[f"{prefix}ms"] = seconds * 1e3
    row[f"{prefix}tflops"] = flop / seconds / 1e12
    row[f"{prefix}of_ceiling"] = row[f"{prefix}tflops"] / ceiling


def pass_speedups(mine, reference):
    """(median, [min, max]) over the passes where both ran of reference seconds / mine (> 1: mine is faster; a ratio
    within one pass, so a clock drifting between passes cancels), or None if no pass ran both."""
    ratios = [r / m for m, r in zip(mine, reference) if m is not None and r is not None]
    return (float(np.median(ratios)), [min(ratios), max(ratios)]) if ratios else None
