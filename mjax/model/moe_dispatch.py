"""Token dispatch of one MoE dispatch group: the (token, slot) assignments sorted by expert into the grouped GEMM's
rows and combined back, as gathers only (the backward of each is the other's gather, so no scatter-add and no
dependence on atomics' order anywhere).

A plan maps the n*k assignments of n tokens routed top-k onto R rows, grouped by expert (group e owns rows
[row_start[e], row_start[e] + group_sizes[e])):
    dropless                  R = n*k, every assignment has a row, group_sizes = tokens per expert
    capacity                  R = n*k; each expert keeps at most `capacity` assignments (the drop policy's
                              first), group_sizes = kept counts, rows past their sum are padding
    capacity, pad_to_capacity R = E * capacity; every expert computes exactly `capacity` rows, the ones past its
                              kept count are padding (zero input, zero weight)
Within an expert the rows are in the drop policy's order (dropless: token order, as Megatron's permute).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mjax.model.router import assignment_order, rank_in_expert


class DispatchPlan(NamedTuple):
    row_token: jax.Array  # [R] int32: the token each row reads (0 on padding rows)
    row_assignment: jax.Array  # [R] int32: the assignment (token * k + slot) each row computes
    row_valid: jax.Array  # [R] bool: False on padding rows
    group_sizes: jax.Array  # [E] int32: rows per expert
    dest: jax.Array  # [n, k] int32: the row of each assignment (meaningless where not kept)
    keep: jax.Array  # [n, k] bool: False for assignments dropped over capacity
    tokens_per_expert: jax.Array  # [E] int32: routed assignments per expert, before dropping
    kept_tokens_per_expert: jax.Array  # [E] int32: after dropping


def plan_dispatch(experts, weights, *, num_experts: int, capacity: int | None = None, policy: str = "probs",
                  pad_to_capacity: bool = False, priority=None) -> DispatchPlan:
    """The plan for experts / weights [n, k] of one dispatch group. capacity None is dropless. `priority` [n]
    (lower is kept first by the position policy; default token order) only matters with a capacity."""
    n, k = experts.shape
    flat_experts = experts.reshape(-1)  # [n, k] -> [A]: assignment a = token * k + slot
    if capacity is None:
        order = jnp.argsort(flat_experts, stable=True).astype(jnp.int32)  # token order within each expert
        capacity = n
    else:
        token_priority = jnp.arange(n, dtype=jnp.int32) if priority is None else priority.astype(jnp.int32)
        order = assignment_order(flat_experts, weights.reshape(-1), jnp.repeat(token_priority, k), policy=policy)
        capacity = min(capacity, n)  # an expert gets at most one assignment per token
    starts, counts, rank = rank_in_expert(flat_experts, order, num_experts)
    kept = jnp.minimum(counts, capacity)
    group_sizes = jnp.full((num_experts,), capacity, jnp.int32) if pad_to_capacity else kept
    rows = num_experts * capacity if pad_to_capacity else n * k
    row_start = jnp.cumsum(group_sizes) - group_sizes  # [E] exclusive prefix sum
    r = jnp.arange(rows, dtype=jnp.int32)
    row_expert = jnp.clip(jnp.searchsorted(row_start, r, side="right") - 1, 0, num_experts - 1).astype(jnp.int32)
    within = r - row_start[row_expert]  # [R] place of the row in its expert's group
    row_valid = within < kept[row_expert]
    row_assignment = order[jnp.clip(starts[row_expert] + within, 0, n * k - 1)]
    row_assignment = jnp.where(row_valid, row_assignment, 0)
    keep = rank < capacity
    dest = row_start[flat_experts] + rank
    return DispatchPlan(row_token=row_assignment // k, row_assignment=row_assignment, row_valid=row_valid,
                        group_sizes=group_sizes, dest=dest.reshape(n, k), keep=keep.reshape(n, k),
                        tokens_per_expert=counts, kept_tokens_per_expert=kept)


def _masked_rows(values, index, valid):  # values [M, D] -> [len(index), D]: values[index], zero where not valid
    return jnp.where(valid[:, None], values[index], jnp.zeros((), values.dtype))


def _sum_slots(rows, dest, keep, dtype):  # rows [R, D] -> [n, D]: sum over each token's kept slots
    picked = jnp.where(keep[..., None], rows[dest].astype(dtype), jnp.zeros((), dtype))  # [n, k, D]
    return picked.sum(axis=1)


@jax.custom_vjp
def permute(x, row_token, row_valid, dest, keep):
    """x [n, D] -> rows [R, D]: each row's token (padding rows zero). The gradient sums each token's kept rows."""
    return _masked_rows(x, row_token, row_valid)


def _permute_fwd(x, row_token, row_valid, dest, keep):
    return permute(x, row_token, row_valid, dest, keep), (dest, keep, row_token, row_valid)


def _permute_bwd(res, d_rows):
    dest, keep, row_token, row_valid = res
    return _sum_slots(d_rows, dest, keep, d_rows.dtype), None, None, None, None


permute.defvjp(_permute_fwd, _permute_bwd)


@jax.custom_vjp
def unpermute(rows, dest, keep, row_token, row_valid):
    """rows [R, D] -> [n, D] float32: each token's sum over its kept slots' rows (dropped slots add nothing). The
    gradient of a row is its token's."""
    return _sum_slots(rows, dest, keep, jnp.float32)


def _unpermute_fwd(rows, dest, keep, row_token, row_valid):
    dtype_token = jnp.zeros((0,), rows.dtype)  # residuals are arrays: the rows' dtype rides on an empty one
    return unpermute(rows, dest, keep, row_token, row_valid), (dest, keep, row_token, row_valid, dtype_token)


def _unpermute_bwd(res, dy):
    dest, keep, row_token, row_valid, dtype_token = res
    return _masked_rows(dy, row_token, row_valid).astype(dtype_token.dtype), None, None, None, None


unpermute.defvjp(_unpermute_fwd, _unpermute_bwd)


def row_weights(weights, plan: DispatchPlan):
    """The routing weight [R] of each row (0 on padding rows), from weights [n, k]; differentiable, by gathers."""
    flat = weights.reshape(-1, 1)  # [n, k] -> [A, 1]: an assignment is a "token" with one slot
    return permute(flat, plan.row_assignment, plan.row_valid, plan.dest.reshape(-1, 1), plan.keep.reshape(-1, 1))[:, 0]
