"""Context parallelism's ring kernels on one GPU: rank r's ring steps (mjax/parallel/context_parallel.py's
ring_step_forward / ring_step_backward, the code the ring runs, without the exchange) against one flash kernel
over the whole sequence, and the load-balanced ring against the naive (contiguous chunks) one.

    python -m benchmarks.bench_context_parallel --json_out=$OUT/cp.json
    python -m benchmarks.bench_context_parallel --smoke   # off GPU: tiny shapes, kernels interpreted

1. One kernel: causal flash attention (Pallas; cuDNN beside it) over T = --seq tokens, forward and
   forward + backward TFLOP/s (the flash convention of bench_attention: the backward counts 2.5x the forward).
2. Ring: rank 0 of a cp = --cp ring, load-balanced: its two query chunks against each step's K/V block (all
   steps, forward; then the backward steps against the merged output). Its work is exactly 1/cp of the causal
   total, so its TFLOP/s = total / cp / time; the target is >= 90% of the one kernel's.
3. Balance: every (rank, step) of the ring timed alone; a ring step lasts as long as its slowest rank (the
   exchange waits for all), so the ring takes sum over steps of max over ranks. Load-balanced vs contiguous.
"""

import json

from absl import flags

from benchmarks.cli import BadInput, run_main

from mjax.xla_flags import apply_defaults

apply_defaults()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.attention_cases import causal_flops, inputs, rate, time_or_error  # noqa: E402
from benchmarks.harness import matmul_ceiling_tflops  # noqa: E402
from mjax.kernels.attention import dot_product_attention  # noqa: E402
from mjax.parallel.context_parallel import (AttentionPlan, chunk_ids, ring_step_backward,  # noqa: E402
                                            ring_step_forward)

flags.DEFINE_integer("seq", 32768, "Tokens of the sequence.")
flags.DEFINE_list("cps", ["4", "8"], "Ring sizes; the first is also the one of step 2.")
flags.DEFINE_bool("smoke", False, "Tiny shapes, kernels interpreted: checks the script off GPU.")
flags.DEFINE_string("json_out", "", "Write the results as JSON here.")
flags.DEFINE_float("min_time_s", 0.25, "Timed seconds per case.")
FLAGS = flags.FLAGS

HEADS = (32, 8, 128)


def _plan(cp, balanced, impl):
    return AttentionPlan(axis="context", cp=cp, a2a=1, load_balanced=balanced, causal=True, window=None, scale=None,
                         impl=impl, heads_axes=(), tp=1)


def _chunks(x, chunks, c):  # [B, T, ...] -> [B, 2c, ...]: the two chunks, in order
    return jnp.concatenate([jax.lax.dynamic_slice_in_dim(x, g * c, c, axis=1) for g in chunks], axis=1)


def ring_fns(plan, c):
    """jit'ed forward(q, k, v, rank) -> (out, lse) of one rank's ring steps over whole-sequence q/k/v, and
    step(q, k, v, out, lse, do, rank, source) -> one step's forward + backward (for the per-step balance)."""
    def queries(q, rank):
        return list(jnp.split(_chunks(q, chunk_ids(rank, plan.cp, plan.load_balanced), c), 2, axis=1))

    def held(k, v, source):
        chunks = chunk_ids(source, plan.cp, plan.load_balanced)
        return _chunks(k, chunks, c), _chunks(v, chunks, c), None

    def zeros(q):
        b, _, n, h = q.shape
        return [(jnp.zeros((b, c, n, h), jnp.float32), jnp.full((b, n, c), -jnp.inf, jnp.float32))] * 2

    def forward(q, k, v, rank):
        qs, mine, acc = queries(q, rank), chunk_ids(rank, plan.cp, plan.load_balanced), zeros(q)
        for step in range(plan.cp):
            source = (rank - step) % plan.cp
            acc = ring_step_forward(plan, qs, [None] * 2, mine, held(k, v, source),
                                    chunk_ids(source, plan.cp, plan.load_balanced), acc)
        return acc

    def backward(q, k, v, acc, do, rank, sources):
        qs, mine = queries(q, rank), chunk_ids(rank, plan.cp, plan.load_balanced)
        dos = list(jnp.split(_chunks(do, mine, c), 2, axis=1))
        outs = [o.astype(q.dtype) for o, _ in acc]
        dq, every = [jnp.zeros(x.shape, jnp.float32) for x in qs], []
        for source in sources:  # each block's dK/dV kept (on the ring they travel on), so none is dead code
            kv = held(k, v, source)
            grads = (jnp.zeros(kv[0].shape, jnp.float32), jnp.zeros(kv[1].shape, jnp.float32))
            dq, grads = ring_step_backward(plan, (qs, [None] * 2, outs, [l for _, l in acc], dos), mine, kv,
                                           chunk_ids(source, plan.cp, plan.load_balanced), dq, grads)
            every.append(grads)
        return dq, every

    def forward_backward(q, k, v, do, rank):
        acc = forward(q, k, v, rank)
        return backward(q, k, v, acc, do, rank, [(rank - s) % plan.cp for s in range(plan.cp)])

    def step(q, k, v, acc, do, rank, source):
        qs, mine = queries(q, rank), chunk_ids(rank, plan.cp, plan.load_balanced)
        theirs = chunk_ids(source, plan.cp, plan.load_balanced)
        acc = ring_step_forward(plan, qs, [None] * 2, mine, held(k, v, source), theirs, acc)
        return acc, backward(q, k, v, acc, do, rank, [source])

    return jax.jit(forward), jax.jit(forward_backward), jax.jit(step), jax.jit(zeros)


