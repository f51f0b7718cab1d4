"""Why the main table's uneven mosaic timings are slower than the kernels timed alone: same process, table path
(grouped_matmul) vs kernels alone (mosaic.forward/dgrad/wgrad), 50 vs 2000 iterations, right after f+b, clocks."""
import subprocess
from mjax.xla_flags import apply_defaults
apply_defaults()
import jax, jax.numpy as jnp
from benchmarks.grouped_cases import fwd_and_bwd, group_sizes, operands
from benchmarks.harness import time_fn
from mjax.kernels.grouped_matmul import grouped_matmul, mosaic
from mjax.kernels.grouped_matmul.tiling import default_mosaic_tiling

sms = jax.devices()[0].core_count
us = lambda f, *a, it=50: time_fn(f, *a, min_s=0.1, max_iters=it) * 1e6
clock = lambda: subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader"],
                               capture_output=True, text=True).stdout.strip()
for g, r, dists in ((128, 512, ("balanced", "skewed", "dirichlet")), (16, 2048, ("balanced", "skewed"))):
    n, k = 768, 2048
    x, w, dy = operands(g, r, n, k, jnp.bfloat16)
    t = default_mosaic_tiling(k, n)
    table, both = fwd_and_bwd(lambda x, w, gs: grouped_matmul(x, w, gs, impl="mosaic"))
    fwd = jax.jit(lambda a, b, gs: mosaic.forward(a, b, gs, tile=t.forward, num_sms=sms))
    dgr = jax.jit(lambda a, b, gs: mosaic.dgrad(a, b, gs, tile=t.dgrad, num_sms=sms))
    wgr = jax.jit(lambda a, b, gs: mosaic.wgrad(a, b, gs, tile=t.wgrad, num_sms=sms))
    dense = jax.jit(lambda a, b: a @ b)
    wd = w[0]
    for rnd in range(2):
        for dist in dists:
            gs = jnp.asarray(group_sizes(dist, g, r))
            t50, a50, t2k = us(table, x, w, gs), us(fwd, x, w, gs), us(table, x, w, gs, it=2000)
            fb = us(both, x, w, gs, dy)
            after = us(table, x, w, gs)
            dg, wg, dn = us(dgr, dy, w, gs), us(wgr, x, dy, gs), us(dense, x, wd)
            print(f"R{rnd} {g:3d} {dist:9s} table {t50:6.1f} alone {a50:6.1f} table/2000 {t2k:6.1f} | f+b {fb:7.1f} "
                  f"sum-alone {a50 + dg + wg:7.1f} (dgrad {dg:6.1f} wgrad {wg:6.1f}) | fwd after f+b {after:6.1f} | "
                  f"dense {dn:6.1f} us [{clock()}]", flush=True)
