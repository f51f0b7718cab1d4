"""On the GPU: the alltoall dispatcher's two exchanges (mjax/parallel/token_dispatcher.py) agree bitwise.

XLA:CPU has no ragged all-to-all, so the CPU suite runs the padded exchange only; here both run on every GPU
present (one rank per GPU) on random per-rank row counts, zero and full blocks included, forward and backward.

    JAX_PLATFORMS=cuda python3 -m pytest -m gpu tests/gpu -q -rs
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from mjax.parallel import token_dispatcher as td

pytestmark = pytest.mark.gpu
ROWS, D = 48, 16


def _exchange(impl, rows, sizes, ep):
    """Every rank sends sizes[me, r] of its rows to rank r and gets the rows back doubled; returns (received blocks,
    rows back, the gradient of sum(back * rows) with respect to rows)."""
    axes = ("expert",)

    def per_rank(rows, sizes):
        rows, send = rows[0], sizes[0]
        offset = jnp.cumsum(send) - send
        route = td._Route(send=send, offset=offset, recv=jax.lax.all_to_all(send, axes, 0, 0, tiled=True),
                          remote_offset=jax.lax.all_to_all(offset, axes, 0, 0, tiled=True))
        how = (axes, impl, ROWS)

        def round_trip(rows):
            blocks = td._dispatch(how, rows, route)
            return blocks, td._combine(how, blocks * 2, route)

        (blocks, back), vjp = jax.vjp(round_trip, rows)
        (grad,) = vjp((jnp.zeros_like(blocks), rows))
        return blocks[None], back[None], grad[None]

    mesh = Mesh(np.array(jax.devices()[:ep]), axes)
    run = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(P("expert"), P("expert")),
                                out_specs=(P("expert"), P("expert"), P("expert")), check_vma=False))
    return jax.device_get(run(rows, sizes))


@pytest.mark.parametrize("seed", range(3))
def test_ragged_and_padded_exchanges_agree(seed):
    ep = jax.device_count()
    rng = np.random.default_rng(seed)
    sizes = np.zeros((ep, ep), np.int32)
    for me in range(ep):  # a random split of at most ROWS rows; seed 0 sends everything to one rank
        total = ROWS if seed == 0 else int(rng.integers(0, ROWS + 1))
        sizes[me] = np.bincount(rng.integers(0, 1 if seed == 0 else ep, total), minlength=ep)
    rows = rng.standard_normal((ep, ROWS, D)).astype(np.float32)
    ragged = _exchange("ragged", rows, sizes, ep)
    padded = _exchange("padded", rows, sizes, ep)
    for a, b in zip(ragged, padded):
        np.testing.assert_array_equal(a, b)
    for me in range(ep):  # block s at rank `me`: the rows rank s sent it, in order, then zeros
        for s in range(ep):
            start, n = sizes[s, :me].sum(), sizes[s, me]
            np.testing.assert_array_equal(ragged[0][me, s, :n], rows[s, start:start + n])
            assert not ragged[0][me, s, n:].any()
    sent = sizes.sum(1)
    for me in range(ep):  # the rows that went out come back doubled, the rest (padding) zero
        np.testing.assert_array_equal(ragged[1][me, :sent[me]], 2 * rows[me, :sent[me]])
        assert not ragged[1][me, sent[me]:].any()
        np.testing.assert_array_equal(ragged[2][me, :sent[me]], 2 * rows[me, :sent[me]])  # d(back . rows)/d rows