def main():
    cps = [int(x) for x in FLAGS.cps if x.isdigit()]
    if not cps or len(cps) != len(FLAGS.cps) or min(cps) < 2:
        raise BadInput(f"--cps={','.join(FLAGS.cps)}: expected comma-separated ring sizes >= 2")
    if jax.default_backend() != "gpu" and not FLAGS.smoke:
        raise BadInput(f"no GPU (JAX backend {jax.default_backend()}): pass --smoke to check the script")
    t, heads = (256, (4, 2, 64)) if FLAGS.smoke else (FLAGS.seq, HEADS)
    if any(t % (2 * cp) for cp in cps):
        raise BadInput(f"--seq={t} must be divisible by 2 x each of --cps={','.join(FLAGS.cps)}")
    impl = "pallas"
    n, _, h = heads
    q, k, v, do = inputs(t, 1, heads)
    total = causal_flops(1, t, n, h)
    ceiling = matmul_ceiling_tflops(256 if FLAGS.smoke else None)
    dev = jax.devices()[0]
    report = {"env": {"jax": jax.__version__, "device": dev.device_kind, "smoke": FLAGS.smoke}, "seq": t,
              "heads": heads, "matmul_ceiling_tflops": ceiling, "one_kernel": {}, "ring": {}, "balance": {}}
    print(f"{dev.device_kind}, jax {jax.__version__}; T={t}, {n} q / {heads[1]} kv heads, head dim {h}, causal, "
          f"bf16; bf16 matmul ceiling in this run {ceiling:.4g} TFLOP/s", flush=True)

    print("\n1. one kernel over the whole sequence", flush=True)
    for kernel in ("pallas", "cudnn"):
        if kernel == "cudnn" and jax.default_backend() != "gpu":
            continue
        row = report["one_kernel"].setdefault(kernel, {})
        fwd = jax.jit(lambda q, k, v, impl=kernel: dot_product_attention(q, k, v, causal=True, impl=impl))
        fwd_bwd = jax.jit(lambda q, k, v, do, f=fwd: jax.vjp(f, q, k, v)[1](do))
        for prefix, fn, args, flop in (("fwd_", fwd, (q, k, v), total), ("fwd_bwd_", fwd_bwd, (q, k, v, do),
                                                                          3.5 * total)):
            seconds, err = time_or_error(fn, *args, min_s=FLAGS.min_time_s)
            row[f"{prefix}error"] = err
            if seconds is not None:
                rate(row, prefix, flop, seconds, ceiling)
        print(f"  {kernel:7} fwd {row.get('fwd_tflops', float('nan')):8.4g} TFLOP/s   f+b "
              f"{row.get('fwd_bwd_tflops', float('nan')):8.4g} TFLOP/s", flush=True)

    cp = cps[0]
    print(f"\n2. rank 0 of a load-balanced ring, cp={cp} (1/cp of the work, as {cp} steps of 4 kernel calls)",
          flush=True)
    forward, forward_backward, step, zeros = ring_fns(_plan(cp, True, impl), t // (2 * cp))
    row = report["ring"]
    rank = jnp.int32(0)
    for prefix, fn, args, flop in (("fwd_", forward, (q, k, v, rank), total / cp),
                                   ("fwd_bwd_", forward_backward, (q, k, v, do, rank), 3.5 * total / cp)):
        seconds, err = time_or_error(fn, *args, min_s=FLAGS.min_time_s)
        row[f"{prefix}error"] = err
        if seconds is not None:
            rate(row, prefix, flop, seconds, ceiling)
            one = report["one_kernel"]["pallas"].get(f"{prefix}tflops")
            row[f"{prefix}of_one_kernel"] = row[f"{prefix}tflops"] / one if one else None
    print(f"  fwd {row.get('fwd_tflops', float('nan')):8.4g} TFLOP/s = {row.get('fwd_of_one_kernel') or 0:.1%} of "
          f"one kernel;  f+b {row.get('fwd_bwd_tflops', float('nan')):8.4g} TFLOP/s = "
          f"{row.get('fwd_bwd_of_one_kernel') or 0:.1%} (target >= 90%)", flush=True)

    print("\n3. ring time = sum over steps of the slowest rank's step (forward + backward)", flush=True)
    for cp in cps:
        times = {}
        for balanced in (True, False):
            _, _, step, zeros = ring_fns(_plan(cp, balanced, impl), t // (2 * cp))
            acc = zeros(q)
            per = [[time_or_error(step, q, k, v, acc, do, jnp.int32(r), jnp.int32((r - s) % cp),
                                  min_s=FLAGS.min_time_s)[0]
                    for r in range(cp)] for s in range(cp)]
            times[balanced] = sum(max(x for x in row_ if x is not None) for row_ in per)
            report["balance"][f"cp{cp}_{'balanced' if balanced else 'naive'}_ms"] = [[x * 1e3 for x in r_]
                                                                                       for r_ in per]
        report["balance"][f"cp{cp}_speedup"] = times[False] / times[True]
        print(f"  cp={cp}: load-balanced {times[True] * 1e3:8.3f} ms, naive {times[False] * 1e3:8.3f} ms: "
              f"{times[False] / times[True]:.2f}x (target >= 1.3x)", flush=True)
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    run_main(main)
