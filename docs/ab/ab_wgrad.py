"""wgrad-only A/B of the Mosaic grouped matmul (PYTHONPATH picks the tree): ms and TFLOP/s of mosaic.wgrad per
shape and distribution, and a hash of dw (bitwise equal across trees expected)."""
import hashlib, sys
from mjax.xla_flags import apply_defaults
apply_defaults()
import jax, jax.numpy as jnp, numpy as np
from benchmarks.grouped_cases import group_sizes, operands
from benchmarks.harness import time_fn
from mjax.kernels.grouped_matmul import mosaic
from mjax.kernels.grouped_matmul.tiling import default_mosaic_tiling

tag, sms = sys.argv[1], jax.devices()[0].core_count
shapes = ((16, 2048, 768, 2048), (128, 512, 768, 2048), (60, 512, 1408, 2048), (8, 4096, 768, 2048))
for g, r, n, k in shapes[:int(sys.argv[2]) if len(sys.argv) > 2 else None]:
    x, w, dy = operands(g, r, n, k, jnp.bfloat16)
    tile = default_mosaic_tiling(k, n).wgrad
    wgrad = jax.jit(lambda x, dy, gs: mosaic.wgrad(x, dy, gs, tile=tile, num_sms=sms))
    for dist in ("balanced", "skewed", "empty", "dirichlet"):
        gs = jnp.asarray(group_sizes(dist, g, r))
        flop = 2 * int(gs.sum()) * n * k
        h = hashlib.sha256(np.asarray(wgrad(x, dy, gs).astype(jnp.float32)).tobytes()).hexdigest()[:12]
        t_w = min(time_fn(wgrad, x, dy, gs, min_s=0.1, max_iters=500) for _ in range(3))
        print(f"RESULT {tag} ({g},{r},{n},{k}) {dist:9s} wgrad {t_w*1e3:7.4f} ms {flop/t_w/1e12:4.0f} TF/s out {h}",
              flush=True)
