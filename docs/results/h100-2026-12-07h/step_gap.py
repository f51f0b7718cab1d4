"""Whether back-to-back forward + backward calls leave the GPU idle between them: for each case, the timed loop's
ms per call (bench_attention's time_fn), and a trace of N calls issued without blocking, split into steps: the
mean device span of a step, the kernels' running time in it, and the mean idle gap from one step's last kernel
to the next step's first. PYTHONPATH=. python docs/results/h100-2026-12-07h/step_gap.py [T ...]"""
import sys

from mjax.xla_flags import apply_defaults

apply_defaults()
import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.attention_cases import inputs  # noqa: E402
from benchmarks.bench_attention import attention_fns, packed_segments  # noqa: E402
from benchmarks.harness import time_fn  # noqa: E402
from benchmarks.profile import stream_kernels, trace  # noqa: E402

N = 20
for t in [int(a) for a in sys.argv[1:]] or [8192]:
    b = 32768 // t
    q, k, v, do = inputs(t, b, (32, 8, 128))
    for impl, packed in (("mosaic", False), ("mosaic", True), ("cudnn", False)):
        seg = packed_segments(b, t) if packed else None
        f = attention_fns(impl, None, False)[1].lower(q, k, v, seg, do).compile()
        args = (q, k, v, seg, do)
        ms = [time_fn(f, *args, min_s=0.5, max_iters=200) * 1e3 for _ in range(3)]

        def burst():
            out = None
            for _ in range(N):
                out = f(*args)
            jax.block_until_ready(out)

        burst()
        data, wall = trace(burst, 1)
        ev = stream_kernels(data)
        per = len(ev) // N
        steps = [ev[i * per:(i + 1) * per] for i in range(N)]
        same = all([e[0] for e in s] == [e[0] for e in steps[0]] for s in steps) and len(ev) % N == 0
        span = np.mean([(s[-1][2] - s[0][1]) / 1e6 for s in steps])
        run = np.mean([sum(e[2] - e[1] for e in s) / 1e6 for s in steps])
        gaps = [(steps[i][0][1] - steps[i - 1][-1][2]) / 1e6 for i in range(1, N)]
        total = (ev[-1][2] - ev[0][1]) / 1e6 / N
        print(f"RESULT T={t} {impl}{' packed' if packed else ''}: timed {' '.join(f'{m:.3f}' for m in ms)} ms; "
              f"traced burst {total:.3f} ms/step, step span {span:.3f}, kernels {run:.3f}, gap between steps "
              f"mean {np.mean(gaps):.3f} max {np.max(gaps):.3f} ({per} kernels/step, equal steps {same}, "
              f"host wall {wall * 1e3 / N:.3f} ms/step)", flush=True)
        if not same:
            print("  first step kernels:", [e[0][:40] for e in steps[0]][:60])
