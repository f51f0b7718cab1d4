"""The grouped-matmul benchmark's cases: row distributions over the groups, random operands, the per-group
reference for --check and the comparison against it, jit'ed forward and forward + backward of a grouped matmul,
the TFLOP/s of a timing, the table's rows from several passes of timings, the waves of the Mosaic row kernels and
a model of the Mosaic wgrad's balance under its round-robin deal and under a work queue."""

import heapq

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import pass_ratios
from mjax.kernels.grouped_matmul.mosaic_parts import TMA_ROWS, live_item, live_visits, wgrad_bounds
from mjax.kernels.grouped_matmul.schedule import row_tiles
from mjax.kernels.grouped_matmul.tiling import default_mosaic_tiling


def group_sizes(dist: str, groups: int, rows: int) -> np.ndarray:
    """int32 [G] summing to G * rows (padded: to 7/8 of it)."""
    total = groups * rows

    def spread(count, over):  # `count` rows as evenly as possible over the groups marked in `over`
        sizes = np.zeros(groups, np.int64)
        idx = np.flatnonzero(over)
        sizes[idx] = count // len(idx)
        sizes[idx[: count % len(idx)]] += 1
        return sizes

    if dist == "balanced":
        return np.full(groups, rows, np.int32)
    if dist == "skewed":  # one group with half the rows, the rest split evenly
        sizes = spread(total - total // 2, np.arange(groups) > 0)
        sizes[0] = total // 2
        return sizes.astype(np.int32)
    if dist == "empty":  # the first, every fourth and the last group empty
        full = (np.arange(groups) % 4 != 0) & (np.arange(groups) != groups - 1)
        return spread(total, full if full.any() else np.arange(groups) == 0).astype(np.int32)
    if dist == "dirichlet":  # a learned router's uneven load: proportions ~ Dirichlet(0.3), fixed seed
        rng = np.random.default_rng(0)
        return rng.multinomial(total, rng.dirichlet(np.full(groups, 0.3))).astype(np.int32)
    if dist == "padded":
        return spread(total - total // 8, np.ones(groups, bool)).astype(np.int32)
    raise ValueError(f"--dists: unknown distribution {dist!r} (balanced, skewed, empty, dirichlet, padded)")


def operands(groups, rows, n, k, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    m = groups * rows
    x = jax.random.normal(keys[0], (m, k), dtype)
    w = (jax.random.normal(keys[1], (groups, k, n), jnp.float32) * k**-0.5).astype(dtype)
    dy = jax.random.normal(keys[2], (m, n), dtype)
    return x, w, dy


def fwd_and_bwd(fn):
    """jit'ed forward, and forward + backward returning (y, dx, dw), of fn(x, w, group_sizes)."""
    def both(x, w, gs, dy):
        y, vjp = jax.vjp(lambda x, w: fn(x, w, gs), x, w)
        return (y, *vjp(dy))

    return jax.jit(fn), jax.jit(both)


def per_group_dot(x, w, sizes):
    """The reference for --check with host-known sizes: one f32-accumulated jnp.dot per group, zeros for padding."""
    starts = np.concatenate([[0], np.cumsum(sizes)])
    parts = [jnp.dot(x[s:e], w[g], preferred_element_type=jnp.float32) for g, (s, e) in
             enumerate(zip(starts[:-1], starts[1:])) if e > s]
    parts.append(jnp.zeros((x.shape[0] - starts[-1], w.shape[2]), jnp.float32))
    return jnp.concatenate(parts).astype(x.dtype)


# Max |kernel - reference| / max |reference| allowed by --check: both accumulate in f32 and round once to the
# output dtype, so elements differ by about one ulp of that dtype (bf16: 2^-7 relative); twice that. float32: the
# references may multiply in TF32 (XLA's default precision on the GPU; the kernels use full f32), ~2^-11 per term.
CHECK_TOLERANCE = {"bfloat16": 2.0**-6, "float16": 2.0**-9, "float32": 2.0**-9}


def check_against(shape, dist, sizes, got, refs: dict, args, dtype: str) -> list[dict]:
    """One --check row per reference: got (y, dx, dw as float32 arrays) against each ref(*args) of refs {name: fn},
    max error / max |ref| within CHECK_TOLERANCE[dtype], and the padding rows of y and dx zero; printed too."""
    tol, label, rows = CHECK_TOLERANCE[dtype], f"check {'x'.join(map(str, shape)):22} {dist:9}", []
    for ref_name, ref in refs.items():
        row = {"shape": list(shape), "dist": dist, "reference": ref_name}
        try:
            want = [np.asarray(a, np.float32) for a in ref(*args)]
        except Exception as e:  # noqa: BLE001  (a reference that cannot run is reported, the others still are)
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            print(f"{label} vs {ref_name:18} could not run: {row['error']}", flush=True)
            rows.append(row)
            continue
        for name, a, b in zip(("y", "dx", "dw"), got, want):
            row[name] = float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))
        total = int(sizes.sum())
        row["padding_zero"] = bool(np.all(got[0][total:] == 0) and np.all(got[1][total:] == 0))
        row["ok"] = bool(all(row[name] <= tol for name in ("y", "dx", "dw")) and row["padding_zero"])
        rows.append(row)
        print(f"{label} vs {ref_name:18} max err / max |ref|: y {row['y']:.2e} dx {row['dx']:.2e} dw {row['dw']:.2e} "
              f"(tolerance {tol:.1e}); padding rows zero: {row['padding_zero']}  {'PASS' if row['ok'] else 'FAIL'}",
              flush=True)
    return rows


def median_rows(shape, cases, passes) -> list[dict]:
    """Table rows from timings of several passes. cases: (impl, dist, FLOPs of one GEMM) each, the dense GEMM first;
    passes: per pass, per case, ((forward seconds or None, error), (forward + backward seconds or None, error)),
    the dense GEMM's seconds never None (the caller stops the table if it fails).
    A row holds the median of its passes' times (of an even count, the mean of the middle two) and, as 'of dense',
    the median of each pass's TFLOP/s over that pass's dense TFLOP/s; with several passes also those ratios'
    [min, max] ('*_of_dense_range'); 'error' the first error of any pass (its pass left out)."""
    rows = []
    dense_flop = cases[0][2]
    for c, (name, dist, flop) in enumerate(cases):
        row = {"shape": list(shape), "dist": dist, "impl": name, "passes": len(passes),
               "error": next((e for p in passes for _, e in p[c] if e), None)}
        for m, (mode, mult) in enumerate((("fwd", 1), ("fwd_bwd", 3))):
            ran = [p[c][m][0] for p in passes if p[c][m][0] is not None]
            if not ran:
                continue
            t = float(np.median(ran))
            # dense seconds / mine, times FLOPs / dense FLOPs: TFLOP/s over the dense TFLOP/s of the same pass
            ratio, spread = pass_ratios([p[c][m][0] for p in passes], [p[0][m][0] for p in passes])
            row.update({f"{mode}_ms": t * 1e3, f"{mode}_tflops": tflops(mult * flop, t),
                        f"{mode}_of_dense": ratio * flop / dense_flop})
            if len(passes) > 1:
                row[f"{mode}_of_dense_range"] = [r * flop / dense_flop for r in spread]
        rows.append(row)
    return rows


def tflops(flop, seconds):
    return flop / seconds / 1e12


def row_kernel_waves(sizes, rows: int, tile, cols: int, programs: int) -> dict:
    """How a Mosaic row kernel (forward: cols = N; dgrad: cols = K) of `tile` deals its work for these group sizes
    over `rows` rows (the array's, padding included). Its items are (row-window visit, column tile) pairs, those of
    the visits in use first (mosaic_parts.live_item), dealt round-robin over `programs`. A visit that multiplies
    loads and multiplies a whole window however few of its rows are stored, so those items cost about the same; the
    padding's visits (zeros) and the unused ones cost next to nothing. `waves` is the most multiplying items one
    program gets, the call's time in item times; `fill` is their mean."""
    visits = row_tiles(jnp.asarray(sizes, jnp.int32), rows, tile.block_m, TMA_ROWS)  # [4, T]
    n_live = live_visits(visits, len(sizes))[0]
    visits = np.asarray(visits)
    n_cols = -(-cols // tile.block_n)
    deal = jax.vmap(lambda i: live_item(i, n_live, n_cols, tile.group_m))
    visit_of_item, _, in_use = (np.asarray(a) for a in deal(jnp.arange(visits.shape[1] * n_cols, dtype=jnp.int32)))
    multiplies = in_use & (visits[0][visit_of_item] < len(sizes))  # [T * C]
    per_program = np.bincount(np.arange(multiplies.size) % programs, weights=multiplies, minlength=programs)
    items = int(multiplies.sum())
    return {"visits": int((visits[0] < len(sizes)).sum()), "items": items, "waves": int(per_program.max()),
            "fill": items / programs}


def mosaic_row_waves(shape, sizes, programs: int) -> dict | None:
    """row_kernel_waves of the Mosaic forward and dgrad at their default tiles for (G, rows, N, K) = shape, None
    where no default tiling exists (Mosaic does not run the shape)."""
    g, r, n, k = shape
    tiling = default_mosaic_tiling(k, n)
    if tiling is None:
        return None
    return {kernel: row_kernel_waves(sizes, g * r, tile, cols, programs)
            for kernel, tile, cols in (("forward", tiling.forward, n), ("dgrad", tiling.dgrad, k))}


def round_robin_loads(costs, programs: int) -> np.ndarray:
    """[programs] work of each program when the items of these costs are dealt round-robin in order."""
    return np.bincount(np.arange(len(costs)) % programs, weights=costs, minlength=programs)


def greedy_loads(costs, programs: int) -> np.ndarray:
    """[programs] work of each program when each item, in order, goes to the program free first (a work queue)."""
    free = [(0.0, p) for p in range(programs)]
    for cost in costs:
        load, p = heapq.heappop(free)
        heapq.heappush(free, (load + cost, p))
    return np.array([load for load, _ in sorted(free, key=lambda f: f[1])])


def mosaic_wgrad_balance(shape, sizes, programs: int) -> dict | None:
    """The busiest program's work over the mean in the Mosaic wgrad at its default tile for (G, rows, N, K) = shape:
    its (group, K tile, N tile) items each cost their group's block_k chunks and one more for the store; `static`
    deals them round-robin in order, as the kernel does; `queue` as a work queue would (the greedy list schedule:
    each item, in order, to the program free first). None where no default tiling exists."""
    g, r, n, k = shape
    tiling = default_mosaic_tiling(k, n)
    if tiling is None:
        return None
    tile = tiling.wgrad
    chunks = np.asarray(wgrad_bounds(jnp.asarray(sizes, jnp.int32), g * r, tile.block_k))[3]
    costs = np.repeat(chunks + 1, (k // tile.block_m) * (n // tile.block_n))
    return {deal: float(loads.max() / loads.mean()) for deal, loads in
            (("static", round_robin_loads(costs, programs)), ("queue", greedy_loads(costs, programs)))}
