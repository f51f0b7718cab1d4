"""Grouped matmul (mjax/kernels/grouped_matmul): the Pallas kernels (interpreted) and the lax.ragged_dot reference
against a float64 NumPy oracle for y, dx and dw; the tile schedule against a direct enumeration; jax.vmap; the
Triton lowering of every kernel for an H200; the dispatch and its capability table."""

import functools
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.grouped_cases import (greedy_loads, group_sizes, median_rows, mosaic_row_waves, mosaic_wgrad_balance,
                                      round_robin_loads, row_kernel_waves)
from mjax.kernels.grouped_matmul import (IMPLS, GroupedMatmulUnsupported, KernelTile, Tiling, choose_impl,
                                         grouped_matmul, why_unsupported)
from mjax.kernels.grouped_matmul.pallas import grouped_matmul_pallas
from mjax.kernels.grouped_matmul.schedule import max_row_tiles, row_tiles, swizzle
from mjax.kernels.grouped_matmul.tiling import default_tiling
from tests.helpers.gpu_lowering import lower_for_h200

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

TINY = Tiling.uniform(KernelTile(16, 16, 16))  # 16-row blocks, so that small groups straddle and share blocks
K, N = 32, 48  # two depth blocks forward (K) and three in dgrad (N)
M = 60  # rows; every case has M rows and 9 groups, so that each kernel compiles once for all of them
# Group sizes: empty groups first, in the middle and last; sizes that are not multiples of 16; one 16-row block
# holding four groups (rows 0-15: groups 1, 2, 3 and the start of 5); padding rows past the sum (all but
# one_group); groups of whole blocks with the padding starting mid-block.
CASES = {
    "ragged": [0, 3, 2, 4, 0, 25, 13, 1, 0],
    "one_group": [0, 0, 0, 0, M, 0, 0, 0, 0],
    "all_padding": [0] * 9,
    "whole_blocks": [16, 0, 32, 0, 0, 0, 0, 0, 0],
}


def _oracle(x, w, group_sizes, dy):
    """float64 NumPy loop over groups: y = x_g w_g, dx = dy_g w_g^T, dw_g = x_g^T dy_g, zeros elsewhere; and the
    same products of absolute values (the scale of each result's rounding error)."""
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    results = {"y": np.zeros((x.shape[0], w.shape[2])), "dx": np.zeros_like(x), "dw": np.zeros_like(w)}
    scales = {name: np.zeros_like(r) for name, r in results.items()}
    start = 0
    for g, size in enumerate(np.asarray(group_sizes)):
        rows = slice(start, start + size)
        for out, f in ((results, lambda a: a), (scales, np.abs)):
            out["y"][rows] = f(x[rows]) @ f(w[g])
            out["dx"][rows] = f(dy[rows]) @ f(w[g]).T
            out["dw"][g] = f(x[rows]).T @ f(dy[rows])
        start += size
    return results, scales


def _tolerance(scale, depth: int, dtype):
    """Error allowed for a float32-accumulated product whose terms' absolute values sum to `scale`: a float32 sum of
    `depth` terms in any order stays within ~lambda sqrt(depth) u sum|terms| (probabilistic rounding error
    analysis, Higham & Mary 2019; lambda = 4, u = 2^-24), plus one ulp of `dtype` for rounding the result (a
    relative 2^-23 for float32, 2^-10 for float16, 2^-7 for bfloat16: twice round-to-nearest's worst case).
    Measured here: errors reach 0.12 of this for float32 and 0.5 for 16-bit results (their rounding)."""
    return (4 * math.sqrt(max(depth, 1)) * 2.0**-24 + 2.0 ** -jnp.finfo(dtype).nmant) * scale


