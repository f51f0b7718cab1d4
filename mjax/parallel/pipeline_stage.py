"""Pieces shared by the pipeline schedules: the per-tick shard_map, what a stage does with one micro-batch and the
activation hand-off between neighbouring stages (the output layer and loss: pipeline_head.py).

The scan over ticks runs under GSPMD and only each tick's stage work is a shard_map, manual over `pipeline`. The
embedding lookup stays outside it: XLA's SPMD partitioner aborts (spmd_partitioner_util.cc "Check failed:
partition_group_list...") on a vocab-parallel gather inside a pipeline-manual shard_map for some shapes (e.g. vocab
128, dp=2, tp=2, 128 tokens per micro-batch; jax 0.11.2 and 0.12). So every pipeline device embeds the micro-batch
entering stage 0 (a cheap lookup), and each backward tick moves stage 0's input gradient to the other pipeline
devices (one [B, T, D] collective) for the lookup's gradient.
"""

import jax
import jax.numpy as jnp
import numpy as np

from mjax.model import moe_terms
from mjax.sharding import current_logical_sharding, logical_sharding
from mjax.model.transformer import STACKS, default_positions

AXIS = "pipeline"


def manual(body, in_specs, out_specs):
    """`body` as a shard_map manual over `pipeline` only (TP/SP/FSDP/DP stay with GSPMD); the logical-axis
    constraints inside it name the mesh whose `pipeline` axis is manual."""
    context = current_logical_sharding()
    if context is None:
        raise ValueError("the pipeline needs a mesh: trace the train step inside mjax.sharding.logical_sharding")
    mesh, rules = context

    def in_body(*args):
        with logical_sharding(jax.sharding.get_abstract_mesh(), rules):
            return body(*args)

    # check_vma off: pallas_call outputs carry no varying axes, so under a checked shard_map the stage's Pallas
    # kernels (per_shard, inside their custom_vjp) would be mistyped.
    return jax.shard_map(in_body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names={AXIS},
                         check_vma=False)


def micro_at(batch: dict, m) -> dict:
    """Micro-batch `m` (a traced index) of batch arrays [M, B, T] -> [B, T]."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, m, keepdims=False), batch)


def positions(micro: dict):
    return micro["positions"] if "positions" in micro else default_positions(micro["inputs"])


def split_params(params: dict) -> tuple[dict, dict]:
    """(the stacked layers: {"layers": ..., "moe_layers": ...} as the model has them, every other param)."""
    stacks = {k: v for k, v in params.items() if k in STACKS}
    return stacks, {k: v for k, v in params.items() if k not in STACKS}


def embed(model, rest: dict, micro: dict, fp8=None):
    """Token ids [B, T] -> the first stage's input [B, T, D]. `rest` holds the params other than the layers, `fp8`
    their FP8 scales (with FP8 layers)."""
    return model.bind(rest, fp8).embed_tokens(micro["inputs"], positions(micro))


def run_layers(model, stacks: dict, x, micro: dict, use_segments: bool, fp8=None, slots=None):
    """A slice of the stacked layers (leading dims = their layer counts; `fp8` the same slice of their FP8 scales)
    over x [B, T, D] -> (y [B, T, D], the MoE objective terms of these layers (0 without MoE layers), their MoE step
    sums ({} without)). slots: (kinds, real) of a Placement (pipeline_placement.py): the S slots' kinds (MoE or
    not) in the order they run, and [S] which of them hold a layer; the others pass x through, computing nothing,
    and add no MoE terms or sums. None: the slice's layers are the model's first ones, all of them real."""
    segments = micro.get("segment_ids") if use_segments else None
    module = model.bind(stacks, fp8)
    kinds = None
    if slots is not None:
        kinds, real = slots
        module.runner = _masked_runner(module.runner, real)
    y, stats, _ = module.run_layers(x, positions(micro), segments, pattern=kinds)
    if not stats:
        return y, jnp.zeros((), jnp.float32), {}
    if slots is not None:
        return (y, *_masked_moe_terms(stats, model.cfg, *slots))
    counts = moe_terms.zero_counts(stats["router_topk_count"].sum(-2).shape)  # global_aux_loss: not with pp > 1
    terms, _, sums = moe_terms.objective(stats, model.cfg, counts, jnp.zeros((), jnp.int32))
    return y, terms.astype(jnp.float32), sums


def _masked_runner(runner, real):
    """The model's layer runner skipping the slots real [S] says hold no layer: a lax.cond on this device's own
    predicate (the pipeline axis is manual, and a stage's peers on the other axes take the same branch), so a
    skipped slot costs no compute, passes x through and gives zero MoE stats. The model calls the runner for its
    runs of slots in order, so each call takes the next part of `real`."""
    taken = [0]

    def run(layer, x, xs, extra_names=()):
        n = jax.tree.leaves(xs)[0].shape[0]
        mask, taken[0] = real[taken[0]:taken[0] + n], taken[0] + n

        def skip(x, one):
            ys = jax.eval_shape(layer, x, one)[1]
            return x, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), ys)

        def masked(x, xs_one):
            one, is_layer = xs_one
            return jax.lax.cond(is_layer, layer, skip, x, one)

        return runner(masked, x, (xs, mask), extra_names)

    return run


def _masked_moe_terms(stats: dict, model_cfg, kinds, real):
    """(MoE objective terms, step sums) of the MoE slots among slots of `kinds` (real [S]: which hold a layer), each
    slot's terms computed alone and those of slots without a layer dropped."""
    moe_slots = np.flatnonzero(kinds)
    is_layer = real[moe_slots]  # [MoE slots]
    slot_mask = lambda v: is_layer.reshape(-1, *[1] * (v.ndim - 1))  # noqa: E731
    # A skipped slot's stats are zeros (its tokens too): ones instead keep its dropped terms free of 0 / 0.
    stats = jax.tree.map(lambda v: jnp.where(slot_mask(v), v, jnp.ones_like(v)), stats)

    def one(layer_stats):  # one MoE layer's stats -> (its terms, its sums)
        layer_stats = jax.tree.map(lambda a: a[None], layer_stats)
        counts = moe_terms.zero_counts(layer_stats["router_topk_count"].sum(-2).shape)
        terms, _, sums = moe_terms.objective(layer_stats, model_cfg, counts, jnp.zeros((), jnp.int32))
        return terms, sums

    terms, sums = jax.vmap(one)(stats)  # [MoE slots]; per-layer sums [MoE slots, 1, E]
    keep = lambda v: jnp.where(slot_mask(v), v, 0)  # noqa: E731
    sums = {k: keep(v).sum(0) if v.ndim == 1 else keep(v).reshape(v.shape[0], *v.shape[2:]) for k, v in sums.items()}
    return jnp.sum(keep(terms)).astype(jnp.float32), sums


def moe_sums_like(model, stacks: dict, pp: int, x, micro: dict, use_segments: bool, fp8=None, vpp: int = 1,
                  kinds=None):
    """Zeros [pp, ...] shaped as one device's MoE step sums over its vpp chunks of 1 / (pp vpp) of each stack, or {}.
    fp8: the stacks' FP8 scales, with FP8 layers; kinds: the slots' kinds of a Placement, None without one."""
    chunk = jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0] // (pp * vpp), *a.shape[1:]), a.dtype),
                         (stacks, fp8))
    slots = None if kinds is None else (kinds, jnp.ones((len(kinds),), bool))
    sums = jax.eval_shape(lambda s, x, m: run_layers(model, s[0], x, m, use_segments, s[1], slots)[2], chunk, x,
                          micro)
    return jax.tree.map(lambda a: jnp.zeros((pp, *((a.shape[0] * vpp, *a.shape[1:]) if a.ndim else ())),
                                            jnp.float32), sums)


