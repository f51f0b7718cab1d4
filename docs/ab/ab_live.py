"""A/B of the row kernels' deal (PYTHONPATH picks the tree): the Mosaic grouped matmul's forward and forward +
backward, ms and TFLOP/s, per shape and distribution, with the waves that tree's deal gives (the busiest program's
multiplying items, forward / dgrad: grouped_cases.mosaic_row_waves) and a hash of (y, dx, dw), bitwise equal across
trees expected (each tile is computed the same way whichever program takes it)."""
import hashlib, sys
from mjax.xla_flags import apply_defaults
apply_defaults()
import jax, jax.numpy as jnp, numpy as np
from benchmarks.grouped_cases import fwd_and_bwd, group_sizes, mosaic_row_waves, operands
from benchmarks.harness import time_fn
from mjax.kernels.grouped_matmul import grouped_matmul

tag = sys.argv[1]
fn = lambda x, w, gs: grouped_matmul(x, w, gs, impl="mosaic")
for g, r, n, k in ((60, 512, 1408, 2048), (60, 512, 2048, 1408), (8, 4096, 14336, 4096), (8, 4096, 768, 2048),
                   (256, 128, 2048, 7168)):
    x, w, dy = operands(g, r, n, k, jnp.bfloat16)
    fwd, both = fwd_and_bwd(fn)
    for dist in ("balanced", "dirichlet"):
        gs = jnp.asarray(group_sizes(dist, g, r))
        flop = 2 * int(gs.sum()) * n * k
        out = both(x, w, gs, dy)
        h = hashlib.sha256(b"".join(np.asarray(o.astype(jnp.float32)).tobytes() for o in out)).hexdigest()[:12]
        t_f = [time_fn(fwd, x, w, gs, min_s=0.15, max_iters=500) for _ in range(2)]
        t_b = [time_fn(both, x, w, gs, dy, min_s=0.15, max_iters=500) for _ in range(2)]
        t_f, t_b = min(t_f), min(t_b)
        waves = mosaic_row_waves((g, r, n, k), group_sizes(dist, g, r), jax.devices()[0].core_count)
        print(f"RESULT {tag} ({g},{r},{n},{k}) {dist:9s} fwd {t_f*1e3:8.4f} ms {flop/t_f/1e12:5.0f}  "
              f"f+b {t_b*1e3:8.4f} ms {3*flop/t_b/1e12:5.0f} TF/s  waves {waves['forward']['waves']} / "
              f"{waves['dgrad']['waves']}  out {h}", flush=True)
