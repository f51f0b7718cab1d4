"""What training does with multi-token prediction (mjax/model/mtp.py): each depth's inputs, targets and loss mask,
the depths' losses, their share of the objective and their metrics.

Depth k at position t reads the token t + k and predicts the token t + k + 1 (the batch's target at t + k), as
Megatron rolls input ids, labels and the loss mask left by one per depth. A position has no depth-k target, and its
mask is 0, where t + k is past the sequence (Megatron's roll fills zeros there) or, when documents are kept apart
(--reset_attention_mask: segment ids reach attention), where the token t + k belongs to another document than t
(Megatron's roll of packed sequences stops at each sequence's end); elsewhere the mask is the batch's at t + k.

Under context parallelism the batch arrives in the load-balanced token order (mjax.parallel.context_parallel), so
"k ahead" is a fixed permutation of the sequence axis: a gather of the [B, T] integer arrays by a constant index,
whatever the order. The hidden states are never shifted.

Each depth's loss is its masked cross-entropy summed over the step's tokens divided by its own mask's sum
(Megatron's per-depth num_tokens); the objective adds --mtp_loss_scaling_factor times their mean over depths. The
z-loss (--z_loss_coeff) applies to the model's head only, as Megatron's MTP loss is the plain cross-entropy.
"""

import jax
import jax.numpy as jnp
import numpy as np

from mjax.kernels import cross_entropy
from mjax.model import router
from mjax.parallel.context_parallel import load_balance_order
from mjax.sharding import constrain


def ahead_index(seq_length: int, cp: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(index [T], valid [T]): in the batch's token order (load-balanced when cp > 1), the slot holding the token k
    positions after each slot's token, and whether that token is inside the sequence."""
    order = load_balance_order(seq_length, cp) if cp > 1 else np.arange(seq_length)  # slot -> position
    slot = np.argsort(order)  # position -> slot
    ahead = order + k
    return slot[np.minimum(ahead, seq_length - 1)].astype(np.int32), ahead < seq_length


def depth_inputs(batch: dict, depth: int, cp: int, use_segments: bool) -> dict:
    """Batch arrays [..., T] -> {"inputs", "positions", "targets", "loss_mask"} [D, ..., T] of depths 1..D."""
    inputs = batch["inputs"]
    seq = inputs.shape[-1]
    positions = batch.get("positions")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), inputs.shape)
    out = {"inputs": [], "positions": [], "targets": [], "loss_mask": []}
    for k in range(1, depth + 1):
        index, valid = ahead_index(seq, cp, k)
        take = lambda a: jnp.take(a, jnp.asarray(index), axis=-1)  # noqa: E731  [..., T] -> [..., T]
        keep = jnp.asarray(valid)
        if use_segments:  # the token k ahead must be of the same document
            keep = keep & (take(batch["segment_ids"]) == batch["segment_ids"])
        out["inputs"].append(jnp.where(keep, take(inputs), 0))
        out["positions"].append(jnp.where(keep, take(positions), 0))
        out["targets"].append(jnp.where(keep, take(batch["targets"]), 0))
        out["loss_mask"].append(jnp.where(keep, take(batch["loss_mask"]), 0.0))
    return {name: jnp.stack(parts) for name, parts in out.items()}


AHEAD = "mtp_ahead"  # the batch key of depth_inputs made before a pipeline's stages


def with_ahead(batch: dict, depth: int, cp: int, use_segments: bool) -> dict:
    """Batch arrays [M, B, T] plus each micro-batch's depth_inputs under AHEAD ([M, D, B, T] arrays), made under
    GSPMD: inside a pipeline stage's shard_map, gathering along a sequence axis split over cp aborts XLA's SPMD
    partitioner (the check on partition groups in spmd_partitioner_util.cc, jax 0.12), so the stages read these."""
    ahead = depth_inputs(batch, depth, cp, use_segments)  # [D, M, B, T]
    # [M, D, B, T], sharded as the batch arrays are (a gather's output sharding is its own)
    return {**batch, AHEAD: jax.tree.map(lambda a: constrain(jnp.moveaxis(a, 0, 1), (None, None, "batch", None)),
                                         ahead)}


