"""Grouped matmul (the MoE expert GEMM) on the GPU: the Pallas kernels against lax.ragged_dot and against a dense
GEMM of equal FLOPs ([G * rows, K] . [K, N] with jnp.dot: the ceiling), measured in the same run, forward and
forward + backward, for balanced, skewed (one group holds half the rows) and empty-group (first, every fourth and
last group empty) distributions of the rows. One table (TFLOP/s and fraction of the dense GEMM) and JSON.

    python -m benchmarks.bench_grouped_matmul --check --json_out=gmm.json
    python -m benchmarks.bench_grouped_matmul --nomain --tilings=128x128x64w4s4,128x256x64w8s3

--passes=N times the dense GEMM and the main table N times over, case after case; a row reports the median of its
passes' times and the median of its ratios to the dense GEMM, each taken within a pass (timings drift over a long
run: one kernel timed twice in one process differed by 13.5%); the target checks use --passes=3.
A Mosaic row ends with the waves of its forward and dgrad kernels ("waves forward 7 (6.07)": the busiest SM's
multiplying (row-window visit, column tile) items under the kernel's own deal, and their mean over the SMs; `waves`
in the JSON): the call's time in item times, since those items cost about the same (grouped_cases.row_kernel_waves).
--tilings times each kernel (forward, dgrad, wgrad) alone with every tile given and prints the best per shape;
--check compares the Pallas results (y, dx, dw) with lax.ragged_dot's and with per-group jnp.dot on this device,
plus a distribution with padding rows (which must come out zero); --smoke runs tiny shapes interpreted (off GPU).
Shapes are GROUPSxROWSxNxK: rows per group on average, x [G * rows, K], w [G, K, N].

--fp8 adds per-tensor FP8 (--fp8_recipe, --fp8_format): the FP8 grouped matmul as training calls it (amaxes,
casts into both layouts and the three kernels; "pallas fp8"), its kernels alone on operands quantized beforehand
("fp8 kernels"; --fp8_mma=f16 converts e4m3 x e4m3 tiles to float16 too, to weigh the FP8 MMA against the 16-bit
one), and the dense FP8 ceiling (e4m3 operands straight into dot_general: cuBLASLt; forward + backward through
mjax.kernels.quant.fp8.fp8_matmul); --tilings then sweeps the FP8 kernels and --check compares "pallas fp8" with the
float32 dequantize + ragged_dot reference of the same quantization:

    python -m benchmarks.bench_grouped_matmul --fp8 --noragged_dot --check --json_out=gmm_fp8.json

--fp8_blockwise adds blockwise FP8 (--fp8_recipe=blockwise; 1x128 activation and 128x128 weight block scales in the
K loop, --fp8_format for the gradients' format): the op as training calls it ("pallas fp8 blockwise"), its kernels
alone on operands quantized beforehand ("blockwise kernels") and the dense blockwise GEMM of the linear layers
("dense fp8 blockwise"); --check then also compares the op with its float32 dequantize + ragged_dot reference, and
--tilings (without --fp8) sweeps its kernels. With --fp8 too, one table holds bf16, per-tensor and blockwise:

    python -m benchmarks.bench_grouped_matmul --fp8 --fp8_blockwise --fp8_format=e4m3 --noragged_dot --check \
        --json_out=gmm_fp8_blockwise.json
"""

import functools
import json

from absl import flags

from benchmarks.cli import BadInput, run_main

from mjax.xla_flags import apply_defaults

apply_defaults()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import fp8_blockwise_grouped_cases as bw_cases  # noqa: E402
from benchmarks import fp8_grouped_cases as fp8_cases  # noqa: E402
from benchmarks.grouped_cases import (check_against, fwd_and_bwd, group_sizes, median_rows,  # noqa: E402
                                      mosaic_row_waves, operands, per_group_dot, tflops)
from mjax.kernels.quant import fp8  # noqa: E402
from mjax.kernels.grouped_matmul import (KernelTile, Tiling, fp8_grouped_matmul, grouped_matmul,  # noqa: E402
                                         resolve_tiling, why_unsupported)
from mjax.kernels.grouped_matmul import mosaic  # noqa: E402
from mjax.kernels.grouped_matmul import pallas as kernels  # noqa: E402
from mjax.kernels.grouped_matmul.tiling import (default_blockwise_tiling, default_mosaic_tiling,  # noqa: E402
                                                kernel_tile_problem)
