"""Why the 8-group 'empty' and 'dirichlet' rows run slower than balanced: forward and f+b of the Mosaic grouped
matmul at (8, 4096, 768, 2048) over distributions that separate empty groups from unaligned group edges."""
import numpy as np
from mjax.xla_flags import apply_defaults
apply_defaults()
import jax, jax.numpy as jnp
from benchmarks.grouped_cases import fwd_and_bwd, group_sizes, operands
from benchmarks.harness import time_fn
from mjax.kernels.grouped_matmul import grouped_matmul

g, r, n, k = 8, 4096, 768, 2048
x, w, dy = operands(g, r, n, k, jnp.bfloat16)
fn = lambda x, w, gs: grouped_matmul(x, w, gs, impl="mosaic")
fwd, both = fwd_and_bwd(fn)
keep5 = np.array([1, 2, 3, 5, 6])
w5 = w[keep5]
fwd5, both5 = fwd_and_bwd(fn)
dists = {
    "balanced": (group_sizes("balanced", g, r), False),
    "empty": (group_sizes("empty", g, r), False),
    "skewed": (group_sizes("skewed", g, r), False),
    "dirichlet": (group_sizes("dirichlet", g, r), False),
    "g5_same_edges": (group_sizes("empty", g, r)[keep5], True),
    "empty_aligned128": (np.array([0, 6528, 6528, 6656, 0, 6528, 6528, 0]), False),
    "balanced_unaligned": (np.array([4093, 4099] * 4), False),
    "one_empty_aligned": (np.array([0, 4096, 4096, 4096, 4096, 4096, 4096, 8192]), False),
    "dirichlet_aligned128": (np.round(group_sizes("dirichlet", g, r) / 128).astype(int) * 128, False),
}
for rep in range(2):
    for name, (sizes, five) in dists.items():
        sizes = np.asarray(sizes, np.int32)
        if sizes.sum() != g * r:
            sizes[-1] += g * r - sizes.sum()
        gs, ww = jnp.asarray(sizes), (w5 if five else w)
        f, b = (fwd5, both5) if five else (fwd, both)
        tf = time_fn(f, x, ww, gs, min_s=0.3, max_iters=400)
        tb = time_fn(b, x, ww, gs, dy, min_s=0.3, max_iters=400)
        flop = 2 * g * r * n * k
        print(f"rep{rep} {name:22s} fwd {tf*1e3:7.4f} ms {flop/tf/1e12:6.0f} TF/s   f+b {tb*1e3:7.4f} ms "
              f"{3*flop/tb/1e12:6.0f} TF/s  sizes {sizes.tolist()}", flush=True)
dense = jax.jit(lambda a, b: a @ b)
print("dense fwd", f"{2*g*r*n*k/time_fn(dense, x, w[0], min_s=0.3, max_iters=400)/1e12:.0f} TF/s")
