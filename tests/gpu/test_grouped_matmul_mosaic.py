"""On a Hopper GPU: the Mosaic GPU grouped matmul (mjax/kernels/grouped_matmul/mosaic.py) equals per-group float32
products of the same bf16 values, forward and both gradients, on ragged groups: empty groups (first, inner, last),
groups starting inside a row block and inside a wgrad chunk, a row count that is no multiple of the tile, padding
rows holding NaN (their outputs and gradients must come out zero), and all rows in one group; and a learned
router's uneven load (Dirichlet(0.3) proportions over 64 groups) on one and on three programs, so that each program
walks many tiles of a few depth steps (the warp-specialised wgrad chains them all through one ring).

    JAX_PLATFORMS=cuda python3 -m pytest -m gpu tests/gpu/test_grouped_matmul_mosaic.py -q
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mjax.kernels.grouped_matmul import KernelTile, Tiling, grouped_matmul, mosaic
from mjax.kernels.grouped_matmul.tiling import default_mosaic_tiling
from tests.helpers.grouped_oracle import assert_per_group

pytestmark = pytest.mark.gpu

CASES = {  # group sizes; M rows in all (rows past the sum are padding)
    "ragged": ([0, 137, 0, 300, 63, 1, 0, 250], 1000),
    "one group": ([0, 0, 777, 0], 777),
    "balanced": ([256] * 4, 1024),
    "few rows": ([3, 0, 20, 9], 40),  # fewer rows than one row window
}
TILINGS = {
    "default": None,
    "one warpgroup": Tiling(KernelTile(128, 192, 64, 4, 4, 4), KernelTile(128, 192, 64, 4, 4, 4),
                            KernelTile(128, 128, 64, 4, 4, 4)),
    "small": Tiling(KernelTile(64, 64, 64, 4, 3, 1), KernelTile(128, 64, 64, 4, 2, 2),
                    KernelTile(64, 128, 64, 4, 4, 1)),
    "small specialized": Tiling(KernelTile(64, 64, 64, 8, 3, 1), KernelTile(128, 64, 64, 8, 2, 2),
                                KernelTile(64, 128, 64, 8, 4, 1)),
    # warp-specialised (8 warps); rings deeper than the 4 (forward) and 2 (dgrad) depth steps; dgrad's 256 columns
    # in a whole and a partial 192-column tile
    "specialized": Tiling(KernelTile(128, 128, 64, 8, 6, 4), KernelTile(128, 192, 64, 8, 4, 1),
                          KernelTile(128, 128, 64, 8, 6, 4)),
    # one compute warpgroup staging its 192 columns in 64-column slices beside 5 stages
    "sliced staging": Tiling(KernelTile(128, 192, 64, 8, 5, 4), KernelTile(128, 192, 64, 8, 5, 1),
                             KernelTile(128, 128, 64, 8, 6, 4)),
    # two compute warpgroups (12 warps), each half the columns (at K=384, N=256): forward and wgrad stage their
    # output in 64-column slices beside 4 stages (the forward's 6 depth steps unchained); dgrad's 384 columns leave
    # the second warpgroup's half of the last tile past the array
    "two compute warpgroups": Tiling(KernelTile(128, 256, 64, 12, 4, 4), KernelTile(128, 256, 64, 12, 2, 1),
                                     KernelTile(128, 256, 64, 12, 4, 4)),
}
SHAPES = {"default": (1408, 192), "two compute warpgroups": (384, 256)}  # (K, N); the others (256, 128)


needs_hopper = pytest.mark.skipif(jax.default_backend() != "gpu" or
                                  float(getattr(jax.devices()[0], "compute_capability", "0")) < 9.0,
                                  reason="the Mosaic GPU kernels need a Hopper GPU")


@needs_hopper
@pytest.mark.parametrize("tiling", TILINGS, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_mosaic_equals_per_group_products(case, tiling):
    sizes, m = CASES[case]
    k, n = SHAPES.get(tiling, (256, 128))  # default: dgrad's 1408 columns end in half a 256-column tile
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (len(sizes), k, n)) * k**-0.5).astype(jnp.bfloat16)
    dy = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
    total = sum(sizes)
    x, dy = x.at[total:].set(jnp.nan), dy.at[total:].set(jnp.nan)  # padding rows must not leak into anything

    def f(x, w):
        return grouped_matmul(x, w, jnp.asarray(sizes, jnp.int32), impl="mosaic", tiling=TILINGS[tiling])

    y, vjp = jax.vjp(f, x, w)
    assert_per_group(sizes, x, w, dy, y, *vjp(dy))


@needs_hopper
@pytest.mark.parametrize("num_sms", [1, 3])
@pytest.mark.parametrize("specialized", [False, True])  # the default: dgrad on two compute warpgroups
def test_uneven_groups_on_few_programs(specialized, num_sms):
    rng = np.random.default_rng(0)
    sizes = rng.multinomial(3900, rng.dirichlet(np.full(64, 0.3)))  # many empty and one-chunk groups
    assert (sizes == 0).any() and ((sizes > 0) & (sizes < 64)).any() and sizes.max() > 6 * 64
    m, k, n = 4000, 256, 128
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16).at[3900:].set(jnp.nan)
    w = (jax.random.normal(keys[1], (64, k, n)) * k**-0.5).astype(jnp.bfloat16)
    dy = jax.random.normal(keys[2], (m, n), jnp.bfloat16).at[3900:].set(jnp.nan)
    tiles = default_mosaic_tiling(k, n, specialized=specialized)
    gs = jnp.asarray(sizes, jnp.int32)
    y = mosaic.forward(x, w, gs, tile=tiles.forward, num_sms=num_sms)
    dx = mosaic.dgrad(dy, w, gs, tile=tiles.dgrad, num_sms=num_sms)
    dw = mosaic.wgrad(x, dy, gs, tile=tiles.wgrad, num_sms=num_sms)
    assert_per_group(sizes, x, w, dy, y, dx, dw)
