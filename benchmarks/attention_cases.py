"""Attention benchmark cases shared by bench_attention and bench_context_parallel: inputs, FLOP counts, timing,
and a table row summarised from several passes of timings."""

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import pass_ratios, time_fn

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


def summarise_passes(row, times, cudnn_times, flop, ceiling, unpacked_times=None):
    """row with the passes' timings (per pass: forward s, forward + backward s, error, and the SM clocks in MHz
    read after each of the two loops; None where not run or read): the median times as rates, the first error, the
    clocks per pass ('fwd_clock_mhz', 'fwd_bwd_clock_mhz', and the unpacked runs' as 'unpacked_fwd_clock_mhz',
    ...), and with cudnn_times (the same passes of cuDNN) the kernel's speed-up over cuDNN, the median of the
    passes' own ratios ('*_x_cudnn'; with several passes also their range); with unpacked_times (the same kernel on
    unpacked rows, timed in the same passes) the packed row's time over the unpacked one's, likewise
    ('*_of_unpacked'; an error of the unpacked runs as 'unpacked_error')."""
    row.update(passes=len(times), error=next((p[2] for p in times if p[2]), None))
    if unpacked_error := next((p[2] for p in unpacked_times or () if p[2]), None):
        row["unpacked_error"] = unpacked_error
    for m, (prefix, mult) in enumerate((("fwd_", 1.0), ("fwd_bwd_", 3.5))):
        for name, timings in (("", times), ("unpacked_", unpacked_times)):
            if timings:
                row[f"{name}{prefix}clock_mhz"] = [p[3 + m] for p in timings]
        ran = [p[m] for p in times if p[m] is not None]
        if ran:
            rate(row, prefix, mult * flop, float(np.median(ran)), ceiling)
        mine = [p[m] for p in times]
        for key, ratio in (("x_cudnn", cudnn_times and pass_ratios(mine, [p[m] for p in cudnn_times])),
                           ("of_unpacked", unpacked_times and pass_ratios([p[m] for p in unpacked_times], mine))):
            if ratio:
                row[f"{prefix}{key}"] = ratio[0]
                if len(times) > 1:
                    row[f"{prefix}{key}_range"] = ratio[1]
    return row
