"""Pallas kernels under a mesh run on each device's shard (mjax/kernels/per_shard.py): the same values as on the
whole arrays, and no gather of a dimension that can stay sharded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mjax.kernels.per_shard import per_shard
from mjax.kernels.quant.fp4_pallas import fake_quant_pallas
from mjax.kernels.quant.block_gemm import block_gemm_pallas
from mjax.kernels.quant.blockwise import expand_cols, quantize_rows, quantize_tiles

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _collectives(f, *args) -> set:
    hlo = f.lower(*args).compile().as_text()
    return {c for c in ("all-gather", "all-to-all", "collective-permute", "all-reduce") if c in hlo}


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
def test_fp4_quantize_per_shard(mesh, recipe):
    """Each device quantizes its shard; NVFP4's tensor scale is the whole tensor's (one all-reduce of the amax)."""
    x = (jax.random.normal(jax.random.key(0), (512, 256)) * 3).astype(jnp.bfloat16)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", "tensor")))
    f = jax.jit(lambda x: fake_quant_pallas(x, recipe=recipe, interpret=True))
    got = f(xs)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(f(x), np.float32))
    assert got.sharding.is_equivalent_to(NamedSharding(mesh, P("data", "tensor")), 2)
    assert _collectives(f, xs) == ({"all-reduce"} if recipe == "nvfp4" else set())


def test_fp4_shard_that_splits_a_block_is_gathered_first(mesh):
    """48 columns over 2 devices are 24 each, not whole 16-wide blocks: the columns are gathered, values unchanged."""
    x = (jax.random.normal(jax.random.key(1), (64, 48)) * 3).astype(jnp.bfloat16)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", "tensor")))
    f = jax.jit(lambda x: fake_quant_pallas(x, recipe="nvfp4", interpret=True))
    np.testing.assert_array_equal(np.asarray(f(xs), np.float32), np.asarray(f(x), np.float32))
    assert "all-gather" in _collectives(f, xs)


def test_blockwise_gemm_per_shard(mesh):
    """Rows of a over data, rows of b^T over tensor: each device computes its output tile, nothing gathered."""
    x = jax.random.normal(jax.random.key(2), (512, 256), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(3), (256, 512), jnp.float32) * 0.05
    a, sa, _ = quantize_rows(x, jnp.float8_e4m3fn)  # [M, K], [M, K/128]
    b, sb, _ = quantize_tiles(w, jnp.float8_e4m3fn)  # [K, N], [K/128, N/128]
    bt, sb = b.T, expand_cols(sb)  # [N, K], [K/128, N]
    placed = [jax.device_put(t, NamedSharding(mesh, s)) for t, s in
              ((a, P("data", None)), (sa, P("data", None)), (bt, P("tensor", None)), (sb, P(None, "tensor")))]
    f = jax.jit(lambda *t: block_gemm_pallas(*t, out_dtype=jnp.float32, interpret=True))
    got = f(*placed)
    np.testing.assert_allclose(np.asarray(got), np.asarray(f(a, sa, bt, sb)), rtol=1e-6)
    assert got.sharding.is_equivalent_to(NamedSharding(mesh, P("data", "tensor")), 2)
    assert not _collectives(f, *placed)


def _indexed_op(**options):
    """x [I, J] -> (x + 100 * the shard of i this device holds, the column sums of x)."""
    def local(x, shards):
        return x + 100.0 * shards["i"].index, x.sum(0)

    return per_shard(local, "i j -> i j, j", shard_index=("i",), sum_over_shards=(1,), **options)


def _indexed_oracle(x: np.ndarray, i_shards: int):
    rows = np.arange(x.shape[0]) // (x.shape[0] // i_shards)  # the shard each row lies in
    return x + 100.0 * rows[:, None], x.sum(0)


def test_shard_index_and_sum_over_shards(mesh):
    """The kernel sees which shard of i it holds; the column sums of each shard's rows are summed over `data`."""
    x = jax.random.normal(jax.random.key(4), (16, 8))
    xs = jax.device_put(x, NamedSharding(mesh, P("data", "tensor")))
    f = jax.jit(_indexed_op())
    for got, want in zip(f(xs), _indexed_oracle(np.asarray(x), 4)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    for got, want in zip(f(x), _indexed_oracle(np.asarray(x), 1)):  # unsplit: one shard
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    assert _collectives(f, xs) == {"all-reduce"}


def test_adjust_gathers_what_the_kernel_cannot_take_split(mesh):
    """`adjust` keeps j whole: the kernel gets whole rows (j gathered first), the values are unchanged."""
    op = per_shard(lambda x: x * 2.0, "i j -> i j", adjust=lambda axes, sizes, mesh_shape: axes | {"j": None})
    x = jax.random.normal(jax.random.key(5), (16, 8))
    xs = jax.device_put(x, NamedSharding(mesh, P("data", "tensor")))
    f = jax.jit(op)
    np.testing.assert_allclose(f(xs), 2.0 * np.asarray(x), rtol=1e-6)
    assert "all-gather" in _collectives(f, xs)


def test_per_shard_inside_a_shard_map_manual_over_pipeline():
    """As in a pipeline stage: the partitioner gives shardings over the non-manual axes only; the kernel still
    runs on its shard (index and sums over the right devices of each stage), with nothing gathered."""
    mesh = jax.make_mesh((2, 2, 2), ("pipeline", "data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    x = jax.random.normal(jax.random.key(6), (2, 16, 8))  # [stage, I, J]

    def stage(x):
        split = NamedSharding(jax.sharding.get_abstract_mesh(), P("data", "tensor"))
        return tuple(y[None] for y in _indexed_op()(jax.lax.with_sharding_constraint(x[0], split)))

    f = jax.jit(jax.shard_map(stage, mesh=mesh, in_specs=P("pipeline"), out_specs=P("pipeline"),
                              axis_names={"pipeline"}, check_vma=False))
    got = f(x)
    for s in range(2):
        for g, want in zip(got, _indexed_oracle(np.asarray(x[s]), 2)):
            np.testing.assert_allclose(g[s], want, rtol=1e-6, atol=1e-5)
    assert _collectives(f, x) == {"all-reduce"}
