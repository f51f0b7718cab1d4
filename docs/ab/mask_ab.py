"""A/B of two trees of the Mosaic attention kernels (PYTHONPATH picks the tree), on bench_attention's own cases and
functions: per round, ms of the Mosaic forward and forward + backward and cuDNN's beside them (causal T=4096 B=8
and T=8192 B=4, sliding window 1024 at T=8192), the packed case (T=8192, B=4, 4 documents a row), and the SM clock
after each timed loop; two rounds, the second in reverse order. Each Mosaic case's outputs (forward, then dq, dk,
dv) are hashed, so trees that should agree bitwise can be compared. With `check`, first each gradient's largest
error against the float32 reference at T=1024, B=2 (causal, packed, window). `python mask_ab.py TAG [check]`."""
import hashlib
import sys

from mjax.xla_flags import apply_defaults

apply_defaults()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.attention_cases import inputs  # noqa: E402
from benchmarks.bench_attention import attention_fns, packed_segments  # noqa: E402
from benchmarks.harness import sm_clock_mhz, time_fn  # noqa: E402
from mjax.kernels.attention.mosaic import MosaicBlocks  # noqa: E402
from mjax.kernels.attention.reference import reference_attention  # noqa: E402

tag, heads, window = sys.argv[1], (32, 8, 128), 1024
fns = {(impl, w): attention_fns(impl, MosaicBlocks() if impl == "mosaic" else None, False, w)
       for impl in ("mosaic", "cudnn") for w in (None, window)}

if sys.argv[2:] == ["check"]:
    t, b = 1024, 2
    q, k, v, do = inputs(t, b, heads)
    for name, seg, w in (("causal", None, None), ("packed", packed_segments(b, t), None), ("window", None, 256)):
        fwd_bwd = attention_fns("mosaic", MosaicBlocks(), False, w)[1]
        got = fwd_bwd(q, k, v, seg, do)
        with jax.default_matmul_precision("float32"):
            f32 = [x.astype(jnp.float32) for x in (q, k, v)]
            _, vjp = jax.vjp(lambda q, k, v: reference_attention(q, k, v, segment_ids=seg, sliding_window=w), *f32)
            want = vjp(do.astype(jnp.float32))
        errors = [float(jnp.max(jnp.abs(g.astype(jnp.float32) - w)) / jnp.max(jnp.abs(w))) for g, w in zip(got, want)]
        print("ERROR", tag, f"T={t} {name}", "dq/dk/dv max err / max |ref|", " ".join(f"{e:.2e}" for e in errors),
              flush=True)

cases = []
for t, b in ((4096, 8), (8192, 4)):
    q, k, v, do = inputs(t, b, heads, seed=t)
    cases += [(f"T={t}", "mosaic", None, (q, k, v, None), do), (f"T={t}", "cudnn", None, (q, k, v, None), do)]
cases += [("T=8192", "mosaic packed", None, (q, k, v, packed_segments(4, 8192)), do),
          ("T=8192", "mosaic window", window, (q, k, v, None), do),
          ("T=8192", "cudnn window", window, (q, k, v, None), do)]
for case, impl, w, args, do in cases:
    if impl.startswith("mosaic"):
        fwd, fwd_bwd = fns[("mosaic", w)]
        digest = hashlib.sha256()
        for x in (fwd(*args), *fwd_bwd(*args, do)):
            digest.update(np.asarray(x.astype(jnp.float32)).tobytes())
        print("HASH", tag, case, impl, digest.hexdigest()[:16], flush=True)
ms = {}
for rnd in range(2):
    for case, impl, w, args, do in cases if rnd == 0 else cases[::-1]:
        fwd, fwd_bwd = fns[(impl.split()[0], w)]
        f = time_fn(fwd, *args, min_s=0.3) * 1e3
        f_clock = sm_clock_mhz()
        fb = time_fn(fwd_bwd, *args, do, min_s=0.3) * 1e3
        ms.setdefault((case, impl), []).append((f, fb, f_clock, sm_clock_mhz()))
for (case, impl), rounds in ms.items():
    print("RESULT", tag, case, impl, " ".join(f"fwd={f:.3f} fb={fb:.3f} MHz={fc}/{fbc}" for f, fb, fc, fbc in rounds),
          flush=True)
for rnd in range(2):
    def r(case, a, b, i):
        return ms[(case, a)][rnd][i] / ms[(case, b)][rnd][i]
    print("RATIO", tag, f"round {rnd}: vs cuDNN fwd/fb T=4096 {r('T=4096', 'cudnn', 'mosaic', 0):.3f}/"
          f"{r('T=4096', 'cudnn', 'mosaic', 1):.3f} T=8192 {r('T=8192', 'cudnn', 'mosaic', 0):.3f}/"
          f"{r('T=8192', 'cudnn', 'mosaic', 1):.3f} window {r('T=8192', 'cudnn window', 'mosaic window', 0):.3f}/"
          f"{r('T=8192', 'cudnn window', 'mosaic window', 1):.3f}; packed of unpacked "
          f"{r('T=8192', 'mosaic packed', 'mosaic', 0):.3f}/{r('T=8192', 'mosaic packed', 'mosaic', 1):.3f}",
          flush=True)
