"""What the grouped matmul's per-call work lists cost. Each f+b is compiled twice: once as shipped (row_tiles and
wgrad_bounds computed by XLA ops from the group sizes in the call), and once with those lists baked in as constants
(the same values, no XLA op before the kernels). Timed alternately (A B B A), outputs compared bitwise. On the GPU,
from the repository root: PYTHONPATH=. python docs/ab/prep_ab.py"""
from mjax.xla_flags import apply_defaults
apply_defaults()
import jax, jax.numpy as jnp, numpy as np
from benchmarks.grouped_cases import fwd_and_bwd, group_sizes, operands
from benchmarks.harness import time_fn
from mjax.kernels.grouped_matmul import grouped_matmul, mosaic, mosaic_specialized

ORIG = {m: (m.row_tiles, m.wgrad_bounds) for m in (mosaic, mosaic_specialized)}
CONST = {"on": False, "gs": None}


def patched(m):
    rt, wb = ORIG[m]
    def const(f, *args):
        with jax.ensure_compile_time_eval():
            return jnp.asarray(np.asarray(f(jnp.asarray(CONST["gs"]), *args)))
    def row_tiles(gs, rows, bm, align=None):
        return const(rt, rows, bm, align) if CONST["on"] else rt(gs, rows, bm, align)
    def wgrad_bounds(gs, rows, bk):
        return const(wb, rows, bk) if CONST["on"] else wb(gs, rows, bk)
    m.row_tiles, m.wgrad_bounds = row_tiles, wgrad_bounds


for m in ORIG:
    patched(m)

fn = lambda x, w, gs: grouped_matmul(x, w, gs, impl="mosaic")
for g, r, n, k in ((8, 4096, 768, 2048), (16, 2048, 768, 2048), (128, 512, 768, 2048)):
    x, w, dy = operands(g, r, n, k, jnp.bfloat16)
    for dist in ("balanced", "dirichlet"):
        gs_np = group_sizes(dist, g, r)
        gs = jnp.asarray(gs_np)
        compiled = {}
        for mode in ("xla", "const"):
            jax.clear_caches()
            CONST.update(on=mode == "const", gs=gs_np)
            f, both = fwd_and_bwd(fn)
            compiled[mode] = (f.lower(x, w, gs).compile(), both.lower(x, w, gs, dy).compile())
        CONST["on"] = False
        outs = {mode: compiled[mode][1](x, w, gs, dy) for mode in compiled}
        same = all(bool(jnp.array_equal(a, b)) for a, b in zip(outs["xla"], outs["const"]))
        t = {("xla", 0): [], ("xla", 1): [], ("const", 0): [], ("const", 1): []}
        for mode in ("xla", "const", "const", "xla"):
            for i, args in ((0, (x, w, gs)), (1, (x, w, gs, dy))):
                t[(mode, i)].append(time_fn(compiled[mode][i], *args, min_s=0.1, max_iters=2000))
        med = {key: float(np.median(v)) * 1e6 for key, v in t.items()}
        print(f"RESULT ({g},{r},{n},{k}) {dist:9s} fwd xla {med[('xla', 0)]:7.1f} us const {med[('const', 0)]:7.1f} "
              f"diff {med[('xla', 0)] - med[('const', 0)]:5.1f} | f+b xla {med[('xla', 1)]:7.1f} const "
              f"{med[('const', 1)]:7.1f} diff {med[('xla', 1)] - med[('const', 1)]:5.1f} us | equal {same}", flush=True)
        hlo = compiled["xla"][1].as_text()
        print(f"HLO ({g},{r}) {dist}: fusions in the f+b entry: "
              f"{sum(1 for l in hlo.splitlines() if ' fusion(' in l and 'ENTRY' not in l)}, "
              f"custom calls {hlo.count('custom-call(')}", flush=True)
