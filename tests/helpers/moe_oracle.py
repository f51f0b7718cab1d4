"""The MoE layer's references: a per-token NumPy float64 loop over each token's chosen experts (forward, drops)
and a dense pure-JAX layer that runs every expert on every token with masks (gradients); builders of small layers."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from mjax.config import ModelConfig
from mjax.model import router
from mjax.model.moe import MoE
from tests.helpers.router_oracle import np_capacity_keep, np_route, np_sigmoid

B, T, D, F, E = 4, 6, 16, 32, 4


def make_cfg(**kw):
    base = dict(hidden_size=D, ffn_hidden_size=64, num_layers=2, num_experts=E, moe_ffn_hidden_size=F,
                moe_router_topk=2, init_method_std=0.3)
    return ModelConfig(**{**base, **kw})


def make_moe(cfg, seed=0, dtype=jnp.float32, execution=None):
    return MoE(cfg, dtype=dtype, param_dtype=jnp.float32, execution=execution, rngs=nnx.Rngs(seed))


def call(m, x, key=None):
    """m(x, key=key) compiled as one program (much faster than op-by-op on CPU)."""
    graphdef, state = nnx.split(m)
    return jax.jit(lambda state, x, key: nnx.merge(graphdef, state)(x, key=key))(state, x, key)


def params_of(m):
    return nnx.to_pure_dict(nnx.state(m, nnx.Param))


def inputs(seed=1, shape=(B, T, D)):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def route_kwargs(cfg):
    return dict(topk=cfg.moe_router_topk, score_function=cfg.moe_router_score_function,
                pre_softmax=cfg.moe_router_pre_softmax, num_groups=cfg.moe_router_num_groups,
                group_topk=cfg.moe_router_group_topk, scaling_factor=cfg.moe_router_topk_scaling_factor)


# ---- the NumPy float64 oracle ----

def np_silu(x):
    return x * np_sigmoid(x)


def np_gelu(x):  # tanh approximation
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def np64(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def np_routing(p, x, cfg):
    """(x [N, D], logits, weights [N, k], experts [N, k]) in float64; asserts no near-tie at the top-k boundary, so
    float32 routing cannot choose differently."""
    x = np.asarray(x, np.float64).reshape(-1, D)
    logits = x @ p["router"]["kernel"]
    bias = p["router"].get("expert_bias")
    weights, experts = np_route(logits, expert_bias=bias, **route_kwargs(cfg))
    if not cfg.moe_router_group_topk:
        choice = np_sigmoid(logits) + (0 if bias is None else bias) if cfg.moe_router_score_function == "sigmoid" \
            else logits
        ranked = np.sort(choice, -1)[:, ::-1]
        k = cfg.moe_router_topk
        if k < ranked.shape[1]:
            assert (ranked[:, k - 1] - ranked[:, k]).min() > 1e-4, "near-tie in the routing: pick another seed"
    return x, logits, weights, experts


def np_expert(p, x, e, gated):
    ex = p["experts"]
    if gated:
        h = np_silu(x @ ex["gate_proj"]["kernel"][e]) * (x @ ex["up_proj"]["kernel"][e])
    else:
        h = np_gelu(x @ ex["up_proj"]["kernel"][e])
    return h @ ex["down_proj"]["kernel"][e]


def np_shared(p, x):
    if "shared_experts" not in p:
        return 0.0
    s = p["shared_experts"]
    y = (np_silu(x @ s["gate_proj"]["kernel"]) * (x @ s["up_proj"]["kernel"])) @ s["down_proj"]["kernel"]
    if "shared_expert_gate" in p:
        y = y * np_sigmoid(x @ p["shared_expert_gate"]["kernel"])
    return y


def np_moe(params, x_in, cfg, keep=None):
    """y [B, T, D]: for each token, the sum over its (kept) slots of weight * expert(token), plus shared experts."""
    p = np64(params)
    x, _, weights, experts = np_routing(p, x_in, cfg)
    gated = cfg.activation == "swiglu"
    y = np.zeros_like(x)
    for i in range(x.shape[0]):
        for s in range(experts.shape[1]):
            if keep is None or keep[i, s]:
                y[i] += weights[i, s] * np_expert(p, x[i], experts[i, s], gated)
    return (y + np_shared(p, x)).reshape(np.shape(x_in))


def np_keep(params, x_in, cfg, groups):
    """The assignments the drop policy keeps, per dispatch group of B / groups whole sequences (capacity from
    Megatron's formula over the group's tokens; position priority = position in the sequence, then sequence)."""
    p = np64(params)
    _, _, weights, experts = np_routing(p, x_in, cfg)
    b, t = np.shape(x_in)[:2]
    bg, n, k = b // groups, b // groups * t, cfg.moe_router_topk
    capacity = router.expert_capacity(n, cfg.num_experts, k, cfg.moe_expert_capacity_factor)
    keep = np.zeros(experts.shape, bool)
    for g in range(groups):
        sl = slice(g * n, (g + 1) * n)
        i = np.arange(n)
        priority = (i % t) * bg + i // t
        keep[sl] = np_capacity_keep(weights[sl], experts[sl], capacity, cfg.moe_token_drop_policy, priority)
    return keep


# ---- the dense pure-JAX reference (every expert on every token, masked) ----

def dense_reference(p, x, cfg, aux_coeff, z_coeff):
    """(y [B, T, D], aux loss + z-loss) for softmax routing, top-k then softmax, dropless."""
    xf = x.reshape(-1, D)
    k = cfg.moe_router_topk
    logits = jnp.dot(xf, p["router"]["kernel"], precision=lax.Precision.HIGHEST)
    top, idx = lax.top_k(logits, k)
    w = jax.nn.softmax(top, axis=-1)
    combine = sum(jax.nn.one_hot(idx[:, s], E) * w[:, s:s + 1] for s in range(k))  # [N, E]
    ex = p["experts"]
    y = jnp.zeros_like(xf)
    for e in range(E):
        h = jax.nn.silu(xf @ ex["gate_proj"]["kernel"][e]) * (xf @ ex["up_proj"]["kernel"][e])
        y = y + combine[:, e:e + 1] * (h @ ex["down_proj"]["kernel"][e])
    if "shared_experts" in p:
        s = p["shared_experts"]
        shared = (jax.nn.silu(xf @ s["gate_proj"]["kernel"]) * (xf @ s["up_proj"]["kernel"])) @ s["down_proj"]["kernel"]
        y = y + shared * jax.nn.sigmoid(xf @ p["shared_expert_gate"]["kernel"])
    probs = jax.nn.softmax(logits, axis=-1)
    loads = lax.stop_gradient(sum(jax.nn.one_hot(lax.top_k(probs, k)[1][:, s], E) for s in range(k)))  # [N, E]
    aux = 0.0
    groups = x.shape[0] // 2  # aux_loss per 2-sequence group, averaged over the groups
    for g in range(groups):
        sl = slice(g * 2 * x.shape[1], (g + 1) * 2 * x.shape[1])
        f = loads[sl].sum(0) / (loads[sl].shape[0] * k)
        aux = aux + E * aux_coeff * jnp.sum(f * probs[sl].mean(0)) / groups
    z = z_coeff * jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    return y.reshape(x.shape), aux + z