from benchmarks.harness import time_fn  # noqa: E402

SHAPES = "8x4096x768x2048,16x2048x768x2048,128x512x768x2048,8x4096x14336x4096"
flags.DEFINE_string("shapes", SHAPES, "GROUPSxROWSxNxK, comma-separated.")
flags.DEFINE_list("dists", ["balanced", "skewed", "empty"], "Row distributions over the groups: balanced, skewed, "
                  "empty, dirichlet (proportions ~ Dirichlet(0.3)), padded (balanced over 7/8 of the rows, the rest "
                  "padding).")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"], "Input dtype.")
flags.DEFINE_bool("main", True, "Time pallas, ragged_dot and the dense GEMM, forward and forward + backward.")
flags.DEFINE_bool("mosaic", True, "Include the Mosaic GPU kernels in the main table and --check (on a GPU).")
flags.DEFINE_enum("sweep_impl", "pallas", ["pallas", "mosaic"], "The 16-bit kernels --tilings sweeps (Triton or "
                  "Mosaic GPU).")
flags.DEFINE_bool("ragged_dot", True, "Include lax.ragged_dot in the main table (a dense expansion on the GPU).")
flags.DEFINE_string("tilings", "", "Comma-separated KernelTiles (BMxBNxBKwWARPSsSTAGES[gGROUP]) to time each kernel "
                    "with; prints the best per shape.")
flags.DEFINE_bool("check", False, "Compare pallas with ragged_dot and per-group jnp.dot (max abs error / max |ref|).")
flags.DEFINE_float("min_time_s", 0.25, "Timed seconds per case (after compile and one warm-up call).")
flags.DEFINE_integer("passes", 1, "Times the dense GEMM and the main table this many times over, one case after "
                     "another; rows report the medians of their passes (FP8 kernel rows and the sweep: one pass).",
                     lower_bound=1)
flags.DEFINE_string("json_out", "", "Write every row as JSON here (rewritten after each shape).")
flags.DEFINE_bool("smoke", False, "Tiny shapes, kernels interpreted: checks the script off GPU.")
flags.DEFINE_bool("fp8", False, "Add the per-tensor FP8 grouped matmul, its kernels alone and the dense FP8 GEMM; "
                  "--tilings and --check then take the FP8 kernels.")
flags.DEFINE_enum("fp8_recipe", "tensorwise", ["tensorwise", "delayed"], "With --fp8: the scaling recipe.")
flags.DEFINE_enum("fp8_format", "hybrid", ["hybrid", "e4m3"], "With --fp8: hybrid (e5m2 gradients) or e4m3.")
flags.DEFINE_bool("fp8_blockwise", False, "Add the blockwise FP8 grouped matmul (1x128 / 128x128 block scales), its "
                  "kernels alone and the dense blockwise GEMM; --check also takes it, --tilings without --fp8 sweeps "
                  "its kernels.")
flags.DEFINE_enum("fp8_mma", "auto", ["auto", "f16"], "With --fp8, the kernels-alone rows and the sweep: auto "
                  "(FP8 tiles into the dot where the formats match) or f16 (tiles converted to float16 always).")
FLAGS = flags.FLAGS


def fp8_spec():
    on_gpu = jax.default_backend() == "gpu"
    return fp8.Fp8Spec(FLAGS.fp8_recipe, FLAGS.fp8_format, impl="pallas" if on_gpu else "xla", interpret=not on_gpu)


def time_or_error(fn, *args):
    try:
        return time_fn(fn, *args, min_s=FLAGS.min_time_s), None
    except Exception as e:  # noqa: BLE001  (one failing case, e.g. out of memory, must not end the table)
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def main_impls(shape, x, w, dy):
    """(name, fn(x, w, group_sizes)) of the main table's grouped matmuls at this shape (x, w, dy: the FP8 call's
    scales start from their amaxes)."""
    impls = [("pallas", lambda x, w, gs: grouped_matmul(x, w, gs, impl="pallas"))]
    if use_mosaic():
        impls.append(("mosaic", lambda x, w, gs: grouped_matmul(x, w, gs, impl="mosaic")))
    if FLAGS.ragged_dot:
        impls.append(("ragged_dot", lambda x, w, gs: grouped_matmul(x, w, gs, impl="xla")))
    if FLAGS.fp8:
        spec = fp8_spec()
        impls.append((f"pallas fp8 {FLAGS.fp8_recipe}", fp8_cases.training_call(fp8_cases.meta(w, x, dy, spec), spec)))
    if FLAGS.fp8_blockwise and blockwise_runs(shape):
        impls.append(("pallas fp8 blockwise", bw_cases.training_call(FLAGS.fp8_format)))
    return impls


