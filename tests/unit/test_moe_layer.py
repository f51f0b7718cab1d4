"""The MoE layer against a per-token NumPy float64 loop over each token's chosen experts (forward) and against
jax.grad of a dense pure-JAX layer that runs every expert on every token with masks (gradients); its parameters,
options and errors (tests/helpers/moe_oracle.py has both references)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mjax.config import ExecutionConfig
from mjax.model import router
from mjax.model.moe import MoE
from tests.helpers.router_oracle import enable_x64, np_sigmoid
from tests.helpers.moe_oracle import (B, T, D, F, E, make_cfg, make_moe, call, params_of, inputs, np64, np_routing,
                                      np_moe, dense_reference)

# float32 layer vs float64 oracle, O(1) activations and D, F <= 32: measured differences stay below 2e-6.
TOL = dict(rtol=2e-5, atol=2e-5)


# ---- forward ----

@pytest.mark.parametrize("kw", [
    dict(),
    dict(moe_router_pre_softmax=True, moe_router_topk_scaling_factor=1.5),
    dict(moe_router_score_function="sigmoid", moe_router_topk=3),
    dict(moe_router_topk=1, moe_router_pre_softmax=True),
    dict(moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True),
    dict(moe_shared_expert_intermediate_size=24),
    dict(activation="gelu"),
], ids=["softmax", "pre_softmax_scaled", "sigmoid_top3", "top1", "shared_gated", "shared", "gelu"])
def test_dropless_forward_matches_per_token_loop(kw):
    cfg = make_cfg(**kw)
    m = make_moe(cfg)
    x = inputs()
    y, stats = call(m, x)
    assert y.shape == x.shape and y.dtype == jnp.float32
    np.testing.assert_allclose(y, np_moe(params_of(m), x, cfg), **TOL)
    _, _, _, experts = np_routing(np64(params_of(m)), x, cfg)
    np.testing.assert_array_equal(stats["tokens_per_expert"], np.bincount(experts.ravel(), minlength=E))
    np.testing.assert_array_equal(stats["kept_tokens_per_expert"], stats["tokens_per_expert"])
    assert int(stats["dropped_assignments"]) == 0


def test_group_limited_routing_layer():
    cfg = make_cfg(num_experts=8, moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2,
                   moe_router_pre_softmax=True)
    m = MoE(cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(3))
    x = inputs(4)
    y, _ = call(m, x)
    np.testing.assert_allclose(y, np_moe(params_of(m), x, cfg), **TOL)


def test_stats_pieces():
    cfg = make_cfg(moe_router_score_function="sigmoid")
    m = make_moe(cfg)
    x = inputs()
    _, stats = call(m, x)
    _, logits, _, _ = np_routing(np64(params_of(m)), x, cfg)
    s = np_sigmoid(logits)
    probs = s / s.sum(-1, keepdims=True)
    top = np.argsort(-probs, -1, kind="stable")[:, :2]
    counts = np.zeros_like(probs)
    np.put_along_axis(counts, top, 1.0, -1)
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(stats["router_probs_sum"], probs.reshape(B, T, E).sum(1), **TOL)
    np.testing.assert_array_equal(stats["router_topk_count"], counts.reshape(B, T, E).sum(1))
    np.testing.assert_allclose(stats["router_z_sum"], (lse ** 2).reshape(B, T).sum(1), **TOL)
    assert stats["router_topk_count"].dtype == jnp.int32 and stats["tokens_per_expert"].shape == (E,)


@pytest.mark.slow  # interpreted Pallas: ~18 s on 2 cores
def test_pallas_grouped_gemm_forward_and_gradients():
    cfg = make_cfg(moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True)
    m = make_moe(cfg, execution=ExecutionConfig(moe_grouped_gemm_impl="pallas"))  # interpreted off GPU
    x = inputs()
    y, _ = call(m, x)
    np.testing.assert_allclose(y, np_moe(params_of(m), x, cfg), **TOL)
    _assert_grads_match(_grads(m, x, cfg), _reference_grads(m, x, cfg))


def test_bf16_forward():
    cfg = make_cfg(moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True)
    m = make_moe(cfg, dtype=jnp.bfloat16)
    x = inputs().astype(jnp.bfloat16)
    y, _ = call(m, x)
    assert y.dtype == jnp.bfloat16
    want = np_moe(params_of(m), np.asarray(x.astype(jnp.float32)), cfg)  # the router sees the same bf16 inputs
    # bf16 operands and outputs (8 mantissa bits) through two GEMMs: errors of a few 2^-8 of the output scale
    err = np.abs(np.asarray(y, np.float64) - want).max() / np.abs(want).max()
    assert err < 3e-2, err


def test_an_expert_without_tokens_and_all_tokens_on_one_expert():
    x = jnp.abs(inputs())  # positive inputs: the signs of the router columns decide
    cfg = make_cfg()
    m = make_moe(cfg)
    kernel = np.asarray(m.router.kernel[...]).copy()
    kernel[:, 3] = -1.0  # expert 3 never wins
    m.router.kernel[...] = jnp.asarray(kernel)
    y, stats = call(m, x)
    assert int(stats["tokens_per_expert"][3]) == 0
    np.testing.assert_allclose(y, np_moe(params_of(m), x, cfg), **TOL)
    grads = _grads(m, x, cfg)
    np.testing.assert_array_equal(grads[0]["experts"]["up_proj"]["kernel"][3], 0.0)
    _assert_grads_match(grads, _reference_grads(m, x, cfg))

    top1 = make_cfg(moe_router_topk=1, moe_router_pre_softmax=True)
    m1 = make_moe(top1)
    kernel = -np.ones((D, E), np.float32)
    kernel[:, 1] = 1.0  # every token routes to expert 1
    m1.router.kernel[...] = jnp.asarray(kernel)
    y1, stats1 = call(m1, x)
    np.testing.assert_array_equal(stats1["tokens_per_expert"], [0, B * T, 0, 0])
    np.testing.assert_allclose(y1, np_moe(params_of(m1), x, top1), **TOL)


# ---- gradients ----

AUX, Z = 0.05, 0.01


def _loss_parts(y, cot):
    return jnp.sum(y.astype(jnp.float32) * cot)


def _grads(m, x, cfg):
    graphdef, state = nnx.split(m)
    cot = inputs(9)

    def loss(state, x):
        y, stats = nnx.merge(graphdef, state)(x)
        aux = router.aux_loss(stats, topk=cfg.moe_router_topk, coeff=AUX, sequences_per_group=2)
        return _loss_parts(y, cot) + aux + router.z_loss(stats, topk=cfg.moe_router_topk, coeff=Z)

    g_state, g_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(state, x)
    return nnx.to_pure_dict(g_state), g_x


def _reference_grads(m, x, cfg):
    cot = inputs(9)

    def loss(p, x):
        y, extra = dense_reference(p, x, cfg, AUX, Z)
        return _loss_parts(y, cot) + extra

    return jax.jit(jax.grad(loss, argnums=(0, 1)))(params_of(m), x)


def _assert_grads_match(got, want):
    (g_params, g_x), (w_params, w_x) = got, want
    # both float32, same math in another order: measured differences below 1e-6 of the largest gradient entry
    np.testing.assert_allclose(g_x, w_x, rtol=1e-4, atol=1e-5)
    flat_got = dict(jax.tree_util.tree_flatten_with_path(g_params)[0])
    flat_want = dict(jax.tree_util.tree_flatten_with_path(w_params)[0])
    assert flat_got.keys() == flat_want.keys()
    for path, value in flat_want.items():
        scale = max(float(np.abs(value).max()), 1e-3)
        np.testing.assert_allclose(flat_got[path], value, rtol=1e-4, atol=1e-5 * scale, err_msg=str(path))


def test_gradients_match_dense_reference():
    cfg = make_cfg(moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True)
    m = make_moe(cfg)
    x = inputs()
    got = _grads(m, x, cfg)
    assert float(np.abs(got[0]["router"]["kernel"]).max()) > 0
    _assert_grads_match(got, _reference_grads(m, x, cfg))


def test_selective_remat_keeps_gradients():
    cfg = make_cfg()
    m = make_moe(cfg)
    graphdef, state = nnx.split(m)
    x = inputs()

    def loss(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x)[0] ** 2)

    policy = jax.checkpoint_policies.save_only_these_names("moe_up", "moe_down", "moe_router_logits")
    plain = jax.jit(jax.grad(loss))(state, x)
    remat = jax.jit(jax.grad(jax.checkpoint(loss, policy=policy)))(state, x)
    # the recomputed forward runs in another fusion: differences of a few 1e-6 relative were measured
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-5 * float(np.abs(b).max())),
                 plain, remat)
    jaxpr = str(jax.make_jaxpr(loss)(state, x))
    for name in ("moe_router_logits", "moe_dispatch", "moe_up", "moe_hidden", "moe_down", "moe_out"):
        assert f"name={name}" in jaxpr, name




# ---- parameters, options and errors ----

def test_parameter_tree():
    cfg = make_cfg(moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True,
                   moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    m = make_moe(cfg)
    state = nnx.state(m, nnx.Param)
    shapes = jax.tree.map(lambda v: v.shape, nnx.to_pure_dict(state))
    axes = nnx.to_pure_dict(jax.tree.map(lambda v: v.get_metadata()["logical_axes"], state,
                                         is_leaf=lambda v: isinstance(v, nnx.Variable)))
    assert shapes["router"] == {"kernel": (D, E), "expert_bias": (E,)}
    assert axes["router"] == {"kernel": ("embed", None), "expert_bias": (None,)}
    for name, shape, ax in [("gate_proj", (E, D, F), ("experts", "embed", "expert_mlp")),
                            ("up_proj", (E, D, F), ("experts", "embed", "expert_mlp")),
                            ("down_proj", (E, F, D), ("experts", "expert_mlp", "embed"))]:
        assert shapes["experts"][name] == {"kernel": shape} and axes["experts"][name] == {"kernel": ax}
    assert shapes["shared_experts"]["up_proj"]["kernel"] == (D, 24)
    assert shapes["shared_expert_gate"] == {"kernel": (D, 1)}
    assert m.router.expert_bias[...].dtype == jnp.float32
    gelu = nnx.to_pure_dict(nnx.state(make_moe(make_cfg(activation="gelu")), nnx.Param))
    assert set(gelu["experts"]) == {"up_proj", "down_proj"} and set(gelu) == {"router", "experts"}


def test_initialisation_scales():
    cfg = make_cfg(num_experts=8, moe_ffn_hidden_size=64, hidden_size=32, num_layers=8, init_method_std=0.02)
    p = params_of(MoE(cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0)))
    # 16k samples per kernel: the sample std is within 2% of the true one; 10% is a loose bound
    np.testing.assert_allclose(np.std(p["experts"]["up_proj"]["kernel"]), 0.02, rtol=0.1)
    np.testing.assert_allclose(np.std(p["experts"]["down_proj"]["kernel"]), 0.02 / np.sqrt(16), rtol=0.1)


def test_expert_bias_routes_but_gets_no_gradient():
    cfg = make_cfg(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    m = make_moe(cfg)
    x = inputs()
    _, stats = call(m, x)
    m.router.expert_bias[...] = jnp.array([2.0, 0.0, 0.0, 0.0])  # sigmoid scores are < 1: expert 0 always wins
    y, biased = call(m, x)
    assert int(biased["tokens_per_expert"][0]) == B * T != int(stats["tokens_per_expert"][0])
    np.testing.assert_allclose(y, np_moe(params_of(m), x, cfg), **TOL)
    graphdef, state = nnx.split(m)
    g = jax.jit(jax.grad(lambda s: jnp.sum(nnx.merge(graphdef, s)(x)[0] ** 2)))(state)
    np.testing.assert_array_equal(g["router"]["expert_bias"][...], 0.0)


def test_fp64_router():
    cfg = make_cfg(moe_router_dtype="fp64")
    if not jax.config.jax_enable_x64:
        with pytest.raises(ValueError, match="--moe_router_dtype=fp64"):
            make_moe(cfg)
    with enable_x64():
        m = make_moe(cfg)
        x = inputs()
        y, stats = call(m, x)
        assert stats["router_probs_sum"].dtype == jnp.float64 and y.dtype == jnp.float32
        np.testing.assert_allclose(y, np_moe(params_of(m), x, cfg), **TOL)


def test_force_load_balancing_needs_a_key():
    cfg = make_cfg(moe_router_force_load_balancing=True)
    m = make_moe(cfg)
    x = inputs(shape=(8, 64, D))
    with pytest.raises(ValueError, match="--moe_router_force_load_balancing"):
        call(m, x)
    _, a = call(m, x, key=jax.random.key(0))
    _, b = call(m, x, key=jax.random.key(1))
    assert int(a["tokens_per_expert"].sum()) == 8 * 64 * 2
    assert (np.asarray(a["tokens_per_expert"]) != np.asarray(b["tokens_per_expert"])).any()


@pytest.mark.parametrize("kw,flag", [
    (dict(moe_router_enable_expert_bias=True), "--moe_router_score_function=sigmoid"),
    (dict(moe_shared_expert_gate=True), "--moe_shared_expert_intermediate_size"),
    (dict(moe_pad_expert_input_to_capacity=True), "--moe_expert_capacity_factor"),
    (dict(moe_token_drop_policy="random", moe_expert_capacity_factor=1.0), "--moe_token_drop_policy"),
    (dict(moe_router_topk=5), "--moe_router_topk"),
    (dict(add_bias_linear=True), "--add_bias_linear"),
])
def test_bad_options_name_the_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        make_moe(make_cfg(**kw))


def test_precision_policy_is_rejected():
    with pytest.raises(ValueError, match="--fp8_recipe"):
        MoE(make_cfg(), dtype=jnp.float32, param_dtype=jnp.float32, quant=object(), rngs=nnx.Rngs(0))