def _ahead(micro: dict, depth: int, cp: int, use_segments: bool) -> dict:
    return micro[AHEAD] if AHEAD in micro else depth_inputs(micro, depth, cp, use_segments)


def denominators(batch: dict, depth: int, cp: int, use_segments: bool):
    """The step's unmasked positions of each depth [D] (at least 1), over every micro-batch of `batch`."""
    mask = depth_inputs(batch, depth, cp, use_segments)["loss_mask"]  # [D, M, B, T]
    return jnp.maximum(mask.reshape(depth, -1).sum(-1), 1.0)


def embeddings(module, micro: dict, cfg, use_segments: bool):
    """The embeddings [D, B, T, D] of the tokens each depth reads in one micro-batch (a lookup of the shared table:
    the pipeline runs it outside its stages, mjax/parallel/pipeline_stage.py)."""
    ahead = _ahead(micro, cfg.model.mtp_depth, cfg.parallel.cp, use_segments)
    return module.mtp_embeddings(ahead["inputs"], ahead["positions"])


@jax.named_scope("mtp")
def loss_sums(module, h, micro: dict, cfg, use_segments: bool, embedded=None, moe_keys=None):
    """(each depth's masked cross-entropy sum [D], the MTP blocks' MoE stats stacked [D, ...] or None) of one
    micro-batch, from the model's final-norm output h [B, T, D]. embedded: `embeddings` of the micro-batch, when
    looked up elsewhere (None: here)."""
    depth, e = cfg.model.mtp_depth, cfg.execution
    ahead = _ahead(micro, depth, cfg.parallel.cp, use_segments)
    positions = micro.get("positions")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(h.shape[1], dtype=jnp.int32), h.shape[:2])
    segments = micro.get("segment_ids") if use_segments else None
    if embedded is None:
        embedded = module.mtp_embeddings(ahead["inputs"], ahead["positions"])
    hs, stats = module.mtp_hidden_states(h, embedded, positions, segments, moe_keys)
    sums = [cross_entropy.loss_sums(hs[k], ahead["targets"][k], ahead["loss_mask"][k], impl=e.cross_entropy_impl,
                                    vocab_size=cfg.model.vocab_size, z_loss_coeff=0.0, chunk=e.cross_entropy_chunk,
                                    compute_dtype=module.dtype, logits_fn=module.logits,
                                    output_layer=module.output_layer())[0]
            for k in range(depth)]
    return jnp.stack(sums), stats


def depth_weights(denoms, model_cfg):
    """[D]: what each depth's loss sum is multiplied by in the objective, factor / (D x the depth's step count)."""
    return model_cfg.mtp_loss_scaling_factor / (denoms.shape[0] * denoms)


def objective(depth_sums, denoms, model_cfg):
    """The micro-batch's share of the MTP term: factor x mean over depths of (depth sum / the depth's step count)."""
    return jnp.vdot(depth_weights(denoms, model_cfg), depth_sums)


def metrics(step_sums, denoms) -> dict:
    """{"mtp_1_loss", ...}: each depth's loss over the step (Megatron logs "mtp_1 loss", ...)."""
    losses = step_sums / denoms
    return {f"mtp_{k + 1}_loss": losses[k] for k in range(losses.shape[0])}


def update_expert_bias(params: dict, kept_tokens_per_expert, model_cfg) -> dict:
    """params with the MTP blocks' router expert bias [D, E] moved by the step's kept tokens [D, E] (Megatron's sign
    rule, as for the model's MoE layers); unchanged without MoE MTP blocks or --moe_router_enable_expert_bias."""
    if not (model_cfg.mtp_depth and model_cfg.mtp_is_moe() and model_cfg.moe_router_enable_expert_bias):
        return params
    layers = params["mtp"]["layers"]
    r = layers["block"]["mlp"]["router"]
    bias = router.expert_bias_update(r["expert_bias"], kept_tokens_per_expert, model_cfg.moe_router_bias_update_rate)
    block = {**layers["block"], "mlp": {**layers["block"]["mlp"], "router": {**r, "expert_bias": bias}}}
    return {**params, "mtp": {**params["mtp"], "layers": {**layers, "block": block}}}