def main_table(shape, dists, with_impls: bool):
    """The dense GEMM's row (the ceiling), then with_impls the main table's rows: each case's forward and forward +
    backward timed once per pass, FLAGS.passes passes over all cases in turn (timings drift over a long run: one
    kernel timed twice in one process differed by 13.5%), summarised by grouped_cases.median_rows."""
    g, r, n, k = shape
    x, w, dy = operands(g, r, n, k, jnp.dtype(FLAGS.dtype))
    w0 = w[0]  # [K, N], its own operand: a gradient into w[0] of [G, K, N] would add a memset of all of w
    dense_fwd, dense_both = fwd_and_bwd(lambda x, w0, gs: jnp.dot(x, w0))
    cases = [("dense jnp.dot (ceiling)", "-", 2 * g * r * k * n, (dense_fwd, x, w0, None),
              (dense_both, x, w0, None, dy))]
    # one compile per implementation: the group sizes are run-time values
    for name, fn in main_impls(shape, x, w, dy) if with_impls else []:
        fwd, both = fwd_and_bwd(fn)
        for dist in dists:
            sizes = group_sizes(dist, g, r)
            gs = jnp.asarray(sizes)
            cases.append((name, dist, 2 * int(sizes.sum()) * k * n, (fwd, x, w, gs), (both, x, w, gs, dy)))
    passes = []
    for _ in range(FLAGS.passes):
        times = []
        for c, (*_, fwd, both) in enumerate(cases):
            times.append((time_or_error(*fwd), time_or_error(*both)))
            dense_error = c == 0 and (times[0][0][1] or times[0][1][1])
            if dense_error:  # every ratio needs it
                raise RuntimeError(f"the dense GEMM at {'x'.join(map(str, shape))} failed: {dense_error}")
        passes.append(times)
    rows = median_rows(shape, [case[:3] for case in cases], passes)
    for row in rows:
        waves = (mosaic_row_waves(shape, group_sizes(row["dist"], g, r), jax.devices()[0].core_count)
                 if row["impl"] == "mosaic" and not row["error"] else None)
        if waves:
            row["waves"] = waves
        print_row(row)
    return rows


def use_mosaic() -> bool:
    return FLAGS.mosaic and jax.default_backend() == "gpu"


@functools.cache
def blockwise_runs(shape) -> bool:
    """Whether the blockwise cases can take this shape (K and N multiples of 128); prints why not, once."""
    problem = bw_cases.shape_problem(shape[3], shape[2])
    if problem:
        print(f"{'x'.join(map(str, shape)):22} blockwise rows skipped: {problem}", flush=True)
    return problem is None


def fp8_kernel_rows(shape, dists, dense):
    """The FP8 kernels alone on operands quantized beforehand: the forward, and forward + dgrad + wgrad."""
    g, r, n, k = shape
    dtype = jnp.dtype(FLAGS.dtype)
    x, w, dy = operands(g, r, n, k, dtype)
    q = fp8_cases.operands(x, w, dy, fp8_spec())
    tiling = resolve_tiling(None, dtype, k, n, fp8_spec().dtypes[1])
    calls = lambda q, gs: fp8_cases.kernel_calls(q, gs, tiling, dtype, FLAGS.fp8_mma)  # noqa: E731
    return kernel_rows(shape, dists, dense, f"fp8 kernels mma={FLAGS.fp8_mma}", q, calls)


def blockwise_kernel_rows(shape, dists, dense):
    """The blockwise FP8 kernels alone on operands quantized beforehand."""
    g, r, n, k = shape
    dtype = jnp.dtype(FLAGS.dtype)
    x, w, dy = operands(g, r, n, k, dtype)
    q = bw_cases.operands(x, w, dy, FLAGS.fp8_format)
    tiling = default_blockwise_tiling(k, n)
    calls = lambda q, gs: bw_cases.kernel_calls(q, gs, tiling, dtype, FLAGS.fp8_mma)  # noqa: E731
    return kernel_rows(shape, dists, dense, f"blockwise kernels mma={FLAGS.fp8_mma}", q, calls)


