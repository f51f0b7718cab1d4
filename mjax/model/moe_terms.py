"""What training does with the MoE layers' statistics (mjax/model/moe.py): the load-balancing and router z-loss terms
of the objective, the step's router metrics, and the aux-loss-free expert-bias update (used by the train step and
the pipeline stages).

Every MoE layer adds its own losses (mjax/model/router.py); the step adds their sum over layers, for each micro-batch,
divided by the number of micro-batches (Megatron scales each micro-batch's aux loss by 1 / num_microbatches). The
aux_loss scope is the whole micro-batch of the step (all data-parallel shards), so results do not depend on the
layout; Megatron's per-rank aux_loss equals it with one data-parallel rank.
"""

import jax
import jax.numpy as jnp

from mjax.model import router


def zero_counts(stats_shape) -> jax.Array:
    """The running sum of per-micro-batch top-k counts [MoE layers, E] global_aux_loss averages."""
    return jnp.zeros(stats_shape, jnp.float32)


def objective(stats: dict, model_cfg, counts_so_far, micro_index) -> tuple[jax.Array, jax.Array, dict]:
    """(the micro-batch's MoE terms: aux + z-loss summed over layers, the running counts with this micro-batch's,
    the step sums this micro-batch contributes to: aux, z, routed and kept tokens per expert, dropped)."""
    counts = stats["router_topk_count"].sum(-2).astype(jnp.float32)  # [L, B, E] -> [L, E]
    counts_so_far = counts_so_far + counts
    mean = counts_so_far / (micro_index + 1).astype(jnp.float32)
    aux = router.load_balancing_loss(stats, model_cfg, mean_tokens_per_expert=mean).sum()  # [L] -> []
    z = router.z_loss(stats, topk=model_cfg.moe_router_topk, coeff=model_cfg.moe_z_loss_coeff).sum()
    sums = {"moe_aux_loss": jax.lax.stop_gradient(aux), "moe_z_loss": jax.lax.stop_gradient(z),
            "tokens_per_expert": stats["tokens_per_expert"].astype(jnp.float32),  # [L, E]
            "kept_tokens_per_expert": stats["kept_tokens_per_expert"].astype(jnp.float32),
            "dropped_assignments": stats["dropped_assignments"].sum().astype(jnp.float32)}
    return aux + z, counts_so_far, sums


def concat_sums(first: dict, second: dict) -> dict:
    """The step sums of two groups of MoE layers as those of one: per-layer counts [L, E] concatenated (the first
    group's layers first), scalars added; either may be {} (no MoE layers)."""
    if not (first and second):
        return first or second
    return {k: jnp.concatenate([first[k], second[k]]) if first[k].ndim else first[k] + second[k] for k in first}


def metrics(sums: dict, num_micro: int) -> dict:
    """The step's router metrics from the summed micro-batch sums: the MoE loss terms (mean over micro-batches, as
    added to the objective), the busiest and idlest expert's load relative to an even share (1.0 = balanced; the
    extreme over layers), and the fraction of routed assignments dropped over capacity."""
    tokens = sums["tokens_per_expert"]  # [L, E]
    share = jnp.maximum(tokens.mean(-1, keepdims=True), 1e-9)
    return {"moe_aux_loss": sums["moe_aux_loss"] / num_micro, "moe_z_loss": sums["moe_z_loss"] / num_micro,
            "moe_load_max": jnp.max(tokens / share), "moe_load_min": jnp.min(tokens / share),
            "moe_dropped_fraction": sums["dropped_assignments"] / jnp.maximum(tokens.sum(), 1.0)}


def update_expert_bias(params: dict, kept_tokens_per_expert, model_cfg) -> dict:
    """params with every MoE layer's router/expert_bias [L, E] moved by Megatron's sign rule towards equal load over
    the whole step's kept tokens (a no-op without --moe_router_enable_expert_bias)."""
    if not model_cfg.moe_router_enable_expert_bias:
        return params
    r = params["moe_layers"]["mlp"]["router"]
    bias = router.expert_bias_update(r["expert_bias"], kept_tokens_per_expert, model_cfg.moe_router_bias_update_rate)
    moe = {**params["moe_layers"], "mlp": {**params["moe_layers"]["mlp"], "router": {**r, "expert_bias": bias}}}
    return {**params, "moe_layers": moe}


def router_keys(rng, step, micro_index, num_moe_layers: int):
    """--moe_router_force_load_balancing: fresh router noise for each step, micro-batch and MoE layer."""
    return jax.random.split(jax.random.fold_in(jax.random.fold_in(rng, step), micro_index), num_moe_layers)
