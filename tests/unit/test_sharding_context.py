"""constrain never drops shardings unseen: a trace with no rules raises; single_device() and eager calls pass."""

import jax
import jax.numpy as jnp
import pytest

from mjax import sharding


def test_a_trace_without_rules_raises_and_single_device_says_it_is_meant():
    token = sharding._CONTEXT.set(None)  # as outside any context (the suite's conftest sets single_device())
    try:
        x = jnp.ones((2, 3))
        assert sharding.constrain(x, ("batch", None)) is x  # eager: nothing to lose
        with pytest.raises(RuntimeError, match="met no sharding rules.*single_device"):
            jax.jit(lambda a: sharding.constrain(a, ("batch", None)))(x)
        with sharding.single_device():
            assert jax.jit(lambda a: sharding.constrain(a, ("batch", None)) * 2)(x).sum() == 12
            assert sharding.shards("batch") == 1 and sharding.splits_evenly("batch", 3)
    finally:
        sharding._CONTEXT.reset(token)