def kernel_rows(shape, dists, dense, name, q, calls):
    """Rows of kernels alone, calls(q, gs) -> {kernel: thunk}: the forward, and forward + dgrad + wgrad."""
    g, r, n, k = shape
    fwd = jax.jit(lambda q, gs: calls(q, gs)["forward"]())
    both = jax.jit(lambda q, gs: tuple(call() for call in calls(q, gs).values()))
    rows = []
    for dist in dists:
        sizes = group_sizes(dist, g, r)
        gs = jnp.asarray(sizes)
        flop = 2 * int(sizes.sum()) * k * n
        (t_fwd, err_fwd), (t_both, err_both) = time_or_error(fwd, q, gs), time_or_error(both, q, gs)
        row = {"shape": list(shape), "dist": dist, "impl": name, "error": err_fwd or err_both}
        for mode, t, mult in (("fwd", t_fwd, 1), ("fwd_bwd", t_both, 3)):
            if t is not None:
                row.update({f"{mode}_ms": t * 1e3, f"{mode}_tflops": tflops(mult * flop, t)})
                row[f"{mode}_of_dense"] = row[f"{mode}_tflops"] / dense[f"{mode}_tflops"]
        rows.append(row)
        print_row(row)
    return rows


def dense_fp8_row(shape, dense):
    """The dense FP8 GEMM of equal FLOPs: e4m3 operands straight into dot_general (cuBLASLt), forward; forward +
    backward through the dense FP8 linear layer (fp8_matmul: its casts and three GEMMs)."""
    g, r, n, k = shape
    dtype = jnp.dtype(FLAGS.dtype)
    x, w, dy = operands(g, r, n, k, dtype)
    e4m3 = fp8_spec().dtypes[0]
    xq, wq_t = fp8.quantize(x, 1.0, e4m3), fp8.quantize(w[0].T, 1.0, e4m3)  # [M, K], [N, K]
    fwd = jax.jit(lambda a, b: fp8.scaled_dot(a, b, (1, 1), jnp.float32(1.0), dtype))
    _, both = fwd_and_bwd(lambda x, w0, gs: fp8.fp8_matmul(x, w0, jnp.ones(3), fp8_spec()))
    flop = 2 * g * r * k * n
    t_fwd, t_both = time_fn(fwd, xq, wq_t, min_s=FLAGS.min_time_s), time_fn(both, x, w[0], None, dy,
                                                                            min_s=FLAGS.min_time_s)
    row = {"shape": list(shape), "dist": "-", "impl": "dense fp8 (ceiling)", "error": None,
           "fwd_ms": t_fwd * 1e3, "fwd_tflops": tflops(flop, t_fwd), "fwd_bwd_ms": t_both * 1e3,
           "fwd_bwd_tflops": tflops(3 * flop, t_both)}
    for mode in ("fwd", "fwd_bwd"):
        row[f"{mode}_of_dense"] = row[f"{mode}_tflops"] / dense[f"{mode}_tflops"]
    print_row(row)
    return row


def dense_blockwise_row(shape, dense):
    """The dense blockwise FP8 GEMM of equal FLOPs (the linear layers' block_gemm; Pallas): forward on operands
    quantized once, forward + backward through blockwise_matmul (its quantizations and three GEMMs)."""
    g, r, n, k = shape
    dtype = jnp.dtype(FLAGS.dtype)
    x, w, dy = operands(g, r, n, k, dtype)
    (fwd, fwd_args), (both, both_args) = bw_cases.dense_calls(x, w[0], dy, FLAGS.fp8_format)
    flop = 2 * g * r * k * n
    (t_fwd, err_fwd), (t_both, err_both) = time_or_error(fwd, *fwd_args), time_or_error(both, *both_args)
    row = {"shape": list(shape), "dist": "-", "impl": "dense fp8 blockwise", "error": err_fwd or err_both}
    for mode, t, mult in (("fwd", t_fwd, 1), ("fwd_bwd", t_both, 3)):
        if t is not None:
            row.update({f"{mode}_ms": t * 1e3, f"{mode}_tflops": tflops(mult * flop, t)})
            row[f"{mode}_of_dense"] = row[f"{mode}_tflops"] / dense[f"{mode}_tflops"]
    print_row(row)
    return row


