"""Uneven pipeline stages (mjax/config/pipeline_layout.py): the stored layer stacks [L, ...] moved to the layer slots
each device runs, and back.

Every (virtual) stage runs one SPMD program, so every stage has as many layer slots as the longest one; a stage
with fewer layers runs the extra slots masked (the slot's block still runs, on some real layer's weights, and its
output is dropped: x passes through, no gradient reaches those weights, its MoE statistics and FP8 amaxes are
zeroed). Slot j of every stage has the kind (dense / MoE) of the model's layer j, which validation ensures for
the real layers, so each stack (`layers`, `moe_layers`) has its own slots: device s holds [vpp x S_k, ...] of
stack k, chunk c at [c S_k, (c + 1) S_k).

The train state keeps the stacks in stored order [L, ...] (checkpoints restore onto any split, and onto pp = 1),
sharded over `pipeline` in contiguous blocks when L divides over it, else on another dim (mjax/parallel/rules.py).
One shard_map before the ticks moves each device's layers to it with one all_to_all per leaf and step: from the
blocks, only what another device stores (nothing when every stage is its own block); from another dim, each
device's 1 / pp slice of every layer it runs (an FSDP gather of its own layers). Its transpose moves the
gradients back.
"""

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from mjax.model.transformer import STACKS
from mjax.parallel.pipeline_stage import AXIS, manual
from mjax.parallel.rules import param_shardings
from mjax.sharding import current_logical_sharding

