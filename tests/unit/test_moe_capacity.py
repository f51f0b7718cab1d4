"""Dispatch groups and capacity mode of the MoE layer: dropless results do not depend on how the batch is split
into dispatch groups, and capacity mode drops exactly the assignments its policy names (per-token NumPy oracle)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from mjax.model import moe as moe_module
from mjax.model.moe_dispatch import plan_dispatch
from mjax.sharding import logical_sharding
from tests.helpers.moe_oracle import (T, D, E, make_cfg, make_moe, call, params_of, inputs, np64, np_routing, np_moe,
                                      np_keep)

# float32 layer vs float64 oracle, O(1) activations and D, F <= 32: measured differences stay below 2e-6.
TOL = dict(rtol=2e-5, atol=2e-5)


# ---- dispatch groups ----

def _with_groups(monkeypatch, groups, m, x):
    monkeypatch.setattr(moe_module, "shards", lambda name: groups if name == "batch" else 1)
    return call(m, x)


def test_dropless_result_does_not_depend_on_dispatch_groups(monkeypatch):
    cfg = make_cfg(moe_shared_expert_intermediate_size=24)
    m = make_moe(cfg)
    x = inputs()
    y1, s1 = _with_groups(monkeypatch, 1, m, x)
    for groups in (2, 4):
        yg, sg = _with_groups(monkeypatch, groups, m, x)
        np.testing.assert_allclose(yg, y1, rtol=1e-6, atol=1e-6)  # same rows, other GEMM batching
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), sg, s1)
    y3, _ = _with_groups(monkeypatch, 3, m, x)  # 4 sequences do not split in 3: one group, same result
    np.testing.assert_allclose(y3, y1, rtol=1e-6, atol=1e-6)


def test_dispatch_groups_under_a_mesh():
    cfg = make_cfg()
    m = make_moe(cfg)
    x = inputs(shape=(8, T, D))
    y1, _ = call(m, x)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "tensor"))
    rules = {"batch": ("data",), "mlp": ("tensor",), "embed": (), "act_embed": (), "seq": (), "experts": ()}
    graphdef, state = nnx.split(m)
    with logical_sharding(mesh, rules):  # the rules are read while tracing: call() traces a fresh function
        jaxpr = str(jax.make_jaxpr(lambda state, x: nnx.merge(graphdef, state)(x))(state, x))
        assert f"f32[4,{2 * T},{D}]" in jaxpr  # 4 dispatch groups of 2 sequences
        y4, _ = call(m, x)
    np.testing.assert_allclose(y4, y1, rtol=1e-6, atol=1e-6)


# ---- capacity ----

@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("groups", [1, 2])
def test_capacity_mode_matches_oracle_with_drops(monkeypatch, policy, pad, groups):
    cfg = make_cfg(moe_expert_capacity_factor=0.75, moe_token_drop_policy=policy,
                   moe_pad_expert_input_to_capacity=pad, moe_shared_expert_intermediate_size=24)
    m = make_moe(cfg, seed=5)
    x = inputs(6)
    y, stats = _with_groups(monkeypatch, groups, m, x)
    keep = np_keep(params_of(m), x, cfg, groups)
    assert not keep.all()  # the capacity drops something
    np.testing.assert_allclose(y, np_moe(params_of(m), x, cfg, keep=keep), **TOL)
    assert int(stats["dropped_assignments"]) == int((~keep).sum())
    _, _, _, experts = np_routing(np64(params_of(m)), x, cfg)
    np.testing.assert_array_equal(stats["kept_tokens_per_expert"], np.bincount(experts[keep], minlength=E))
    np.testing.assert_array_equal(stats["tokens_per_expert"], np.bincount(experts.ravel(), minlength=E))


def test_capacity_with_batch_not_divisible_by_shards(monkeypatch):
    m = make_moe(make_cfg(moe_expert_capacity_factor=1.0))
    with pytest.raises(ValueError, match="--moe_expert_capacity_factor"):
        _with_groups(monkeypatch, 3, m, inputs())


def test_pad_to_capacity_plan_computes_capacity_rows_per_expert():
    n, k, capacity = 12, 2, 5
    experts = jnp.asarray(np.random.default_rng(3).integers(0, E, size=(n, k)), jnp.int32)
    experts = experts.at[:, 1].set((experts[:, 0] + 1) % E)  # distinct experts per token
    weights = jnp.asarray(np.random.default_rng(4).random((n, k)), jnp.float32)
    padded = plan_dispatch(experts, weights, num_experts=E, capacity=capacity, pad_to_capacity=True)
    assert padded.row_token.shape == (E * capacity,)
    np.testing.assert_array_equal(padded.group_sizes, [capacity] * E)
    kept = np.minimum(np.bincount(np.asarray(experts).ravel(), minlength=E), capacity)
    np.testing.assert_array_equal(np.asarray(padded.row_valid).reshape(E, capacity).sum(1), kept)
    plain = plan_dispatch(experts, weights, num_experts=E, capacity=capacity)
    np.testing.assert_array_equal(plain.group_sizes, kept)
    np.testing.assert_array_equal(padded.keep, plain.keep)