HEADER = (f"{'shape GxRxNxK':22} {'dist':9} {'impl':24} {'fwd ms':>8} {'TFLOP/s':>8} {'of dense':>8} "
          f"{'f+b ms':>8} {'TFLOP/s':>8} {'of dense':>8}")


def print_row(row):
    shape = "x".join(map(str, row["shape"]))
    cells = []
    for mode in ("fwd", "fwd_bwd"):
        if f"{mode}_ms" in row:
            cells.append(f"{row[f'{mode}_ms']:8.3f} {row[f'{mode}_tflops']:8.1f} {row[f'{mode}_of_dense']:8.3f}")
        else:
            cells.append(f"{'-':>8} {'-':>8} {'-':>8}")
    tail = f"  {row['error']}" if row.get("error") else ""
    if "waves" in row:
        tail += "  waves " + ", ".join(f"{kernel} {w['waves']} ({w['fill']:.2f})" for kernel, w in row["waves"].items())
    print(f"{shape:22} {row['dist']:9} {row['impl']:24} {cells[0]} {cells[1]}{tail}", flush=True)


def sweep_rows(shape, dists, tiles, dense):
    """Each kernel alone with each tile; the best tile per kernel over the distributions (mean TFLOP/s)."""
    g, r, n, k = shape
    dtype = jnp.dtype(FLAGS.dtype)
    x, w, dy = operands(g, r, n, k, dtype)
    module, option = ((mosaic, {"num_sms": jax.devices()[0].core_count}) if FLAGS.sweep_impl == "mosaic" else
                      (kernels, {"interpret": jax.default_backend() != "gpu"}))
    operand_pairs = {"forward": (x, w), "dgrad": (dy, w), "wgrad": (x, dy)}
    calls = {kernel: (lambda t, kernel=kernel: (
        jax.jit(lambda a, b, gs: getattr(module, kernel)(a, b, gs, tile=t, **option)), operand_pairs[kernel]))
        for kernel in operand_pairs}
    if FLAGS.fp8:  # the FP8 kernels on operands quantized once
        q = fp8_cases.operands(x, w, dy, fp8_spec())
        def fp8_call(kernel, tile):
            tiling = Tiling.uniform(tile)
            return jax.jit(lambda q, gs: fp8_cases.kernel_calls(q, gs, tiling, dtype, FLAGS.fp8_mma)[kernel]()), (q,)

        calls = {kernel: functools.partial(fp8_call, kernel) for kernel in ("forward", "dgrad", "wgrad")}
    elif FLAGS.fp8_blockwise:  # the blockwise kernels on operands quantized once
        if not blockwise_runs(shape):
            return [], {}
        q = bw_cases.operands(x, w, dy, FLAGS.fp8_format)

        def blockwise_call(kernel, tile):
            tiling = Tiling.uniform(tile)
            return jax.jit(lambda q, gs: bw_cases.kernel_calls(q, gs, tiling, dtype, FLAGS.fp8_mma)[kernel]()), (q,)

        calls = {kernel: functools.partial(blockwise_call, kernel) for kernel in ("forward", "dgrad", "wgrad")}
    rows, best = [], {}
    for kernel, make in calls.items():
        scores = {}
        for tile in tiles:
            problem = (mosaic.mosaic_tile_problem(kernel, tile, k, n) if FLAGS.sweep_impl == "mosaic" else
                       fp8_cases.tile_problem(kernel, tile, k, n) if FLAGS.fp8 else
                       bw_cases.tile_problem(kernel, tile, k, n) if FLAGS.fp8_blockwise else
                       kernel_tile_problem(kernel, tile, dtype, k, n))
            if problem:
                print(f"  {kernel:8} {str(tile):18} skipped: {problem}", flush=True)
                continue
            fn, args = make(tile)
            for dist in dists:
                sizes = group_sizes(dist, g, r)
                t, err = time_or_error(fn, *args, jnp.asarray(sizes))
                row = {"shape": list(shape), "dist": dist, "kernel": kernel, "tile": str(tile), "error": err}
                if t is not None:
                    row.update(ms=t * 1e3, tflops=tflops(2 * int(sizes.sum()) * k * n, t))
                    row["of_dense"] = row["tflops"] / dense["fwd_tflops"]
                    scores.setdefault(str(tile), []).append(row["tflops"])
                rows.append(row)
                print(f"  {kernel:8} {str(tile):18} {dist:9} " + (f"{row['ms']:8.3f} ms {row['tflops']:7.1f} "
                      f"TFLOP/s {row['of_dense']:6.3f} of dense" if t is not None else err), flush=True)
        full = {tile: np.mean(v) for tile, v in scores.items() if len(v) == len(dists)}
        if full:
            best[kernel] = max(full, key=full.get)
            print(f"  best {kernel} for {'x'.join(map(str, shape))}: {best[kernel]} ({full[best[kernel]]:.1f} "
                  f"TFLOP/s mean over {', '.join(dists)})", flush=True)
    if len(best) == 3:
        print(f"best tiling for {'x'.join(map(str, shape))}: Tiling(forward=KernelTile.parse('{best['forward']}'), "
              f"dgrad=KernelTile.parse('{best['dgrad']}'), wgrad=KernelTile.parse('{best['wgrad']}'))", flush=True)
    return rows, best


