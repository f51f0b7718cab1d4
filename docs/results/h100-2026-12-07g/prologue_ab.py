"""What attention's per-call XLA work before the Mosaic kernels costs: the block runs and the deal, computed from
the segment ids. Forward + backward (one jit, as bench_attention times it) of the packed case (T=8192, B=4, 4
documents a row) and of the causal case, timed twice: "xla", that work running as XLA ops on the segment ids in
every call (as in training), and "const", its results computed once outside and baked in as constants (the
kernels alone). Prints ms and a hash of the gradients. Per tree: PYTHONPATH=TREE python
docs/results/h100-2026-12-07g/prologue_ab.py TAG"""
import hashlib
import sys

from mjax.xla_flags import apply_defaults

apply_defaults()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.attention_cases import inputs  # noqa: E402
from benchmarks.bench_attention import attention_fns, packed_segments  # noqa: E402
from benchmarks.harness import time_fn  # noqa: E402
from mjax.kernels.attention import mosaic, mosaic_backward, mosaic_forward  # noqa: E402

BLOCK_RUNS, DEAL = mosaic.block_runs, mosaic_forward.deal


def baked(seg):
    """Patches the wrapper's block_runs and the kernels' deal to return constants computed from `seg` (None: the
    causal case) outside the trace. The deal, traced inside the kernels' own jit, is computed from the runs the
    wrapper made just before it (each kernel's block_runs call is followed by its deal call)."""
    last = {}

    def block_runs(spec, offsets, q_seg, kv_seg, **kw):
        b = offsets.shape[0]
        s = None if seg is None else jnp.asarray(seg)  # T is a block multiple here: no padding to add
        with jax.ensure_compile_time_eval():
            last["runs"] = jnp.asarray(np.asarray(BLOCK_RUNS(spec, jnp.full((b,), spec.offset, jnp.int32), s, s,
                                                             **kw)))
        return last["runs"]

    def deal(runs, *args):
        with jax.ensure_compile_time_eval():
            return jnp.asarray(np.asarray(DEAL(last["runs"], *args)))

    mosaic.block_runs, mosaic_forward.deal, mosaic_backward.deal = block_runs, deal, deal


def restore():
    mosaic.block_runs, mosaic_forward.deal, mosaic_backward.deal = BLOCK_RUNS, DEAL, DEAL


tag = sys.argv[1]
CPU = jax.default_backend() == "cpu"  # a dry run of the script, interpreted at toy sizes
for packed in (True, False):
    t, b = (256, 2) if CPU else (8192, 4)
    q, k, v, do = inputs(t, b, (4, 2, 64) if CPU else (32, 8, 128))
    seg = packed_segments(b, t) if packed else None
    for mode in ("xla", "const", "xla"):
        jax.clear_caches()  # the kernels' inner jits would otherwise reuse the other mode's trace
        if mode == "const":
            baked(seg)
        else:
            restore()
        _, f = attention_fns("mosaic", None, CPU)
        args = (q, k, v, seg, do)  # const: the patched functions ignore the traced ids
        if mode == "const":
            text = f.lower(*args).as_text()
            assert "sort" not in text and "scatter" not in text, "the const mode still computes the deal"
        grads = jax.block_until_ready(f(*args))
        digest = hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in grads)).hexdigest()[:16]
        ms = time_fn(f, *args, min_s=0.5, max_iters=2 if CPU else 50) * 1e3
        print("RESULT", tag, f"T={t} packed={packed} {mode} fb={ms:.3f} grads {digest}", flush=True)
