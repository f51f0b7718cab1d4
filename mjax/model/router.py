"""The MoE router as pure functions, with Megatron-LM's semantics (megatron/core/transformer/moe/router.py,
moe_utils.py) and flag names: top-k routing, the load-balancing losses, the aux-loss-free expert bias, forced
balancing and expert capacity. Arrays only, no NNX; the layer is mjax/model/moe.py.

Routing (`route`), from the router logits [N, E] in --moe_router_dtype:
    softmax, --moe_router_pre_softmax   weights = the top-k of softmax(logits)        (Qwen2-MoE, OLMoE, DeepSeek-V2)
    softmax (default)                   weights = softmax of the top-k logits         (Mixtral, Qwen3-MoE)
    sigmoid                             weights = the top-k of sigmoid(logits), divided by their sum when k > 1
                                        (DeepSeek-V3); the expert bias moves the choice, never the weights
The pre-softmax flag has no effect with sigmoid (as in Megatron). --moe_router_topk_scaling_factor multiplies the
weights (DeepSeek's routed_scaling_factor). Group-limited routing (--moe_router_num_groups, --moe_router_group_topk;
DeepSeek's device/node-limited routing) first keeps the group_topk groups whose top-(topk / group_topk) scores sum
highest (Megatron), or whose top-(--moe_router_group_score_topk) scores do: 2 in DeepSeek-V3's code, 1 (the best
score) in DeepSeek-V2's.

Load-balancing losses are built from per-sequence pieces the layer returns (mjax/model/moe.py, `MoE` stats):
    router_probs_sum [..., B, E]   sum over a sequence's tokens of the aux-loss scores: softmax(logits) over all
                                   experts, or sigmoid(logits) / its sum over all experts (differentiable)
    router_topk_count [..., B, E]  how many of the sequence's tokens have e among the top-k of those scores (no
                                   expert bias, no groups; Megatron's routing map for the aux loss). No gradient.
    router_z_sum [..., B]          sum over the sequence's tokens of logsumexp(logits)^2 (differentiable)
A sequence's token count is router_topk_count.sum(-1) / topk. Every loss is Megatron's
    switch_load_balancing_loss = E * coeff / (k T^2) * sum_e probs_sum[e] * tokens[e]  ( = E * coeff * sum_e f_e P_e )
over a scope of T tokens, and each MoE layer adds its own loss (leading dims such as a stacked layers axis are
kept; the caller sums them). Megatron computes the losses per rank; with tp = cp = 1 a rank's router call sees one
micro-batch of --micro_batch_size sequences, and the per-rank losses are averaged over data-parallel ranks and
micro-batches (the gradient averaging). The scopes here are sets of sequences, never of devices, so the result does
not depend on the parallel layout:
    aux_loss          one loss per `sequences_per_group` consecutive sequences, averaged over the groups. Megatron's
                      value is sequences_per_group = --micro_batch_size (the sequences one data-parallel rank routes
                      in one call); the train step then averages over its micro-batches as Megatron does.
    seq_aux_loss      one loss per sequence (T = its tokens), averaged over sequences: Megatron's exactly.
    global_aux_loss   this micro-batch's probabilities against `mean_tokens_per_expert`, the top-k counts per
                      micro-batch averaged over the micro-batches of the step so far, this one included (Megatron's
                      global_tokens_per_expert / ga_steps, summed over all data-parallel ranks); T = this
                      micro-batch's tokens (all data-parallel ranks). This is the value Megatron logs. Megatron's
                      gradient is that value's divided by the data-parallel size d (each rank's term holds only its
                      own tokens' probabilities, and the gradients are averaged over ranks): coeff / d here matches a
                      Megatron run with d data-parallel ranks.
    z_loss            coeff * the mean over all tokens of logsumexp(logits)^2 (Megatron's z_loss_func).

Expert bias (--moe_router_enable_expert_bias, sigmoid only as in Megatron): `expert_bias_update` is Megatron's sign
rule on the kept tokens per expert of the whole global batch, applied once per step.
"""

import math

import jax
import jax.numpy as jnp
from jax import lax

from mjax.config.model import MOE_DROP_POLICIES as DROP_POLICIES
from mjax.config.model import MOE_LOAD_BALANCING_TYPES as LOAD_BALANCING_TYPES
from mjax.config.model import MOE_SCORE_FUNCTIONS as SCORE_FUNCTIONS

ROUTER_DTYPES = {"fp32": jnp.float32, "fp64": jnp.float64}
_NORM_EPS = 1e-20  # Megatron's guard on the sum of the selected sigmoid scores


