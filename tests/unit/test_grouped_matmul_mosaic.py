"""The Mosaic GPU grouped matmul off the GPU: its dispatch facts, its tiles, and that forward, dgrad and wgrad lower
for CUDA (the Mosaic GPU compiler's passes run at lowering: shapes, layouts, transforms and TMA copies are checked
here; the values are checked on a Hopper GPU by tests/gpu/test_grouped_matmul_mosaic.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mjax.kernels.grouped_matmul import (GroupedMatmulUnsupported, KernelTile, Tiling, choose_impl, grouped_matmul,
                                         why_unsupported)
from mjax.kernels.grouped_matmul.mosaic import grouped_matmul_mosaic, mosaic_tile_problem
from mjax.kernels.grouped_matmul.mosaic_parts import TMA_ROWS, live_item, wgrad_bounds
from mjax.kernels.grouped_matmul.tiling import default_mosaic_tiling

FACTS = dict(dtype=jnp.bfloat16, k=2048, n=768, m=32768, groups=8)


def test_mosaic_runs_only_on_a_gpu_and_only_16_bit_calls():
    assert "only on a GPU" in why_unsupported("mosaic", backend="cpu", **FACTS)
    assert why_unsupported("mosaic", backend="gpu", **FACTS) is None
    assert "float32" in why_unsupported("mosaic", backend="gpu", **{**FACTS, "dtype": jnp.float32})
    assert "FP8" in why_unsupported("mosaic", backend="gpu", **FACTS, fp8_grad=jnp.float8_e5m2)
    assert "multiples of 64" in why_unsupported("mosaic", backend="gpu", **{**FACTS, "n": 96})
    x, w, gs = jnp.zeros((8, 64), jnp.bfloat16), jnp.zeros((2, 64, 64), jnp.bfloat16), jnp.array([3, 5])
    with pytest.raises(GroupedMatmulUnsupported, match="--moe_grouped_gemm_impl=mosaic cannot do this call"):
        grouped_matmul(x, w, gs, impl="mosaic")
    assert choose_impl("mosaic", backend="gpu", **FACTS) == "mosaic"


def test_default_tiles_and_tile_problems():
    t = default_mosaic_tiling(2048, 768, specialized=False)
    assert (t.forward.block_m, t.forward.block_n, t.dgrad.block_n, t.wgrad.block_m, t.wgrad.block_n) == \
        (128, 192, 192, 128, 192)  # dgrad: 2048 columns in 11 tiles of 192, the last one partial
    assert {t.forward.num_stages, t.dgrad.num_stages, t.wgrad.num_stages} == {4}
    t = default_mosaic_tiling(4096, 14336, specialized=False)  # Mixtral: 14336 = 74 2/3 x 192
    assert (t.forward.block_n, t.dgrad.block_n, t.wgrad.block_n) == (192, 192, 128)
    assert default_mosaic_tiling(256, 320, specialized=False).forward.block_n == 192  # 2 x 192: 5/6 used, reuse 0.6
    assert default_mosaic_tiling(256, 320, specialized=False).wgrad.block_n == 64
    assert default_mosaic_tiling(2048, 1472, specialized=False).wgrad.block_n == 64  # 23 x 64
    # Warp-specialised (the default): 256 columns on two compute warpgroups, 4 x 48 KiB stages beside two 128 x 64
    # staging slices; one compute warpgroup's stages fill the 227 KiB beside its whole output tile, 4 x 40 + 48 KiB
    # at 128 x 192, 6 x 32 + 32 at 128 x 128; wgrad prefers 128 columns.
    t = default_mosaic_tiling(2048, 768)
    assert (str(t.forward), str(t.dgrad), str(t.wgrad)) == ("128x256x64w12s4g4",) * 2 + ("128x128x64w8s6g4",)
    t = default_mosaic_tiling(320, 384)  # 384 and 320 columns: 192 wide (all used) beats 256 (3/4, 5/8 used)
    assert (str(t.forward), str(t.dgrad)) == ("128x192x64w8s4g4",) * 2
    assert str(default_mosaic_tiling(256, 128).forward) == "128x128x64w8s6g4"
    assert default_mosaic_tiling(2048, 1472).wgrad.block_n == 64
    for kn in ((2048, 768), (4096, 14336), (256, 320), (7168, 2048)):
        t = default_mosaic_tiling(*kn)
        assert all(mosaic_tile_problem(kernel, getattr(t, kernel), *kn) is None
                   for kernel in ("forward", "dgrad", "wgrad")), kn
    assert "accumulator" in mosaic_tile_problem("forward", KernelTile(128, 256, 64, 4, 4), 2048, 768)
    assert "num_warps=4" in mosaic_tile_problem("forward", KernelTile(128, 128, 64, 2, 4), 2048, 768)
    assert mosaic_tile_problem("forward", KernelTile(128, 192, 64, 8, 4), 2048, 768) is None  # warp-specialised
    assert mosaic_tile_problem("forward", KernelTile(128, 192, 64, 8, 5), 2048, 768) is None  # staged in slices
    assert "shared memory" in mosaic_tile_problem("forward", KernelTile(128, 192, 64, 8, 6), 2048, 768)
    assert "shared memory" in mosaic_tile_problem("forward", KernelTile(128, 256, 64, 12, 5), 2048, 768)
    assert "multiple of 128" in mosaic_tile_problem("forward", KernelTile(128, 192, 64, 12, 4), 2048, 768)
    assert "accumulator" in mosaic_tile_problem("forward", KernelTile(128, 512, 64, 12, 2), 2048, 1024)
    assert "num_warps=4" in mosaic_tile_problem("forward", KernelTile(128, 128, 64, 16, 2), 2048, 1024)
    for warps in (4, 8, 12):
        assert "num_stages >= 2" in mosaic_tile_problem("wgrad", KernelTile(128, 128, 64, warps, 1), 2048, 768)
    assert mosaic_tile_problem("dgrad", KernelTile(128, 192, 64, 4, 4), 2048, 768) is None  # a partial last tile
    assert "multiple of block_n" in mosaic_tile_problem("wgrad", KernelTile(128, 192, 64, 4, 4), 2048, 640)
    assert "multiple of block_k" in mosaic_tile_problem("dgrad", KernelTile(128, 128, 128, 4, 4), 2048, 704)
    assert "multiples of 64" in mosaic_tile_problem("forward", KernelTile(128, 96, 64, 4, 4), 2048, 768)


def _mosaic_calls(rows, k, n, groups, dtype, tiling):
    def fwd_bwd(x, w, gs, dy):
        y, vjp = jax.vjp(lambda x, w: grouped_matmul_mosaic(x, w, gs, tiling, 132), x, w)
        return y, *vjp(dy)

    args = (jax.ShapeDtypeStruct((rows, k), dtype), jax.ShapeDtypeStruct((groups, k, n), dtype),
            jax.ShapeDtypeStruct((groups,), jnp.int32), jax.ShapeDtypeStruct((rows, n), dtype))
    text = jax.jit(fwd_bwd).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return text.count("stablehlo.custom_call @mosaic_gpu")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
# whole row blocks, a block past the array, rows padded to 8, fewer rows than a row window (padded to one)
@pytest.mark.parametrize("rows", [1024, 1000, 777, 40])
def test_forward_dgrad_and_wgrad_lower_for_cuda(dtype, rows):
    tiling = default_mosaic_tiling(320, 384)  # dgrad: 320 columns in two 192-wide tiles, the last one partial
    assert tiling.dgrad.block_n == 192
    assert _mosaic_calls(rows, 320, 384, 5, dtype, tiling) == 3


SLICED = KernelTile(128, 192, 64, 8, 5, 4)  # one compute warpgroup staging its output in 64-column slices


@pytest.mark.parametrize("tiling, k, n", [
    # Warp-specialised; 8 and 12 depth steps of 64: multiples of the 4 stages (4 x 40 + 48 KiB of shared memory)
    (Tiling(KernelTile(128, 192, 64, 8, 4, 4), KernelTile(128, 192, 64, 8, 4, 4), KernelTile(128, 128, 64, 8, 6, 4)),
     512, 768),
    # two compute warpgroups. forward: 6 depth steps, chained over 3 stages, its whole 128 x 256 tile staged; dgrad:
    # 384 columns, so the last tile's second warpgroup is past the array, 4 stages and 64-column staging slices;
    # wgrad 64 columns each
    (Tiling(KernelTile(128, 256, 64, 12, 3, 4), KernelTile(128, 256, 64, 12, 4, 2),
            KernelTile(128, 128, 64, 12, 4, 4)), 384, 512),
    (Tiling(SLICED, SLICED, KernelTile(128, 128, 64, 12, 4, 4)), 384, 512),
], ids=["one compute warpgroup", "two compute warpgroups", "sliced staging"])
def test_warp_specialised_tiles_lower(tiling, k, n):
    for kernel in ("forward", "dgrad", "wgrad"):
        assert mosaic_tile_problem(kernel, getattr(tiling, kernel), k, n) is None
    assert _mosaic_calls(1000, k, n, 3, jnp.bfloat16, tiling) == 3


@pytest.mark.parametrize("warps", [4, 8])  # one warpgroup; a memory and a compute warpgroup
def test_other_tiles_lower_too(warps):
    tiling = Tiling(KernelTile(64, 64, 64, warps, 3, 1), KernelTile(128, 64, 128, warps, 2, 2),
                    KernelTile(64, 128, 64, warps, 5, 8))
    assert _mosaic_calls(1000, 256, 128, 3, jnp.bfloat16, tiling) == 3


def test_auto_takes_mosaic_on_hopper_for_the_calls_it_tiles_and_pallas_otherwise():
    assert choose_impl("auto", backend="gpu", hopper=True, **FACTS) == "mosaic"
    assert choose_impl("auto", backend="gpu", hopper=False, **FACTS) == "pallas"
    assert choose_impl("auto", backend="gpu", hopper=True, **{**FACTS, "dtype": jnp.float32}) == "pallas"
    assert choose_impl("auto", backend="gpu", hopper=True, **FACTS, fp8_grad=jnp.float8_e5m2) == "pallas"
    assert choose_impl("auto", backend="gpu", hopper=True, **{**FACTS, "n": 96}) == "pallas"
    assert choose_impl("auto", backend="cpu", hopper=False, **FACTS) == "xla"


@pytest.mark.parametrize("seed", range(8))
def test_wgrad_chunks_cover_each_group_and_flag_those_reaching_into_the_padding(seed):
    """What the wgrad kernels' masks rely on: a group's bk-row chunks start on the 8-row tile holding its first row
    and cover it; rows before the group lie only in its first chunk; a chunk reaching past sum(group_sizes) (into the
    padding, which may hold NaN: both operands are zeroed there) is the group's last and is flagged."""
    rng = np.random.default_rng(seed)
    bk, groups = 64, 12
    sizes = rng.integers(0, 90, groups) * rng.integers(0, 2, groups)  # about half the groups empty
    rows = int(sizes.sum()) + [0, 1, 7, 64, 100][seed % 5]
    if seed == 7:
        rows = int(sizes.sum()) - 5  # the groups claim more rows than there are: clipped
    start, end, origin, chunks, into_padding = np.asarray(jax.jit(wgrad_bounds, static_argnums=(1, 2))(
        jnp.asarray(sizes, jnp.int32), rows, bk))
    used = min(int(sizes.sum()), rows)
    for g in range(groups):
        if end[g] == start[g]:
            assert chunks[g] == 0
            continue
        assert origin[g] % TMA_ROWS == 0 and start[g] - TMA_ROWS < origin[g] <= start[g]
        assert origin[g] + (chunks[g] - 1) * bk < end[g] <= origin[g] + chunks[g] * bk  # no chunk wasted
        assert into_padding[g] == (used < rows and origin[g] + chunks[g] * bk > used)


@pytest.mark.parametrize("n_live, n_visits, n_cols, group_m", [(7, 12, 3, 4), (10, 18, 56, 4), (1, 9, 6, 4),
                                                             (12, 12, 8, 2), (5, 9, 7, 3), (6, 8, 5, 1), (0, 4, 3, 4)])
def test_live_item_deals_each_live_item_once_before_any_unused_one(n_live, n_visits, n_cols, group_m):
    index = jnp.arange(n_visits * n_cols, dtype=jnp.int32)
    t, j, in_use = (np.asarray(a) for a in jax.vmap(lambda i: live_item(i, jnp.int32(n_live), n_cols, group_m))(index))
    assert in_use.tolist() == [i < n_live * n_cols for i in range(n_visits * n_cols)]
    pairs = sorted(zip(t[in_use].tolist(), j[in_use].tolist()))
    assert pairs == [(v, c) for v in range(n_live) for c in range(n_cols)]
    # unused items read a live visit's entry (visit 0 when none is live)
    assert np.all((0 <= t) & (t < max(n_live, 1)) & (0 <= j) & (j < n_cols))
