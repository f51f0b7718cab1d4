"""Where attention's forward + backward spends device time, kernel by kernel: the bench's causal and packed cases
traced with jax.profiler, each step's kernels in launch order with the idle time before each, averaged over steps.

    python -m benchmarks.profile_attention --kernel=mosaic --seqs=8192 --profile_hlo_dir=$OUT

prints per case the device span of a step (first kernel's start to last kernel's end), the time kernels ran, the
idle time between them, and each kernel's time; --profile_hlo_dir gets each case's compiled HLO. --heads, --seqs
and --tokens are bench_attention's flags.
"""

import os

from absl import flags

from benchmarks.cli import BadInput, run_main
from mjax.xla_flags import apply_defaults

apply_defaults()

import jax  # noqa: E402

from benchmarks.attention_cases import inputs  # noqa: E402
from benchmarks.bench_attention import attention_fns, packed_segments, parse_heads, parse_seqs  # noqa: E402
from benchmarks.profile import step_table, stream_kernels, trace  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("kernel", "mosaic", ["mosaic", "pallas", "cudnn"], "Attention kernel to profile.")
flags.DEFINE_integer("traced_steps", 10, "Traced steps per case.")
flags.DEFINE_string("profile_hlo_dir", None, "Folder for each case's compiled HLO.")


def profile_case(fn, steps):
    """step_table of `steps` traced calls of fn() after two warm-up calls."""
    jax.block_until_ready(fn())
    jax.block_until_ready(fn())
    data, _ = trace(lambda: jax.block_until_ready(fn()), steps)
    return step_table(stream_kernels(data), steps)


def main():
    if jax.default_backend() != "gpu":
        raise BadInput(f"no GPU (JAX backend {jax.default_backend()}): the trace reads the GPU's kernels")
    heads = parse_heads(FLAGS.heads)
    for t in parse_seqs(FLAGS.seqs):
        b = FLAGS.tokens // t
        q, k, v, do = inputs(t, b, heads)
        for packed in (False, True) if FLAGS.kernel != "cudnn" else (False,):
            seg = packed_segments(b, t) if packed else None
            _, fwd_bwd = attention_fns(FLAGS.kernel, None, False)
            args = (q, k, v, seg, do)
            name = f"{FLAGS.kernel} T={t} B={b}{' packed' if packed else ''}"
            compiled = fwd_bwd.lower(*args).compile()  # once: traced below, its HLO written where asked
            if FLAGS.profile_hlo_dir:
                os.makedirs(FLAGS.profile_hlo_dir, exist_ok=True)
                path = f"hlo_{FLAGS.kernel}_{t}{'_packed' if packed else ''}.txt"
                with open(os.path.join(FLAGS.profile_hlo_dir, path), "w") as f:
                    f.write(compiled.as_text())
            rows, span = profile_case(lambda: compiled(*args), FLAGS.traced_steps)
            running, idle = sum(r for _, r, _ in rows), sum(i for *_, i in rows)
            print(f"\n{name}: step span {span:.3f} ms, kernels running {running:.3f} ms, idle between them "
                  f"{idle:.3f} ms, {len(rows)} kernels")
            for kernel, r, i in rows:
                print(f"  {r:8.3f} ms  idle before {i:6.3f}  {kernel[:90]}")
    return 0


if __name__ == "__main__":
    run_main(main)