def check_rows(shape, dists):
    g, r, n, k = shape
    dtype = jnp.dtype(FLAGS.dtype)
    x, w, dy = operands(g, r, n, k, dtype, seed=1)
    if FLAGS.fp8:  # against the float32 dequantize + ragged_dot of the same quantized values
        meta = fp8_cases.meta(w, x, dy, fp8_spec())
        _, pallas_both = fwd_and_bwd(fp8_cases.training_call(meta, fp8_spec()))
        _, ragged_both = fwd_and_bwd(lambda x, w, gs: fp8_grouped_matmul(x, w, gs, meta, fp8_spec(), impl="xla"))
    else:
        _, pallas_both = fwd_and_bwd(lambda x, w, gs: grouped_matmul(x, w, gs, impl="pallas"))
        _, ragged_both = fwd_and_bwd(lambda x, w, gs: grouped_matmul(x, w, gs, impl="xla"))
    skip_pallas = None if FLAGS.fp8 else why_unsupported("pallas", backend=jax.default_backend(), dtype=dtype, k=k,
                                                         n=n, m=g * r, groups=g)
    if skip_pallas:  # e.g. an operand past Triton's 32-bit offsets: the other kernels are still checked
        print(f"check {'x'.join(map(str, shape)):22} pallas not checked: {skip_pallas}", flush=True)
    if use_mosaic() and not FLAGS.fp8:
        _, mosaic_both = fwd_and_bwd(lambda x, w, gs: grouped_matmul(x, w, gs, impl="mosaic"))
    blockwise = FLAGS.fp8_blockwise and blockwise_runs(shape)
    if blockwise:  # against the float32 dequantize + ragged_dot of the same block-quantized values
        _, blockwise_pallas = fwd_and_bwd(bw_cases.training_call(FLAGS.fp8_format))
        _, blockwise_ref = fwd_and_bwd(bw_cases.training_call(FLAGS.fp8_format, impl="xla"))
    rows = []
    for dist in dict.fromkeys([*dists, "padded"]):
        sizes = group_sizes(dist, g, r)
        gs = jnp.asarray(sizes)
        refs = {}
        if FLAGS.fp8:
            refs["fp8 reference (xla)"] = ragged_both
        else:
            refs["per-group jnp.dot"] = fwd_and_bwd(lambda x, w, gs, sizes=sizes: per_group_dot(x, w, sizes))[1]
            if FLAGS.ragged_dot:
                refs["ragged_dot"] = ragged_both
        checks = [] if skip_pallas else [([np.asarray(a, np.float32) for a in pallas_both(x, w, gs, dy)], refs)]
        if use_mosaic() and not FLAGS.fp8:
            checks.append(([np.asarray(a, np.float32) for a in mosaic_both(x, w, gs, dy)],
                           {f"{name} (mosaic)": ref for name, ref in refs.items()}))
        if blockwise:
            checks.append(([np.asarray(a, np.float32) for a in blockwise_pallas(x, w, gs, dy)],
                           {"blockwise reference (xla)": blockwise_ref}))
        for got, refs in checks:
            rows += check_against(shape, dist, sizes, got, refs, (x, w, gs, dy), FLAGS.dtype)
    return rows