log = logging.getLogger("mjax")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Static tables of one uneven StageLayout. sources[k]: [pp, vpp S_k] the stored index (in stack k) each slot of
    each device runs, -1 for a masked slot; real: [pp, vpp, S] whether slot j of chunk c of device s is a layer."""
    pp: int
    vpp: int
    sources: dict
    real: np.ndarray
    blocks: dict  # stack -> _block_tables, for a stack whose layers divide over pp (stored in contiguous blocks)

    def real_of(self, s, c):
        """Inside shard_map: whether each of the S slots of chunk c of device s (both traced) holds a layer."""
        return jnp.asarray(self.real)[s, c]

    def slot_is_layer(self, name: str, s, c):
        """Inside shard_map: whether each of the S_k slots of stack `name` in chunk c of device s holds a layer."""
        return jnp.asarray(self.sources[name] >= 0).reshape(self.pp, self.vpp, -1)[s, c]


@functools.cache
def placement(layout, pattern: tuple[bool, ...]) -> Placement:
    """The Placement of StageLayout `layout` for a model whose layer g is MoE when pattern[g]."""
    pp, vpp, slots = layout.pp, layout.vpp, layout.slots
    kinds = [STACKS[int(pattern[j])] for j in range(slots)]  # slot j runs the model's layer-j kind
    index_in_stack = [sum(pattern[i] == pattern[g] for i in range(g)) for g in range(len(pattern))]
    sources = {}
    for name in STACKS:
        if name not in kinds:
            continue
        table = np.full((pp, vpp, kinds.count(name)), -1, np.int32)
        for s in range(pp):
            for c in range(vpp):
                layers = layout.layers(s, c)
                mine = [j for j in range(slots) if kinds[j] == name]
                for q, j in enumerate(mine):
                    if j < len(layers):
                        table[s, c, q] = index_in_stack[layers[j]]
        sources[name] = table.reshape(pp, -1)
    sizes = {name: sum(pattern) if name == "moe_layers" else len(pattern) - sum(pattern) for name in sources}
    blocks = {name: _block_tables(sources[name], sizes[name] // pp, pp) for name in sources if sizes[name] % pp == 0}
    real = np.array([[[j < len(layout.layers(s, c)) for j in range(slots)] for c in range(vpp)] for s in range(pp)])
    log.info("uneven pipeline stages, transformer layers per device (+ per chunk): %s; every stage runs %d layer "
             "slots per chunk, a shorter one masks the rest", layout.describe(), slots)
    return Placement(pp, vpp, sources, real, blocks)


def stored_dims(model, stacks: dict, fp8_stacks: dict) -> tuple[dict, dict]:
    """The dim each stored stack leaf is split over `pipeline` on (None: not split), params as the train state
    places them (mjax/parallel/rules.py), FP8 scales on their layer dim when it divides."""
    mesh, rules = current_logical_sharding()
    axes = {k: model.logical_axes()[k] for k in stacks}
    pipeline_dim = lambda sharding: next((i for i, e in enumerate(sharding.spec)  # noqa: E731
                                          if AXIS in (e if isinstance(e, tuple) else (e,))), None)
    dims = jax.tree.map(pipeline_dim, param_shardings(mesh, axes, rules, stacks))
    pp = mesh.shape[AXIS]
    return dims, jax.tree.map(lambda a: 0 if a.shape[0] % pp == 0 else None, fp8_stacks)


def to_devices(plan: Placement, stacks: dict, dims: dict) -> dict:
    """The stored stacks {k: [L_k, ...]} -> the slots every device runs, {k: [pp vpp S_k, ...]} (sharded over
    `pipeline`: device s holds [vpp S_k, ...]). dims: stored_dims' tree for `stacks`. Differentiable (the
    gradient of a masked slot is zero, so the transpose adds nothing to the layer it borrowed)."""
    leaves, treedef = jax.tree.flatten(stacks)
    if not leaves:
        return stacks
    names = [path[0].key for path, _ in jax.tree_util.tree_flatten_with_path(stacks)[0]]
    dim_leaves = treedef.flatten_up_to(dims)
    in_specs = tuple(P() if d is None else P(*([None] * d), AXIS) for d in dim_leaves)

    def body(*local):
        return tuple(_place(a, plan, name, d) for a, name, d in zip(local, names, dim_leaves))

    placed = manual(body, in_specs, (P(AXIS),) * len(leaves))(*leaves)
    return treedef.unflatten(placed)


def _place(local, plan: Placement, name: str, dim):
    """Inside shard_map: this device's part of one stored leaf [L, ...] of stack `name`, split over `pipeline` on
    `dim` (None: not split) -> its slots [vpp S, ...] (a masked slot runs the weights of stored or local index 0)."""
    me, pp, sources = jax.lax.axis_index(AXIS), plan.pp, plan.sources[name]
    if dim is None:  # every device stores all of it
        return jnp.take(local, jnp.asarray(np.maximum(sources, 0))[me], axis=0)
    if dim > 0:  # each device stores a 1 / pp slice of every layer: gather the slices of its own layers
        send = jnp.take(local, jnp.asarray(np.maximum(sources, 0)).reshape(-1), axis=0)  # [pp vpp S, ..., d / pp, ...]
        got = jax.lax.all_to_all(send.reshape(pp, -1, *local.shape[1:]), AXIS, 0, 0)  # [pp (from), vpp S, ...]
        got = jnp.moveaxis(got, 0, dim)  # [vpp S, ..., pp, d / pp, ...]
        return got.reshape(*got.shape[:dim], -1, *got.shape[dim + 2:])  # [vpp S, ..., d, ...]
    send, take = plan.blocks[name]
    pool = local  # [L / pp, ...]: this device's block, then what the others send it
    if send.shape[-1]:
        out = jnp.take(local, jnp.asarray(send)[me].reshape(-1), axis=0)  # [pp (to) K, ...]
        got = jax.lax.all_to_all(out.reshape(pp, -1, *local.shape[1:]), AXIS, 0, 0)  # [pp (from), K, ...]
        pool = jnp.concatenate([local, got.reshape(-1, *local.shape[1:])])  # [L / pp + pp K, ...]
    return jnp.take(pool, jnp.asarray(take)[me], axis=0)  # [vpp S, ...]


def _block_tables(sources: np.ndarray, block: int, pp: int):
    """For a stack stored in contiguous blocks of `block` layers per device: send [pp (from), pp (to), K], the local
    indices each device sends each other one (K: the most any pair needs; a device's own layers stay local), and
    take [pp, vpp S], where each slot is in the pool [own block, then K from each device in device order]."""
    lists = [[[] for _ in range(pp)] for _ in range(pp)]  # lists[d][s]: local indices d sends to s
    for s in range(pp):
        for i in sources[s]:
            if i >= 0 and i // block != s:
                lists[i // block][s].append(int(i) % block)
    k = max(len(x) for row in lists for x in row)
    send = np.zeros((pp, pp, k), np.int32)
    take = np.zeros(sources.shape, np.int32)
    for s in range(pp):
        for d in range(pp):
            send[d, s, :len(lists[d][s])] = lists[d][s]
        sent = [0] * pp
        for q, i in enumerate(sources[s]):
            d = int(i) // block
            if i < 0 or d == s:
                take[s, q] = max(int(i), 0) % block
            else:
                take[s, q] = block + d * k + sent[d]
                sent[d] += 1
    return send, take


def stored_order_sums(plan: Placement, sums: dict) -> dict:
    """The per-device MoE sums [pp, ...] -> the step's sums: per-layer counts [pp, vpp S, E] in stored order [L, E]
    (masked slots dropped; they are zero), scalars summed over the devices."""
    if not sums:
        return {}
    table = plan.sources["moe_layers"]  # [pp, vpp S]
    s_of, q_of = np.nonzero(table >= 0)
    order = np.argsort(table[s_of, q_of])  # stored index i -> the (device, slot) that runs it

    def one(v):
        return v.sum(0) if v.ndim <= 2 else v[s_of[order], q_of[order]]

    return {k: one(v) for k, v in sums.items()}
