"""The Pallas kernel under a mesh runs per shard (no gather) and equals the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from mjax.kernels.attention import dot_product_attention, reference_attention
from mjax.sharding import logical_sharding
from mjax.parallel.mesh import make_mesh
from mjax.parallel.rules import logical_rules
from tests.train_utils import tiny_config


@pytest.mark.parametrize("tp, kv_heads", [(2, 2), (4, 2), (1, 1)])
def test_pallas_attention_per_shard_equals_reference(tp, kv_heads):
    cfg = tiny_config(parallel=dict(tp=tp))
    mesh = make_mesh(cfg)
    keys = jax.random.split(jax.random.key(tp), 4)
    b, t, n, h = 8, 32, 4, 16
    q = jax.random.normal(keys[0], (b, t, n, h))
    k = jax.random.normal(keys[1], (b, t, kv_heads, h))
    v = jax.random.normal(keys[2], (b, t, kv_heads, h))
    seg = jnp.asarray(np.repeat(np.array([[1] * 20 + [2] * 12]), b, 0), jnp.int32)
    want_out, want_lse = reference_attention(q, k, v, segment_ids=seg, return_lse=True)
    with logical_sharding(mesh, logical_rules(cfg)):
        f = jax.jit(lambda q, k, v, s: dot_product_attention(q, k, v, segment_ids=s, impl="pallas", return_lse=True))
        batch = NamedSharding(mesh, P(("data", "fsdp", "expert")))
        hlo = f.lower(q, k, v, seg).compile().as_text()
        out, lse = f(jax.device_put(q, batch), k, v, seg)
    np.testing.assert_allclose(out, want_out, atol=2e-5)
    np.testing.assert_allclose(lse, want_lse, atol=2e-5)
    assert "all-gather" not in hlo  # each shard attends over its own rows and heads
