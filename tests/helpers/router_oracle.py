"""NumPy float64 oracles of the MoE router, written from Megatron-LM's published formulas (shared by the
router and MoE layer tests)."""

import jax
import numpy as np


def enable_x64():
    """jax.enable_x64 (jax 0.12) or jax.experimental.enable_x64 (older)."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64 as older  # noqa: PLC0415

    return older()


def np_softmax(x):
    z = np.exp(x - x.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def np_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def np_topk(scores, k):
    """Top-k per row, descending, ties to the lower index."""
    idx = np.argsort(-scores, axis=-1, kind="stable")[:, :k]
    return np.take_along_axis(scores, idx, -1), idx


def np_group_topk(scores, k, groups, group_topk):
    """DeepSeek's group-limited top-k as Megatron documents it: keep the group_topk groups whose best
    (k / group_topk) scores sum highest, then the top-k of the kept experts."""
    n, e = scores.shape
    per = e // groups
    masked = np.full_like(scores, -np.inf)
    for i in range(n):
        sums = [np.sort(scores[i, g * per:(g + 1) * per])[::-1][:k // group_topk].sum() for g in range(groups)]
        for g in np.argsort(-np.array(sums), kind="stable")[:group_topk]:
            masked[i, g * per:(g + 1) * per] = scores[i, g * per:(g + 1) * per]
    return np_topk(masked, k)


def np_route(logits, *, topk, score_function="softmax", pre_softmax=False, num_groups=None, group_topk=None,
             scaling_factor=None, expert_bias=None):
    """(weights [N, k], experts [N, k]) in float64, from the definitions of each score function."""
    logits = np.asarray(logits, np.float64)

    def pick(scores):
        return np_group_topk(scores, topk, num_groups, group_topk) if group_topk else np_topk(scores, topk)

    if score_function == "softmax" and pre_softmax:
        weights, experts = pick(np_softmax(logits))
    elif score_function == "softmax":
        top, experts = pick(logits)
        weights = np_softmax(top)
    else:
        scores = np_sigmoid(logits)
        choice = scores if expert_bias is None else scores + np.asarray(expert_bias, np.float64)
        _, experts = pick(choice)
        weights = np.take_along_axis(scores, experts, -1)
        if topk > 1:
            weights = weights / weights.sum(-1, keepdims=True)
    if scaling_factor:
        weights = weights * scaling_factor
    return weights, experts


def np_aux_scores(logits, topk, score_function):
    logits = np.asarray(logits, np.float64)
    if score_function == "softmax":
        probs = np_softmax(logits)
    else:
        s = np_sigmoid(logits)
        probs = s / s.sum(-1, keepdims=True)
    _, top = np_topk(probs, topk)
    routed = np.zeros_like(probs)
    np.put_along_axis(routed, top, 1.0, -1)
    return probs, routed


def np_switch_loss(probs, routed, topk, coeff):
    """Switch Transformer's loss over a set of tokens, as Megatron writes it: E * coeff * sum_i f_i P_i with f_i
    the fraction of the k*T assignments routed to expert i and P_i the mean probability of expert i."""
    t, e = probs.shape
    f = routed.sum(0) / (t * topk)
    p = probs.mean(0)
    return e * coeff * np.sum(f * p)


def np_capacity_keep(weights, experts, capacity, policy, priority):
    """Per expert, its assignments ranked by the policy (probs: weight descending, then priority; position:
    priority), the first `capacity` kept."""
    n, k = experts.shape
    keep = np.zeros((n, k), bool)
    for e in np.unique(experts):
        slots = [(i, s) for i in range(n) for s in range(k) if experts[i, s] == e]
        if policy == "probs":
            slots.sort(key=lambda a: (-weights[a], priority[a[0]]))
        else:
            slots.sort(key=lambda a: priority[a[0]])
        for a in slots[:capacity]:
            keep[a] = True
    return keep