def _inputs(group_sizes, m, dtype, seed=0):
    """x, w, group sizes, dy; NaN in the padding rows of x and dy, which must never reach a result."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    total = sum(group_sizes)
    x = jax.random.normal(k1, (m, K), jnp.float32).at[total:].set(jnp.nan).astype(dtype)
    w = jax.random.normal(k2, (len(group_sizes), K, N), jnp.float32).astype(dtype)
    dy = jax.random.normal(k3, (m, N), jnp.float32).at[total:].set(jnp.nan).astype(dtype)
    return x, w, jnp.asarray(group_sizes, jnp.int32), dy


@functools.partial(jax.jit, static_argnames=("impl", "tiling"))  # one compile for every case of a shape
def _run(impl, x, w, group_sizes, dy, tiling=TINY):
    tiling = tiling if impl == "pallas" else None
    y, vjp = jax.vjp(lambda x, w: grouped_matmul(x, w, group_sizes, impl=impl, tiling=tiling), x, w)
    return dict(zip(("y", "dx", "dw"), (y, *vjp(dy))))


def _check_against_oracle(got, x, w, group_sizes, dy, dtype):
    pad = lambda a: np.where(np.isnan(a), 0.0, a)  # noqa: E731  (NaN padding rows take no part in the oracle)
    total = sum(group_sizes)
    want, scales = _oracle(pad(np.asarray(x, np.float64)), np.asarray(w, np.float64), group_sizes,
                           pad(np.asarray(dy, np.float64)))
    depths = {"y": K, "dx": N, "dw": max(group_sizes)}
    for name in ("y", "dx", "dw"):
        value = np.asarray(got[name], np.float64)
        assert got[name].dtype == dtype and value.shape == want[name].shape, name
        excess = np.abs(value - want[name]) - _tolerance(scales[name], depths[name], dtype)
        assert np.all(excess <= 0), f"{name}: exceeds the tolerance by up to {np.nanmax(excess)} (NaN anywhere: " \
                                    f"{np.isnan(value).any()})"
    # Padding rows and empty groups: exact zeros.
    assert np.all(np.asarray(got["y"])[total:] == 0) and np.all(np.asarray(got["dx"])[total:] == 0)
    empty = [g for g, size in enumerate(group_sizes) if size == 0]
    assert np.all(np.asarray(got["dw"])[empty] == 0)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_float32_matches_the_float64_oracle(impl, case):
    group_sizes = CASES[case]
    x, w, gs, dy = _inputs(group_sizes, M, jnp.float32)
    _check_against_oracle(_run(impl, x, w, gs, dy), x, w, group_sizes, dy, jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_half_precision_matches_the_float64_oracle(impl, dtype):
    group_sizes = CASES["ragged"]
    x, w, gs, dy = _inputs(group_sizes, M, dtype, seed=1)
    _check_against_oracle(_run(impl, x, w, gs, dy), x, w, group_sizes, dy, dtype)


def test_default_tiling_matches_the_oracle():
    """The default tiles (128-row blocks, wider than every group here) on a K and N that fit them."""
    group_sizes = CASES["ragged"]
    x, w, gs, dy = _inputs(group_sizes, M, jnp.float32, seed=2)
    _check_against_oracle(_run("pallas", x, w, gs, dy, tiling=None), x, w, group_sizes, dy, jnp.float32)


_row_tiles = jax.jit(row_tiles, static_argnums=(1, 2, 3))


def _used_visits(group_sizes, rows, block_m, align=None):
    visits = np.asarray(_row_tiles(jnp.asarray(group_sizes, jnp.int32), rows, block_m, align))  # [4, T]
    assert visits.shape == (4, max_row_tiles(rows, len(group_sizes), block_m))
    used = visits[0] <= len(group_sizes)
    assert np.all(used[:used.sum()]) and not np.any(used[used.sum():])  # unused visits trail, id G + 1
    return visits[:, used]


@pytest.mark.parametrize("align", [None, 8, 1])  # the blocks; the Mosaic kernels' 8-row windows; any row
@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("seed", range(6))
def test_row_tiles_cover_every_row_once_within_one_window_and_one_segment(seed, block_m, align):
    rng = np.random.default_rng(seed)
    groups, rows = 8, 200
    sizes = rng.integers(0, 25, groups) * rng.integers(0, 2, groups)  # about half the groups empty; sum <= 198
    sizes[-1] = seed * 10  # 0 to 50 rows in the last group; 0 to 200 padding rows
    if seed == 5:  # no padding: the bound on the number of visits is reached more closely
        sizes[0] += rows - sizes.sum()
    segment_of_row = np.concatenate([np.repeat(np.arange(groups), sizes), np.full(rows - sizes.sum(), groups)])
    seen = np.zeros(rows, int)
    visits = _used_visits(sizes, rows, block_m, align)
    for seg, row0, first, last in visits.T:
        assert row0 <= first < last <= row0 + block_m
        assert row0 % (align or block_m) == 0
        assert np.all(segment_of_row[first:last] == seg)
        seen[first:last] += 1
    assert np.all(seen == 1)
    segments = np.concatenate([sizes, [rows - sizes.sum()]])
    if align:  # a segment's windows start at most align - 1 rows before it
        ends = np.cumsum(segments)
        starts = ends - segments
        assert visits.shape[1] == sum(-(-(e - s // align * align) // block_m) for s, e in zip(starts, ends) if e > s)


def test_a_block_of_tiny_groups_is_visited_once_per_group():
    visits = _used_visits([3, 2, 0, 4, 30], 40, 16)
    assert visits.T.tolist() == [[0, 0, 0, 3], [1, 0, 3, 5], [3, 0, 5, 9], [4, 0, 9, 16], [4, 16, 16, 32],
                                 [4, 32, 32, 39], [5, 32, 39, 40]]  # the last row is padding (segment G = 5)
    visits = _used_visits([3, 2, 0, 4, 30], 40, 16, align=1)
    assert visits.T.tolist() == [[0, 0, 0, 3], [1, 3, 3, 5], [3, 5, 5, 9], [4, 9, 9, 25], [4, 25, 25, 39],
                                 [5, 39, 39, 40]]  # windows from each segment's first row


@pytest.mark.parametrize("n_rows,n_cols,group", [(7, 3, 2), (8, 5, 8), (5, 4, 8), (1, 6, 3)])
def test_swizzle_visits_every_tile_once(n_rows, n_cols, group):
    pids = jnp.arange(n_rows * n_cols, dtype=jnp.int32)
    rows, cols = (np.asarray(a) for a in jax.vmap(lambda p: swizzle(p, n_rows, n_cols, group))(pids))
    assert sorted(zip(rows.tolist(), cols.tolist())) == [(i, j) for i in range(n_rows) for j in range(n_cols)]
    assert np.all(np.diff(rows[: min(group, n_rows) * n_cols] // group) == 0)  # the first group of row tiles first


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_vmap_over_a_batch_equals_each_item(impl):
    """x [B, M, K], group_sizes [B, G] (different per item, with empty groups and padding), w shared."""
    sizes = [[5, 0, 20, 3], [0, 0, 0, 28], [10, 10, 0, 0]]
    m = 30
    items = [_inputs(s, m, jnp.float32, seed=10 + i) for i, s in enumerate(sizes)]
    w = items[0][1]
    x, gs, dy = (jnp.stack([item[j] for item in items]) for j in (0, 2, 3))

    def one(x, gs, dy):
        r = _run(impl, x, w, gs, dy)
        return r["y"], r["dx"], r["dw"]

    batched = jax.jit(jax.vmap(one))(x, gs, dy)
    for b in range(len(sizes)):
        for got, want in zip(batched, one(x[b], gs[b], dy[b])):
            np.testing.assert_array_equal(np.asarray(got[b]), np.asarray(want))


def _fwd_bwd(tiling):
    def f(x, w, gs, dy):
        y, vjp = jax.vjp(lambda x, w: grouped_matmul_pallas(x, w, gs, tiling, False), x, w)
        return y, *vjp(dy)
    return f


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("rows", [1024, 1000])  # whole 128-row blocks, and a last block past the array (masked)
def test_every_kernel_lowers_through_triton_for_an_h200(dtype, rows):
    k, n, groups = 256, 384, 5
    tiling = default_tiling(dtype, k, n)
    args = (jnp.zeros((rows, k), dtype), jnp.zeros((groups, k, n), dtype), jnp.zeros((groups,), jnp.int32),
            jnp.zeros((rows, n), dtype))
    assert lower_for_h200(_fwd_bwd(tiling), *args) == 3  # forward, dgrad, wgrad


def test_the_batched_kernels_lower_through_triton():
    tiling = default_tiling(jnp.bfloat16, 256, 384)
    args = (jnp.zeros((2, 512, 256), jnp.bfloat16), jnp.zeros((4, 256, 384), jnp.bfloat16),
            jnp.zeros((2, 4), jnp.int32), jnp.zeros((2, 512, 384), jnp.bfloat16))
    assert lower_for_h200(jax.vmap(_fwd_bwd(tiling), in_axes=(0, None, 0, 0)), *args) == 3


# ---- dispatch and capability table ----

FACTS = dict(dtype=jnp.bfloat16, k=2048, n=768)


def test_auto_is_xla_off_gpu_and_pallas_on_gpu():
    assert choose_impl("auto", backend="cpu", **FACTS) == "xla"
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        assert choose_impl("auto", backend="gpu", dtype=dtype, k=2048, n=768) == "pallas"
    x, w, gs, _ = _inputs([3, 5], 8, jnp.float32)
    jaxpr = str(jax.make_jaxpr(lambda x, w: grouped_matmul(x, w, gs))(x, w))  # this test process runs on CPU
    assert "ragged_dot" in jaxpr and "pallas_call" not in jaxpr


@pytest.mark.parametrize("facts,reason", [
    (dict(dtype=jnp.int8, k=2048, n=768), "bfloat16, float16 or float32"),
    (dict(dtype=jnp.float8_e4m3fn, k=2048, n=768), "bfloat16, float16 or float32"),
    (dict(dtype=jnp.bfloat16, k=2040, n=768), "not multiples of 16"),
    (dict(dtype=jnp.bfloat16, k=2048, n=760), "not multiples of 16"),
    (dict(dtype=jnp.bfloat16, k=2048, n=768, tiling=Tiling(forward=KernelTile(128, 512, 64))),
     "N=768 to be a multiple of block_n=512"),
    (dict(dtype=jnp.bfloat16, k=2048, n=768, tiling=Tiling(dgrad=KernelTile(128, 128, 512))),
     "N=768 to be a multiple of block_k=512"),
    (dict(dtype=jnp.bfloat16, k=1408, n=768, tiling=Tiling(wgrad=KernelTile(256, 128, 64))),
     "K=1408 to be a multiple of block_m=256"),
    (dict(dtype=jnp.float32, k=2048, n=768, tiling=Tiling.uniform(KernelTile(128, 256, 64, 8, 4))),
     "KiB of shared memory"),
    (dict(dtype=jnp.bfloat16, k=4096, n=14336, m=2**16, groups=64), "32-bit offsets"),
])
def test_auto_on_gpu_raises_naming_the_flag_instead_of_falling_back(facts, reason):
    assert reason in why_unsupported("pallas", backend="gpu", **facts)
    with pytest.raises(GroupedMatmulUnsupported, match="--moe_grouped_gemm_impl=auto") as err:
        choose_impl("auto", backend="gpu", **facts)
    assert reason in str(err.value) and "--moe_grouped_gemm_impl=xla" in str(err.value)
    assert choose_impl("xla", backend="gpu", **facts) == "xla"  # on purpose, it is allowed


def test_unknown_impl_and_an_untileable_explicit_pallas_call_raise_naming_the_flag():
    assert set(IMPLS) == {"auto", "pallas", "mosaic", "xla"}
    with pytest.raises(GroupedMatmulUnsupported, match="--moe_grouped_gemm_impl='cutlass' is not one of"):
        choose_impl("cutlass", backend="gpu", **FACTS)
    x, w, gs, _ = _inputs([3, 5], 8, jnp.float32)
    with pytest.raises(GroupedMatmulUnsupported, match="--moe_grouped_gemm_impl"):
        grouped_matmul(x, w, gs, impl="triton")
    with pytest.raises(GroupedMatmulUnsupported, match="--moe_grouped_gemm_impl=pallas cannot do this call: .*N=48"):
        grouped_matmul(x, w, gs, impl="pallas", tiling=Tiling.uniform(KernelTile(16, 32, 16)))


def test_operands_are_checked():
    x, w, gs, _ = _inputs([3, 5], 8, jnp.float32)
    with pytest.raises(ValueError, match="one dtype"):
        grouped_matmul(x, w.astype(jnp.bfloat16), gs)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul(x, w, gs[:1])
    with pytest.raises(ValueError, match="jax.vmap"):
        grouped_matmul(x[None], w, gs)


def test_tiles_parse_print_and_validate():
    tile = KernelTile.parse("128x256x64w8s3")
    assert (tile.block_m, tile.block_n, tile.block_k, tile.num_warps, tile.num_stages, tile.group_m) == \
        (128, 256, 64, 8, 3, 8)
    assert KernelTile.parse(str(KernelTile(64, 128, 32, 4, 5, 4))) == KernelTile(64, 128, 32, 4, 5, 4)
    for bad in ("128x128", "128x128x64", "100x128x64w4s3"):
        with pytest.raises(ValueError):
            KernelTile.parse(bad)


def test_default_tiling_takes_the_widest_blocks_that_divide():
    t = default_tiling(jnp.bfloat16, 2048, 768)
    assert (t.forward.block_n, t.forward.block_k, t.dgrad.block_n, t.dgrad.block_k) == (256, 64, 256, 64)
    assert (t.wgrad.block_m, t.wgrad.block_n, t.wgrad.num_warps) == (128, 256, 8)
    t = default_tiling(jnp.bfloat16, 2048, 1408)  # DeepSeek-MoE's expert FFN: 11 x 128
    assert (t.forward.block_n, t.dgrad.block_k, t.wgrad.block_n) == (128, 64, 128)
    assert default_tiling(jnp.float32, 2048, 768).forward.block_k == 32
    assert default_tiling(jnp.bfloat16, 2048, 1000) is None


# ---- the benchmark (benchmarks/bench_grouped_matmul.py) ----


def test_median_rows_take_each_passes_ratio_to_its_own_dense_gemm_and_skip_failed_passes():
    """Three passes whose clock halves in the last: the ratios to dense stay those of one pass; a case with 7/8 of
    the FLOPs (padding rows) gets 7/8 of the rate at equal time; a failed pass is left out and its error kept."""
    cases = [("dense", "-", 800), ("k", "balanced", 800), ("k", "padded", 700), ("k", "empty", 800)]
    dense, k = (1.0, 3.0), (2.0, 6.0)  # seconds: forward, forward + backward
    passes = [[((d * s, None), (b * s, None)) for d, b in times] for s in (1.0, 1.0, 2.0)
              for times in [[dense, k, k, k]]]
    passes[1][3] = ((None, "OOM"), (None, "OOM"))
    passes[2][3] = ((5.0, None), (12.0, None))
    rows = median_rows((4, 25, 8, 4), cases, passes)
    assert [r["dist"] for r in rows] == ["-", "balanced", "padded", "empty"]
    assert rows[0]["fwd_of_dense"] == rows[0]["fwd_bwd_of_dense"] == 1.0 and rows[0]["error"] is None
    balanced, padded, empty = rows[1:]
    assert balanced["fwd_ms"] == 2000.0 and balanced["fwd_bwd_ms"] == 6000.0  # the median pass
    assert balanced["fwd_of_dense"] == 0.5 and balanced["fwd_of_dense_range"] == [0.5, 0.5]
    assert balanced["fwd_tflops"] == pytest.approx(800 / 2.0 / 1e12)
    assert padded["fwd_of_dense"] == pytest.approx(0.5 * 7 / 8)
    assert padded["fwd_bwd_of_dense"] == pytest.approx(0.5 * 7 / 8)
    assert empty["error"] == "OOM" and empty["fwd_ms"] == pytest.approx(3500.0)  # passes 1 and 3: (2 + 5) / 2
    assert empty["fwd_of_dense_range"] == [pytest.approx(0.4), pytest.approx(0.5)]  # 2 / 5 in the slow pass
    assert median_rows((4, 25, 8, 4), cases[:1], passes[:1])[0]["passes"] == 1
    assert "fwd_of_dense_range" not in median_rows((4, 25, 8, 4), cases[:2], [p[:2] for p in passes[:1]])[1]


def _deal(sizes, rows, block_m, n_cols, group_m, programs, align=8):
    """The most multiplying items one program gets, walked as the Mosaic row kernels walk them: each group's windows
    (they multiply), then the padding rows' (they do not), each from the aligned row at or before the segment's
    first row, block_m rows on, until its last row is covered; items (window, column tile) in strips of group_m
    column tiles over these windows alone, every other strip taking them backwards; the static grid's unused items
    after them; item i to program i % programs."""
    windows, start = [], 0
    for size, multiplies in [(size, True) for size in sizes] + [(rows - sum(sizes), False)]:
        row = start - start % align
        while size and row < start + size:
            windows, row = windows + [multiplies], row + block_m
        start += size
    items = []
    for strip, first in enumerate(range(0, n_cols, group_m)):
        order = windows if strip % 2 == 0 else windows[::-1]
        items += [w for w in order for _ in range(first, min(first + group_m, n_cols))]
    return sum(windows), max(sum(items[p::programs]) for p in range(programs))


@pytest.mark.parametrize("dist", ["balanced", "skewed", "empty", "dirichlet", "padded"])
@pytest.mark.parametrize("groups, rows, cols", [(8, 4096, 768), (8, 4096, 2048), (16, 2048, 768), (128, 512, 768),
                                                (8, 4096, 14336), (60, 512, 1408), (5, 100, 384)])
def test_row_kernel_waves_follow_the_kernels_deal(groups, rows, cols, dist):
    sizes = group_sizes(dist, groups, rows)
    tile = KernelTile(128, 256, 64, 12, 4, 4)
    got = row_kernel_waves(sizes, groups * rows, tile, cols, 132)
    visits, busiest = _deal(sizes.tolist(), groups * rows, 128, -(-cols // 256), 4, 132)
    n_cols = -(-cols // 256)
    assert (got["visits"], got["items"], got["waves"]) == (visits, visits * n_cols, busiest)
    assert got["fill"] == pytest.approx(visits * n_cols / 132)


def test_row_kernel_waves_of_the_documented_rows():
    """docs/moe.md's table: one visit per 128 rows when balanced; the 16-group Dirichlet row spills 9 of its 801
    items into a seventh wave; Mixtral's forward (56 column tiles) takes ceil(14336 / 132) = 109 now that the
    unused visits come last."""
    balanced = mosaic_row_waves((16, 2048, 768, 2048), group_sizes("balanced", 16, 2048), 132)["forward"]
    assert balanced == {"visits": 256, "items": 768, "waves": 6, "fill": 768 / 132}
    waves = mosaic_row_waves((16, 2048, 768, 2048), group_sizes("dirichlet", 16, 2048), 132)
    assert (waves["forward"]["items"], waves["forward"]["waves"]) == (801, 7)
    mixtral = mosaic_row_waves((8, 4096, 14336, 4096), group_sizes("balanced", 8, 4096), 132)["forward"]
    assert (mixtral["items"], mixtral["waves"]) == (14336, 109)
    assert mosaic_row_waves((8, 64, 96, 2048), group_sizes("balanced", 8, 64), 132) is None  # no Mosaic tiling


def test_greedy_and_round_robin_loads():
    """A long item first: round-robin still gives its program every other short one; the queue gives them all to
    the other program. Equal items: both deals are the same."""
    assert round_robin_loads([3, 1, 1, 1], 2).tolist() == [4, 2]
    assert greedy_loads([3, 1, 1, 1], 2).tolist() == [3, 3]
    assert greedy_loads([5, 1, 1, 1, 1, 1, 1], 3).tolist() == [5, 3, 3]
    assert greedy_loads([2] * 7, 3).tolist() == round_robin_loads([2] * 7, 3).tolist() == [6, 4, 4]


def test_wgrad_balance_of_the_documented_rows():
    """docs/moe.md's wgrad deal: the 16-group skewed row's one long group (96 items of 257 steps among 1440 of 19)
    leaves its programs 1.18x the mean under round-robin and 1.04x under the queue; balanced rows deal alike."""
    skewed = mosaic_wgrad_balance((16, 2048, 768, 2048), group_sizes("skewed", 16, 2048), 132)
    assert skewed["static"] == pytest.approx(1.182, abs=1e-3) and skewed["queue"] == pytest.approx(1.038, abs=1e-3)
    balanced = mosaic_wgrad_balance((16, 2048, 768, 2048), group_sizes("balanced", 16, 2048), 132)
    assert balanced["static"] == balanced["queue"] == pytest.approx(1.03125)  # 1536 items: 12 or 11 a program
    assert mosaic_wgrad_balance((8, 64, 96, 2048), group_sizes("balanced", 8, 64), 132) is None  # no Mosaic tiling


@pytest.mark.slow
def test_benchmark_smoke_run_tables_sweeps_and_checks(tmp_path):
    """The script end to end off GPU (one tiny shape, kernels interpreted; a subprocess, as its absl flags are
    global): the table, the sweep, --check, the JSON and the row distributions it times."""
    out = tmp_path / "gmm.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_grouped_matmul", "--shapes=4x40x64x32", "--check",
                           "--min_time_s=0.001", "--dists=balanced,skewed,empty", "--tilings=16x16x16w4s3",
                           "--passes=2", f"--json_out={out}"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": "."})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "check: all PASS" in proc.stdout
    report = json.loads(out.read_text())
    assert {r["impl"] for r in report["main"]} == {"dense jnp.dot (ceiling)", "pallas", "ragged_dot"}
    assert len(report["main"]) == 1 + 2 * 3  # the dense GEMM; each implementation at each distribution, once
    assert all(row["passes"] == 2 and not row["error"] and len(row["fwd_bwd_of_dense_range"]) == 2
               for row in report["main"])
    assert all(r["ok"] for r in report["check"])
    assert {r["dist"] for r in report["check"]} == {"balanced", "skewed", "empty", "padded"}
    assert set(report["best_tiles"]["4x40x64x32"]) == {"forward", "dgrad", "wgrad"}
    assert list(report["group_sizes"]) == ["4x40x64x32"]  # the shape asked for
    for shape, dists in report["group_sizes"].items():
        groups, rows = (int(v) for v in shape.split("x")[:2])
        total = groups * rows
        balanced, skewed, empty, padded = (np.asarray(dists[d]) for d in ("balanced", "skewed", "empty", "padded"))
        assert balanced.tolist() == [rows] * groups
        assert skewed.sum() == empty.sum() == total and skewed[0] == total // 2 and np.ptp(skewed[1:]) <= 1
        assert empty[0] == empty[-1] == 0 and np.all(empty[::4] == 0) and np.ptp(empty[empty > 0]) <= 1
        assert padded.sum() == total - total // 8
