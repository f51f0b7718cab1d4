"""A/B of delta = rowsum(O dO) computed inside the dq kernel against XLA's einsum before it (PYTHONPATH picks the
tree), on bench_attention's own cases and functions: per round, ms of the Mosaic forward and forward + backward
and cuDNN's beside them (causal T=4096 B=8 and T=8192 B=4), and the packed case (T=8192, B=4, 4 documents a row)
with its unpacked row; two rounds, the second in reverse order. With `check`, first each gradient's largest error
against the float32 reference at T=1024, B=2 (causal and packed). `python delta_ab.py TAG [check]`."""
import sys

from mjax.xla_flags import apply_defaults

apply_defaults()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.attention_cases import inputs  # noqa: E402
from benchmarks.bench_attention import attention_fns, packed_segments  # noqa: E402
from benchmarks.harness import time_fn  # noqa: E402
from mjax.kernels.attention.mosaic import MosaicBlocks  # noqa: E402
from mjax.kernels.attention.reference import reference_attention  # noqa: E402

tag, heads = sys.argv[1], (32, 8, 128)
mosaic, cudnn = attention_fns("mosaic", MosaicBlocks(), False), attention_fns("cudnn", None, False)

if sys.argv[2:] == ["check"]:
    t, b = 1024, 2
    q, k, v, do = inputs(t, b, heads)
    for seg in (None, packed_segments(b, t)):
        got = mosaic[1](q, k, v, seg, do)
        with jax.default_matmul_precision("float32"):
            f32 = [x.astype(jnp.float32) for x in (q, k, v)]
            _, vjp = jax.vjp(lambda q, k, v: reference_attention(q, k, v, segment_ids=seg), *f32)
            want = vjp(do.astype(jnp.float32))
        errors = [float(jnp.max(jnp.abs(g.astype(jnp.float32) - w)) / jnp.max(jnp.abs(w))) for g, w in zip(got, want)]
        print("ERROR", tag, f"T={t} packed={seg is not None}", "dq/dk/dv max err / max |ref|",
              " ".join(f"{e:.2e}" for e in errors), flush=True)

cases = []
for t, b in ((4096, 8), (8192, 4)):
    q, k, v, do = inputs(t, b, heads, seed=t)
    cases += [(f"T={t}", "mosaic", mosaic, (q, k, v, None), do), (f"T={t}", "cudnn", cudnn, (q, k, v, None), do)]
cases.append(("T=8192", "mosaic packed", mosaic, (q, k, v, packed_segments(4, 8192)), do))
ms = {}
for rnd in range(2):
    for case, impl, (fwd, fwd_bwd), args, do in cases if rnd == 0 else cases[::-1]:
        ms.setdefault((case, impl), []).append((time_fn(fwd, *args, min_s=0.3) * 1e3,
                                                time_fn(fwd_bwd, *args, do, min_s=0.3) * 1e3))
for (case, impl), rounds in ms.items():
    print("RESULT", tag, case, impl, " ".join(f"fwd={f:.3f} fb={fb:.3f}" for f, fb in rounds), flush=True)
for rnd in range(2):
    m8, c8, p8 = ms[("T=8192", "mosaic")][rnd], ms[("T=8192", "cudnn")][rnd], ms[("T=8192", "mosaic packed")][rnd]
    m4, c4 = ms[("T=4096", "mosaic")][rnd], ms[("T=4096", "cudnn")][rnd]
    print("RATIO", tag, f"round {rnd}: vs cuDNN fwd/fb T=4096 {c4[0] / m4[0]:.3f}/{c4[1] / m4[1]:.3f} "
          f"T=8192 {c8[0] / m8[0]:.3f}/{c8[1] / m8[1]:.3f}; packed of unpacked {p8[0] / m8[0]:.3f}/{p8[1] / m8[1]:.3f}",
          flush=True)