def stored_order_sums(sums: dict, pp: int, vpp: int = 1) -> dict:
    """The per-device MoE sums [pp, ...] -> the step's sums: per-layer counts [pp, L/pp, E] (each device's layers in
    the order it runs them: chunk c = virtual stage c pp + s) in the stacked (stored) layer order [L, E], scalars
    summed over the devices."""
    def one(v):
        if v.ndim <= 2:
            return v.sum(0)
        chunks = v.reshape(pp, vpp, v.shape[1] // vpp, *v.shape[2:])  # [pp, vpp, Lv, E]
        return jnp.swapaxes(chunks, 0, 1).reshape(-1, *v.shape[2:])  # virtual stage c pp + s -> [L, E]

    return {k: one(v) for k, v in sums.items()}


def shift(x, pp: int, direction: int, circular: bool = False):
    """Inside shard_map: sends x from stage s to stage s + direction (the last stage wraps round to the first when
    `circular`); a stage nobody sends to receives zeros."""
    pairs = [(s, s + direction) for s in range(pp) if 0 <= s + direction < pp]
    if circular:
        pairs.append((pp - 1, 0) if direction > 0 else (0, pp - 1))
    return jax.lax.ppermute(x, AXIS, pairs)


def per_stage_zeros(pp: int, like, *lead: int, dtype=None):
    """Zeros [pp, *lead, *like.shape]: one slice per pipeline device (sharded over `pipeline` by the shard_maps)."""
    return jnp.zeros((pp, *lead, *like.shape), dtype or like.dtype)


def interleave_tables(pp: int, vpp: int):
    """Index tables moving stored chunks (contiguous blocks: device d holds chunks u = d vpp + j) to their
    interleaved places (device s, chunk c holds u = c pp + s) with one all_to_all of `slots` chunks per peer:
    send[d, s, i] = the local chunk device d puts in slot i for device s; take[s, c] = (source, slot) of chunk c."""
    slots = -(-vpp // pp)
    send, take, used = np.zeros((pp, pp, slots), np.int32), np.zeros((pp, vpp, 2), np.int32), np.zeros((pp, pp), int)
    for u in range(pp * vpp):
        (d, j), (c, s) = divmod(u, vpp), divmod(u, pp)
        send[d, s, used[d, s]], take[s, c] = j, (d, used[d, s])
        used[d, s] += 1
    return send, take


def my_chunks(local: dict, pp: int, vpp: int) -> dict:
    """Inside shard_map: this device's block of the stacked layers [vpp Lv, ...] (the stored order, contiguous over
    `pipeline`) -> the layers it runs, [vpp Lv, ...] holding chunk c = virtual stage c pp + s at [c Lv, (c + 1) Lv)."""
    send, take = interleave_tables(pp, vpp)
    me = jax.lax.axis_index(AXIS)

    def one(a):
        blocks = a.reshape(vpp, a.shape[0] // vpp, *a.shape[1:])  # [vpp, Lv, ...]
        out = jnp.take(blocks, jnp.asarray(send)[me], axis=0)  # [pp, slots, Lv, ...]: what each peer gets
        got = jax.lax.all_to_all(out, AXIS, 0, 0)  # [pp, slots, Lv, ...]: what each peer sent here
        where = jnp.asarray(take)[me]  # [vpp, 2]
        return got[where[:, 0], where[:, 1]].reshape(a.shape)  # [vpp, Lv, ...] -> [vpp Lv, ...]

    return jax.tree.map(one, local)