def router_dtype(name: str):
    """The dtype of --moe_router_dtype: the router logits, scores, weights and losses are computed in it."""
    if name not in ROUTER_DTYPES:
        raise ValueError(f"--moe_router_dtype={name!r} is not one of {', '.join(ROUTER_DTYPES)}")
    if name == "fp64" and not jax.config.jax_enable_x64:
        raise ValueError("--moe_router_dtype=fp64 needs 64-bit JAX (JAX_ENABLE_X64=1, or "
                         "jax.config.update('jax_enable_x64', True) before anything runs); or use "
                         "--moe_router_dtype=fp32")
    return jnp.dtype(ROUTER_DTYPES[name])


def _topk(scores, topk: int, num_groups: int | None, group_topk: int | None, group_score_topk: int | None = None):
    """(values, indices) [N, k] of the top-k scores [N, E], within the best `group_topk` of `num_groups` groups,
    a group ranked by the sum of its best `group_score_topk` scores (default topk // group_topk)."""
    if not group_topk:
        return lax.top_k(scores, topk)
    n, e = scores.shape
    if not num_groups or e % num_groups or group_topk > num_groups or topk // group_topk < 1 \
            or group_topk * (e // num_groups) < topk:
        raise ValueError(f"--moe_router_num_groups={num_groups} --moe_router_group_topk={group_topk} do not fit "
                         f"{e} experts and --moe_router_topk={topk}: the groups must divide the experts, "
                         f"group_topk <= num_groups <= experts and group_topk <= topk <= experts in the kept groups")
    grouped = scores.reshape(n, num_groups, e // num_groups)  # [N, E] -> [N, G, E/G]
    group_scores = lax.top_k(grouped, group_score_topk or topk // group_topk)[0].sum(-1)  # [N, G]
    _, groups = lax.top_k(group_scores, group_topk)  # [N, group_topk]
    group_mask = jax.nn.one_hot(groups, num_groups, dtype=jnp.bool_).any(axis=1)  # [N, G]
    expert_mask = jnp.repeat(group_mask, e // num_groups, axis=1)  # [N, G] -> [N, E]
    return lax.top_k(jnp.where(expert_mask, scores, -jnp.inf), topk)


def route(logits, *, topk: int, score_function: str = "softmax", pre_softmax: bool = False,
          num_groups: int | None = None, group_topk: int | None = None, scaling_factor: float | None = None,
          expert_bias=None, group_score_topk: int | None = None):
    """Router logits [N, E] -> (weights [N, k] in the logits' dtype, experts [N, k] int32), slots ordered by
    descending choice score. `expert_bias` [E] (sigmoid only) is added to the scores for the choice and never
    reaches the weights; it gets no gradient."""
    if score_function == "softmax":
        if expert_bias is not None:
            raise ValueError("--moe_router_enable_expert_bias needs --moe_router_score_function=sigmoid (as in "
                             "Megatron-LM): softmax routing ignores the expert bias")
        if pre_softmax:
            weights, experts = _topk(jax.nn.softmax(logits, axis=-1), topk, num_groups, group_topk, group_score_topk)
        else:
            top_logits, experts = _topk(logits, topk, num_groups, group_topk, group_score_topk)
            weights = jax.nn.softmax(top_logits, axis=-1)  # [N, k]
    elif score_function == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        choice = scores if expert_bias is None else scores + lax.stop_gradient(expert_bias).astype(scores.dtype)
        _, experts = _topk(choice, topk, num_groups, group_topk, group_score_topk)
        weights = jnp.take_along_axis(scores, experts, axis=-1)  # [N, E] -> [N, k]
        if topk > 1:
            weights = weights / (weights.sum(-1, keepdims=True) + _NORM_EPS)
    else:
        raise ValueError(f"--moe_router_score_function={score_function!r} is not one of {', '.join(SCORE_FUNCTIONS)}")
    if scaling_factor:
        weights = weights * scaling_factor
    return weights.astype(logits.dtype), experts.astype(jnp.int32)


def aux_loss_scores(logits, *, topk: int, score_function: str):
    """Megatron's compute_routing_scores_for_aux_loss: (probs [N, E], top-k map [N, E] int32). probs are softmax over
    all experts, or sigmoid normalised over all experts; the map marks each token's top-k of probs (no expert bias,
    no groups, whatever the routing did)."""
    if score_function == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
    elif score_function == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        probs = scores / (scores.sum(-1, keepdims=True) + _NORM_EPS)
    else:
        raise ValueError(f"--moe_router_score_function={score_function!r} is not one of {', '.join(SCORE_FUNCTIONS)}")
    _, top = lax.top_k(probs, topk)
    topk_map = jax.nn.one_hot(top, logits.shape[-1], dtype=jnp.int32).sum(1)  # [N, k] -> [N, E]
    return probs, lax.stop_gradient(topk_map)


def z_loss_per_token(logits):
    """logsumexp(logits)^2 per token [N, E] -> [N] (ST-MoE's router z-loss, before the mean and coefficient)."""
    return jnp.square(jax.nn.logsumexp(logits, axis=-1))


def force_balanced_logits(logits, key):
    """--moe_router_force_load_balancing (Megatron's apply_random_logits, for benchmarks): the logits are replaced by
    standard-normal noise drawn from `key`, so every expert gets an equal share of the tokens in expectation, and the
    gradient passes straight through to the real logits (Megatron's RandomSTE). Megatron draws fresh noise per call
    from its RNG tracker; here the noise is a function of `key`."""
    return _straight_through(logits, jax.random.normal(key, logits.shape, logits.dtype))


@jax.custom_vjp
def _straight_through(logits, noise):  # value: noise; gradient: to logits unchanged
    return noise


_straight_through.defvjp(lambda logits, noise: (noise, None), lambda _, g: (g, None))


def switch_load_balancing_loss(probs_sum, tokens_per_expert, num_tokens, *, topk: int, coeff: float):
    """Megatron's switch_load_balancing_loss_func: E * coeff / (k * T^2) * sum_e probs_sum[e] * tokens[e] over the
    last axis (E); `tokens_per_expert` gets no gradient. probs_sum [..., E], tokens_per_expert [..., E] and
    num_tokens [...] (T) broadcast against each other."""
    num_experts = probs_sum.shape[-1]
    tokens = lax.stop_gradient(tokens_per_expert).astype(probs_sum.dtype)
    total = jnp.asarray(num_tokens, probs_sum.dtype)
    return num_experts * coeff / topk * jnp.sum(probs_sum * tokens, axis=-1) / jnp.square(total)


def _tokens(topk_count, topk: int):  # tokens of each scope [..., E] -> [...], from the top-k counts
    return topk_count.sum(-1) / topk


def aux_loss(stats, *, topk: int, coeff: float, sequences_per_group: int | None = None):
    """--moe_router_load_balancing_type=aux_loss: one switch loss per `sequences_per_group` consecutive sequences
    (None: all of them), averaged over the groups -> [...] (the leading dims of the stats)."""
    probs, counts = stats["router_probs_sum"], stats["router_topk_count"]  # [..., B, E]
    *lead, b, e = probs.shape
    s = b if sequences_per_group is None else sequences_per_group
    if s < 1 or b % s:
        raise ValueError(f"aux_loss: {b} sequences do not split into groups of {s} (sequences_per_group)")
    probs = probs.reshape(*lead, b // s, s, e).sum(-2)  # [..., B, E] -> [..., groups, E]
    counts = counts.reshape(*lead, b // s, s, e).sum(-2)
    return switch_load_balancing_loss(probs, counts, _tokens(counts, topk), topk=topk, coeff=coeff).mean(-1)


def seq_aux_loss(stats, *, topk: int, coeff: float):
    """--moe_router_load_balancing_type=seq_aux_loss: one switch loss per sequence, averaged -> [...]."""
    return aux_loss(stats, topk=topk, coeff=coeff, sequences_per_group=1)


def global_aux_loss(stats, mean_tokens_per_expert, *, topk: int, coeff: float):
    """--moe_router_load_balancing_type=global_aux_loss: this call's probabilities against `mean_tokens_per_expert`
    [..., E] (the per-micro-batch top-k counts, router_topk_count summed over sequences, averaged over the step's
    micro-batches so far, this one included) -> [...]."""
    probs, counts = stats["router_probs_sum"].sum(-2), stats["router_topk_count"].sum(-2)  # [..., B, E] -> [..., E]
    return switch_load_balancing_loss(probs, mean_tokens_per_expert, _tokens(counts, topk), topk=topk, coeff=coeff)


def z_loss(stats, *, topk: int, coeff: float):
    """--moe_z_loss_coeff: coeff * the mean over the stats' tokens of logsumexp(logits)^2 -> [...]."""
    z_sum = stats["router_z_sum"].sum(-1)  # [..., B] -> [...]
    num_tokens = _tokens(stats["router_topk_count"], topk).sum(-1)
    return coeff * z_sum / num_tokens.astype(z_sum.dtype)


def load_balancing_loss(stats, cfg, *, sequences_per_group: int | None = None, mean_tokens_per_expert=None):
    """The loss of cfg.moe_router_load_balancing_type with coefficient cfg.moe_aux_loss_coeff -> [...]; see the
    module docstring for the scopes. global_aux_loss needs `mean_tokens_per_expert`."""
    kind, topk, coeff = cfg.moe_router_load_balancing_type, cfg.moe_router_topk, cfg.moe_aux_loss_coeff
    if kind == "aux_loss":
        return aux_loss(stats, topk=topk, coeff=coeff, sequences_per_group=sequences_per_group)
    if kind == "seq_aux_loss":
        return seq_aux_loss(stats, topk=topk, coeff=coeff)
    if kind == "global_aux_loss":
        if mean_tokens_per_expert is None:
            raise ValueError("--moe_router_load_balancing_type=global_aux_loss needs mean_tokens_per_expert (the "
                             "top-k counts averaged over the step's micro-batches so far)")
        return global_aux_loss(stats, mean_tokens_per_expert, topk=topk, coeff=coeff)
    if kind == "none":
        return jnp.zeros(stats["router_probs_sum"].shape[:-2], stats["router_probs_sum"].dtype)
    raise ValueError(f"--moe_router_load_balancing_type={kind!r} is not one of {', '.join(LOAD_BALANCING_TYPES)}")


def expert_bias_update(expert_bias, tokens_per_expert, rate: float):
    """Megatron's get_updated_expert_bias (aux-loss-free balancing, arXiv 2408.15664): each expert's bias [..., E]
    moves by `rate` (--moe_router_bias_update_rate) towards equal load: up when its token count [..., E] is below the
    mean over experts, down when above, unchanged when equal. Float32, as Megatron keeps it."""
    tokens = tokens_per_expert.astype(jnp.float32)
    offset = tokens.mean(-1, keepdims=True) - tokens
    return (expert_bias.astype(jnp.float32) + jnp.sign(offset) * rate).astype(jnp.float32)


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Megatron's get_capacity for num_tokens routed top-k: ceil(num_tokens * topk / num_experts * factor)."""
    return math.ceil((num_tokens * topk) / num_experts * capacity_factor)


def assignment_order(experts, weights, priority, *, policy: str):
    """The (token, slot) assignments [A] sorted by expert, each expert's assignments in the order
    --moe_token_drop_policy keeps them: `probs`, highest weight first; `position`, lowest `priority` first (ties of
    weight also fall back to priority). Returns the permutation [A] (sorted position -> assignment)."""
    if policy == "probs":
        return jnp.lexsort((priority, -weights, experts)).astype(jnp.int32)
    if policy == "position":
        return jnp.lexsort((priority, experts)).astype(jnp.int32)
    raise ValueError(f"--moe_token_drop_policy={policy!r} is not one of {', '.join(DROP_POLICIES)}")


def inverse_permutation(order):
    """[A] sorted position -> assignment, inverted: assignment -> sorted position (a scatter of unique indices)."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype), unique_indices=True)


def rank_in_expert(experts, order, num_experts: int):
    """(starts [E], counts [E], rank [A]): where each expert's block begins in `order`, its size, and each
    assignment's place within its expert's block."""
    sorted_experts = experts[order]
    bounds = jnp.searchsorted(sorted_experts, jnp.arange(num_experts + 1, dtype=experts.dtype)).astype(jnp.int32)
    starts, counts = bounds[:-1], jnp.diff(bounds)
    return starts, counts, inverse_permutation(order) - starts[experts]


def capacity_keep(weights, experts, *, num_experts: int, capacity: int, policy: str, priority=None):
    """Which assignments [N, k] survive --moe_expert_capacity_factor: each expert keeps at most `capacity` of its
    assignments, chosen by the drop policy (see `assignment_order`; `priority` [N] defaults to token order).
    Megatron breaks ties of weight in whatever order torch.topk returns; here they go by priority."""
    n, k = experts.shape
    flat_experts = experts.reshape(-1)
    token_priority = jnp.arange(n, dtype=jnp.int32) if priority is None else priority
    order = assignment_order(flat_experts, weights.reshape(-1), jnp.repeat(token_priority, k), policy=policy)
    _, _, rank = rank_in_expert(flat_experts, order, num_experts)
    return (rank < capacity).reshape(n, k)
