"""The MoE router's pure functions against NumPy float64 oracles written from Megatron-LM's published formulas."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mjax.config import ModelConfig
from mjax.model import router
from tests.helpers.router_oracle import enable_x64, np_route, np_aux_scores, np_switch_loss, np_capacity_keep

# float32 code vs float64 oracle on O(1) values: the measured difference is below 1e-6; 1e-5 leaves a margin for
# other CPUs' reduction orders.
TOL = dict(rtol=1e-5, atol=1e-6)


def _logits(seed, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)


# ---- routing ----

@pytest.mark.parametrize("score_function,pre_softmax,topk", [
    ("softmax", False, 2), ("softmax", True, 2), ("softmax", True, 1), ("sigmoid", False, 3), ("sigmoid", False, 1),
    ("sigmoid", True, 2)])
def test_route_matches_score_function_definitions(score_function, pre_softmax, topk):
    logits = _logits(0, (64, 8), 2.0)
    weights, experts = router.route(logits, topk=topk, score_function=score_function, pre_softmax=pre_softmax)
    want_w, want_e = np_route(logits, topk=topk, score_function=score_function, pre_softmax=pre_softmax)
    assert experts.dtype == jnp.int32 and weights.dtype == jnp.float32
    np.testing.assert_array_equal(experts, want_e)
    np.testing.assert_allclose(weights, want_w, **TOL)
    if score_function == "sigmoid" and topk > 1 or score_function == "softmax" and not pre_softmax:
        np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, **TOL)  # renormalised over the top-k


def test_pre_softmax_differs_from_softmax_after_topk():
    logits = _logits(1, (16, 8), 2.0)
    pre, _ = router.route(logits, topk=2, pre_softmax=True)
    post, _ = router.route(logits, topk=2, pre_softmax=False)
    assert np.all(np.asarray(pre).sum(-1) < 1.0 - 1e-3)  # pre-softmax keeps the mass of the whole softmax
    np.testing.assert_allclose(post, np.asarray(pre) / np.asarray(pre).sum(-1, keepdims=True), **TOL)


@pytest.mark.parametrize("score_function,pre_softmax", [("softmax", False), ("softmax", True), ("sigmoid", False)])
def test_group_limited_topk(score_function, pre_softmax):
    logits = _logits(2, (128, 16), 2.0)
    kw = dict(topk=4, score_function=score_function, pre_softmax=pre_softmax)
    weights, experts = router.route(logits, num_groups=4, group_topk=2, **kw)
    want_w, want_e = np_route(logits, num_groups=4, group_topk=2, **kw)
    np.testing.assert_array_equal(experts, want_e)
    np.testing.assert_allclose(weights, want_w, **TOL)
    _, unlimited = np_route(logits, **kw)
    assert (unlimited != want_e).any(axis=1).mean() > 0.2  # the group limit changes many tokens' choice
    assert all(len({int(e) // 4 for e in row}) <= 2 for row in np.asarray(experts))  # at most 2 groups per token


def test_group_limited_topk_bad_sizes():
    with pytest.raises(ValueError, match="--moe_router_num_groups"):
        router.route(_logits(0, (4, 12)), topk=2, num_groups=5, group_topk=2)


def test_scaling_factor_multiplies_weights():
    logits = _logits(3, (32, 8))
    for kw in (dict(score_function="sigmoid"), dict(pre_softmax=True)):
        base, e0 = router.route(logits, topk=2, **kw)
        scaled, e1 = router.route(logits, topk=2, scaling_factor=2.5, **kw)
        np.testing.assert_array_equal(e0, e1)
        np.testing.assert_allclose(scaled, 2.5 * np.asarray(base), **TOL)


def test_expert_bias_moves_the_choice_not_the_weights():
    logits = _logits(4, (64, 8), 2.0)
    bias = jnp.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.6, -0.6], jnp.float32)
    weights, experts = router.route(logits, topk=2, score_function="sigmoid", expert_bias=bias)
    want_w, want_e = np_route(logits, topk=2, score_function="sigmoid", expert_bias=bias)
    np.testing.assert_array_equal(experts, want_e)
    np.testing.assert_allclose(weights, want_w, **TOL)
    _, unbiased = np_route(logits, topk=2, score_function="sigmoid")
    assert (unbiased != want_e).any(), "the bias must change some choices for this test to mean anything"
    assert (np.asarray(experts) == 6).sum() > (unbiased == 6).sum() and (np.asarray(experts) == 7).sum() < (
        unbiased == 7).sum()
    grad = jax.grad(lambda b: router.route(logits, topk=2, score_function="sigmoid", expert_bias=b)[0].sum())(bias)
    np.testing.assert_array_equal(grad, 0.0)


def test_softmax_rejects_expert_bias():
    with pytest.raises(ValueError, match="--moe_router_score_function=sigmoid"):
        router.route(_logits(0, (4, 8)), topk=2, expert_bias=jnp.zeros(8))


def test_router_dtype():
    assert router.router_dtype("fp32") == jnp.float32
    with pytest.raises(ValueError, match="--moe_router_dtype"):
        router.router_dtype("bf16")
    if not jax.config.jax_enable_x64:
        with pytest.raises(ValueError, match="--moe_router_dtype=fp64"):
            router.router_dtype("fp64")
    with enable_x64():
        dtype = router.router_dtype("fp64")
        logits = jnp.asarray(np.random.default_rng(0).normal(size=(16, 8)), dtype)
        weights, experts = router.route(logits, topk=2)
        assert weights.dtype == jnp.float64
        want_w, want_e = np_route(np.asarray(logits), topk=2)
        np.testing.assert_array_equal(experts, want_e)
        np.testing.assert_allclose(weights, want_w, rtol=1e-12)  # float64 against float64


# ---- load-balancing losses ----

@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _stats(logits, b, topk, score_function):
    """The per-sequence pieces of MoE stats from logits [B*T, E]."""
    probs, topk_map = router.aux_loss_scores(logits, topk=topk, score_function=score_function)
    e = logits.shape[-1]
    return {"router_probs_sum": probs.reshape(b, -1, e).sum(1), "router_topk_count": topk_map.reshape(b, -1, e).sum(1),
            "router_z_sum": router.z_loss_per_token(logits).reshape(b, -1).sum(1)}


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_aux_loss_scores(score_function):
    logits = _logits(5, (40, 6), 2.0)
    probs, topk_map = router.aux_loss_scores(logits, topk=2, score_function=score_function)
    want_p, want_map = np_aux_scores(logits, 2, score_function)
    np.testing.assert_allclose(probs, want_p, **TOL)
    np.testing.assert_array_equal(topk_map, want_map)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_aux_loss_per_micro_batch(score_function):
    b, t, e, k, coeff = 6, 10, 8, 2, 0.01
    logits = _logits(6, (b * t, e), 2.0)
    stats = _stats(logits, b, k, score_function)
    probs, routed = np_aux_scores(logits, k, score_function)
    for group in (None, 3, 2, 1):
        s = b if group is None else group
        per_group = [np_switch_loss(probs[i * s * t:(i + 1) * s * t], routed[i * s * t:(i + 1) * s * t], k, coeff)
                     for i in range(b // s)]
        got = router.aux_loss(stats, topk=k, coeff=coeff, sequences_per_group=group)
        np.testing.assert_allclose(got, np.mean(per_group), **TOL)
    # seq_aux_loss is Megatron's per-sequence loss, averaged over the sequences
    per_seq = [np_switch_loss(probs[i * t:(i + 1) * t], routed[i * t:(i + 1) * t], k, coeff) for i in range(b)]
    np.testing.assert_allclose(router.seq_aux_loss(stats, topk=k, coeff=coeff), np.mean(per_seq), **TOL)


def test_aux_loss_perfect_balance_is_coeff():
    # Equal probabilities and equal loads give E * coeff * sum_i (1/E)(1/E) = coeff, Switch's minimum.
    stats = {"router_probs_sum": jnp.full((2, 4), 3.0), "router_topk_count": jnp.full((2, 4), 6, jnp.int32)}
    np.testing.assert_allclose(router.aux_loss(stats, topk=2, coeff=0.1), 0.1, rtol=1e-6)


def test_global_aux_loss_uses_the_given_counts():
    b, t, e, k, coeff = 4, 8, 8, 2, 0.02
    logits = _logits(7, (b * t, e), 2.0)
    stats = _stats(logits, b, k, "softmax")
    mean_counts = jnp.asarray(np.random.default_rng(1).integers(0, 20, size=e), jnp.float32)
    probs, _ = np_aux_scores(logits, k, "softmax")
    tokens = b * t  # Megatron: E * coeff / (k T^2) * sum_e P_local[e] * global_tokens_per_expert[e]
    want = e * coeff / (k * tokens * tokens) * np.sum(probs.sum(0) * np.asarray(mean_counts, np.float64))
    np.testing.assert_allclose(router.global_aux_loss(stats, mean_counts, topk=k, coeff=coeff), want, **TOL)


def test_losses_keep_leading_layer_dims():
    k, coeff = 2, 0.01
    per_layer = [_stats(_logits(10 + i, (4 * 5, 8), 2.0), 4, k, "softmax") for i in range(3)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)
    got = router.aux_loss(stacked, topk=k, coeff=coeff, sequences_per_group=2)
    assert got.shape == (3,)
    for i, stats in enumerate(per_layer):
        np.testing.assert_allclose(got[i], router.aux_loss(stats, topk=k, coeff=coeff, sequences_per_group=2),
                                   rtol=1e-6)
    assert router.z_loss(stacked, topk=k, coeff=coeff).shape == (3,)


def test_z_loss():
    b, t, e, k = 3, 7, 8, 2
    logits = _logits(8, (b * t, e), 3.0)
    stats = _stats(logits, b, k, "softmax")
    x = np.asarray(logits, np.float64)
    lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    np.testing.assert_allclose(router.z_loss(stats, topk=k, coeff=1e-3), 1e-3 * np.mean(lse ** 2), **TOL)


def test_aux_loss_gradient_flows_through_probabilities_only():
    b, t, e, k, coeff = 2, 16, 4, 2, 0.1
    logits = _logits(9, (b * t, e), 2.0)
    _, routed = np_aux_scores(logits, k, "softmax")
    f = jnp.asarray(routed.sum(0) / (b * t * k), jnp.float32)  # the loads, held constant

    def direct(lg):  # Switch's E * coeff * sum_i f_i P_i, written out
        return e * coeff * jnp.sum(f * jax.nn.softmax(lg, axis=-1).mean(0))

    got = jax.grad(lambda lg: router.aux_loss(_stats(lg, b, k, "softmax"), topk=k, coeff=coeff))(logits)
    np.testing.assert_allclose(got, jax.grad(direct)(logits), rtol=1e-5, atol=1e-8)


def test_load_balancing_loss_dispatch():
    b, k = 4, 2
    stats = _stats(_logits(11, (b * 6, 8), 2.0), b, k, "softmax")
    cfg = ModelConfig(num_experts=8, moe_router_topk=k, moe_aux_loss_coeff=0.01)
    np.testing.assert_allclose(router.load_balancing_loss(stats, cfg, sequences_per_group=2),
                               router.aux_loss(stats, topk=k, coeff=0.01, sequences_per_group=2), rtol=1e-7)
    seq = ModelConfig(num_experts=8, moe_router_topk=k, moe_aux_loss_coeff=0.01,
                      moe_router_load_balancing_type="seq_aux_loss")
    np.testing.assert_allclose(router.load_balancing_loss(stats, seq), router.seq_aux_loss(stats, topk=k, coeff=0.01),
                               rtol=1e-7)
    glob = ModelConfig(num_experts=8, moe_router_topk=k, moe_router_load_balancing_type="global_aux_loss")
    with pytest.raises(ValueError, match="mean_tokens_per_expert"):
        router.load_balancing_loss(stats, glob)
    none = ModelConfig(num_experts=8, moe_router_topk=k, moe_router_load_balancing_type="none")
    assert float(router.load_balancing_loss(stats, none)) == 0.0


# ---- expert bias, forced balance ----

def test_expert_bias_update_sign_rule():
    bias = jnp.array([[0.1, -0.2, 0.0, 0.3], [0.0, 0.0, 0.0, 0.0]], jnp.float32)
    tokens = jnp.array([[10, 2, 4, 4], [5, 5, 5, 5]], jnp.int32)  # means 5 and 5
    got = router.expert_bias_update(bias, tokens, 1e-3)
    t = np.asarray(tokens, np.float64)
    want = np.asarray(bias, np.float64) + 1e-3 * np.sign(t.mean(-1, keepdims=True) - t)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)  # float32 rounding of the sum: < 2 ulp at 0.3
    np.testing.assert_array_equal(got[1], bias[1])  # equal load: unchanged
    assert got.dtype == jnp.float32


def test_force_balancing_balances_an_imbalanced_router():
    n, e, k = 8192, 8, 2
    skewed = _logits(12, (n, e)) + jnp.array([8.0] + [0.0] * (e - 1))  # every token prefers expert 0
    _, experts = router.route(skewed, topk=k, pre_softmax=True)
    assert int((np.asarray(experts) == 0).sum()) == n
    forced = router.force_balanced_logits(skewed, jax.random.key(3))
    _, experts = router.route(forced, topk=k, pre_softmax=True)
    counts = np.bincount(np.asarray(experts).ravel(), minlength=e)
    mean = n * k / e  # each count is Binomial(n, k / E): 6 standard deviations of slack
    assert np.all(np.abs(counts - mean) < 6 * math.sqrt(n * (k / e) * (1 - k / e))), counts
    # the noise does not depend on the logits, and the gradient passes straight through to them
    np.testing.assert_array_equal(forced, router.force_balanced_logits(_logits(13, (n, e)), jax.random.key(3)))
    cot = _logits(14, (n, e))
    np.testing.assert_array_equal(jax.grad(lambda lg: jnp.sum(router.force_balanced_logits(lg, jax.random.key(3))
                                                              * cot))(skewed), cot)


# ---- capacity and drop policies ----

def test_expert_capacity_formula():
    # Megatron's get_capacity, worked by hand: ceil(tokens * topk / experts * factor)
    for (n, e, k, f), want in [((100, 8, 2, 1.0), 25), ((100, 8, 2, 1.25), 32), ((7, 3, 1, 0.5), 2),
                               ((4096, 64, 6, 1.1), 423), ((10, 10, 1, 0.05), 1)]:
        assert router.expert_capacity(n, e, k, f) == want, (n, e, k, f)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_keep_drops_what_the_policy_names(policy):
    n, e, k = 48, 6, 2
    logits = _logits(15, (n, e), 2.0) + jnp.array([1.5, 1.0, 0.0, 0.0, 0.0, 0.0])  # experts 0 and 1 overloaded
    weights, experts = router.route(logits, topk=k, pre_softmax=True)
    weights = jnp.round(weights * 10) / 10  # ties of weight, broken by priority
    priority = np.random.default_rng(2).permutation(n).astype(np.int32)
    for capacity in (router.expert_capacity(n, e, k, 0.5), router.expert_capacity(n, e, k, 1.0), 3, n):
        got = router.capacity_keep(weights, experts, num_experts=e, capacity=capacity, policy=policy,
                                   priority=jnp.asarray(priority))
        want = np_capacity_keep(np.asarray(weights), np.asarray(experts), capacity, policy, priority)
        np.testing.assert_array_equal(got, want)
    assert not np.asarray(router.capacity_keep(weights, experts, num_experts=e, capacity=3, policy=policy)).all()


def test_capacity_keep_rejects_unknown_policy():
    with pytest.raises(ValueError, match="--moe_token_drop_policy"):
        router.capacity_keep(jnp.ones((2, 1)), jnp.zeros((2, 1), jnp.int32), num_experts=2, capacity=1,
                             policy="random")