def parse_shapes(text):
    shapes = [tuple(int(v) for v in s.split("x")) for s in text.split(",") if s]
    if not shapes or any(len(s) != 4 for s in shapes):
        raise BadInput(f"--shapes={text!r}: expected GROUPSxROWSxNxK[,...]")
    return shapes


def main():
    shapes = [(4, 40, 64, 32), (3, 24, 32, 64)] if FLAGS.smoke else parse_shapes(FLAGS.shapes)
    for dist in FLAGS.dists:
        group_sizes(dist, 8, 16)  # unknown names fail before anything is compiled
    tiles = [KernelTile.parse(t) for t in FLAGS.tilings.split(",") if t]
    if tiles and FLAGS.fp8 and FLAGS.fp8_blockwise:
        raise BadInput("--tilings sweeps one family of kernels: drop --fp8 (to sweep the blockwise kernels) or "
                       "--fp8_blockwise")
    if FLAGS.smoke:
        tiles = tiles or ([KernelTile(16, 32, 32)] if FLAGS.fp8 else [KernelTile(16, 16, 16), KernelTile(32, 32, 16)])
    dtype = jnp.dtype(FLAGS.dtype)
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "dtype": FLAGS.dtype,
              "main": [], "sweep": [], "best_tiles": {}, "check": [], "default_tiling": {}, "group_sizes": {}}
    print(f"{report['device']}, jax {jax.__version__}, {FLAGS.dtype}; TFLOP/s count 2*sum(group_sizes)*K*N per "
          "GEMM (forward + backward: 3 GEMMs); 'of dense' divides by the dense GEMM's rate in this run"
          + (f"; FP8: {FLAGS.fp8_recipe} {FLAGS.fp8_format}" if FLAGS.fp8 else "")
          + (f"; FP8 blockwise: {FLAGS.fp8_format}" if FLAGS.fp8_blockwise else ""), flush=True)
    failed = False
    for shape in shapes:
        g, r, n, k = shape
        tiling = resolve_tiling(None, dtype, k, n, fp8_spec().dtypes[1] if FLAGS.fp8 else None)
        report["default_tiling"]["x".join(map(str, shape))] = str(tiling)
        report["group_sizes"]["x".join(map(str, shape))] = {d: group_sizes(d, g, r).tolist()
                                                             for d in dict.fromkeys([*FLAGS.dists, "padded"])}
        blockwise_tiles = (f"; blockwise default {default_blockwise_tiling(k, n)}" if FLAGS.fp8_blockwise
                           else "")
        mosaic_tiles = f"; mosaic default {default_mosaic_tiling(k, n)}" if use_mosaic() else ""
        print(f"\n{'x'.join(map(str, shape))}: default {tiling}{mosaic_tiles}{blockwise_tiles}\n{HEADER}", flush=True)
        table = main_table(shape, FLAGS.dists, FLAGS.main)
        dense = table[0]
        report["main"].append(dense)
        if FLAGS.fp8:
            report["main"].append(dense_fp8_row(shape, dense))
        if FLAGS.fp8_blockwise and FLAGS.main and blockwise_runs(shape):
            report["main"].append(dense_blockwise_row(shape, dense))
        report["main"] += table[1:]
        if FLAGS.main and FLAGS.fp8:
            report["main"] += fp8_kernel_rows(shape, FLAGS.dists, dense)
        if FLAGS.main and FLAGS.fp8_blockwise and blockwise_runs(shape):
            report["main"] += blockwise_kernel_rows(shape, FLAGS.dists, dense)
        if tiles:
            rows, best = sweep_rows(shape, FLAGS.dists, tiles, dense)
            report["sweep"] += rows
            report["best_tiles"]["x".join(map(str, shape))] = best
        if FLAGS.check:
            rows = check_rows(shape, FLAGS.dists)
            report["check"] += rows
            failed |= any(not row.get("ok", False) for row in rows if "error" not in row)
        if FLAGS.json_out:
            with open(FLAGS.json_out, "w") as f:
                json.dump(report, f, indent=1)
    if FLAGS.check:
        print("\ncheck: " + ("FAILED" if failed else "all PASS"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    run_main(main)
