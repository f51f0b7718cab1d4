"""Pipeline stages that differ in length (mjax/config/pipeline_layout.py) or in their dense/MoE pattern (dense first
layers, --moe_first_dense_layers): the stored layer stacks [L, ...] moved to the layer slots each device runs, and
back.

Every (virtual) stage runs one SPMD program, so every stage runs the same sequence of layer slots, each of one kind
(dense / MoE): a common supersequence of the stages' kind sequences (all-MoE stages of 3 and 4 layers: 4 MoE slots;
stage 0 dense-dense-MoE and the others MoE-MoE-MoE: D D M M M). A stage's layers take the slots of their kind in
order; a slot it holds no layer for is skipped on that device (a lax.cond on the device's own predicate: its
compute is not paid, x passes through, no gradient reaches the weights the slot borrowed, its MoE statistics and
FP8 amaxes are zero). Each stack (`layers`, `moe_layers`) has its own slots: device s holds [vpp x S_k, ...] of
stack k, chunk c at [c S_k, (c + 1) S_k), a skipped slot the weights of some real layer of the stack.

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
    """Static tables of one StageLayout. kinds: slot j is MoE when kinds[j]; sources[k]: [pp, vpp S_k] the stored
    index (in stack k) each slot of each device runs, -1 for a skipped slot; real: [pp, vpp, S] whether slot j of
    chunk c of device s is a layer."""
    pp: int
    vpp: int
    kinds: tuple
    sources: dict
    real: np.ndarray
    blocks: dict  # stack -> _block_tables, for a stack whose layers divide over pp (stored in contiguous blocks)

    def slots_of(self, s, c):
        """Inside shard_map: (the slots' kinds, whether each of the S slots of chunk c of device s (both traced) holds
        a layer), what pipeline_stage.run_layers takes as `slots`."""
        return self.kinds, jnp.asarray(self.real)[s, c]

    def slot_is_layer(self, name: str, s, c):
        """Inside shard_map: whether each of the S_k slots of stack `name` in chunk c of device s holds a layer."""
        return jnp.asarray(self.sources[name] >= 0).reshape(self.pp, self.vpp, -1)[s, c]


def _stage_kinds(layout, pattern, s: int, c: int) -> tuple[bool, ...]:
    return tuple(pattern[g] for g in layout.layers(s, c))


def needs_placement(layout, pattern: tuple[bool, ...]) -> bool:
    """Whether the stages differ in length or in dense/MoE pattern (otherwise each device's stored block, or
    Megatron's interleaved chunk, is its stage as it is)."""
    first = _stage_kinds(layout, pattern, 0, 0)
    return not layout.even or any(_stage_kinds(layout, pattern, s, c) != first
                                  for s in range(layout.pp) for c in range(layout.vpp))


def _supersequence(a: tuple, b: tuple) -> tuple:
    """A shortest sequence holding both a and b as subsequences (the textbook dynamic programme)."""
    n, m = len(a), len(b)
    rest = np.zeros((n + 1, m + 1), np.int32)  # rest[i, j]: the shortest one of a[i:] and b[j:]
    rest[:, m], rest[n, :] = np.arange(n, -1, -1), np.arange(m, -1, -1)
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            rest[i, j] = 1 + (rest[i + 1, j + 1] if a[i] == b[j] else min(rest[i + 1, j], rest[i, j + 1]))
    out, i, j = [], 0, 0
    while i < n or j < m:
        if i < n and j < m and a[i] == b[j]:
            out, i, j = out + [a[i]], i + 1, j + 1
        elif j == m or (i < n and rest[i + 1, j] <= rest[i, j + 1]):
            out, i = out + [a[i]], i + 1
        else:
            out, j = out + [b[j]], j + 1
    return tuple(out)


def _fit(kinds: tuple, stage: tuple) -> list[int]:
    """The slots the stage's layers take: each the first slot of its kind after the previous layer's."""
    taken, j = [], 0
    for kind in stage:
        while kinds[j] != kind:
            j += 1
        taken, j = taken + [j], j + 1
    return taken


@functools.cache
def placement(layout, pattern: tuple[bool, ...]) -> Placement:
    """The Placement of StageLayout `layout` for a model whose layer g is MoE when pattern[g]."""
    pp, vpp = layout.pp, layout.vpp
    kinds = ()
    for s in range(pp):
        for c in range(vpp):
            kinds = _supersequence(kinds, _stage_kinds(layout, pattern, s, c))
    holds = np.full((pp, vpp, len(kinds)), -1, np.int32)  # the model layer each slot runs, -1: none
    for s in range(pp):
        for c in range(vpp):
            layers = layout.layers(s, c)
            holds[s, c, _fit(kinds, _stage_kinds(layout, pattern, s, c))] = list(layers)
    index_in_stack = [sum(pattern[i] == pattern[g] for i in range(g)) for g in range(len(pattern))]
    sources = {}
    for name in STACKS:
        mine = [j for j, k in enumerate(kinds) if STACKS[int(k)] == name]
        if mine:
            sources[name] = np.where(holds[..., mine] >= 0, np.take(index_in_stack, np.maximum(holds[..., mine], 0)),
                                     -1).astype(np.int32).reshape(pp, -1)
    sizes = {name: sum(pattern) if name == "moe_layers" else len(pattern) - sum(pattern) for name in sources}
    blocks = {name: _block_tables(sources[name], sizes[name] // pp, pp) for name in sources if sizes[name] % pp == 0}
    log.info("pipeline stages of different lengths or dense/MoE patterns, transformer layers per device (+ per "
             "chunk): %s; every stage runs the %d layer slots %s per chunk, skipping those it holds no layer for",
             layout.describe(), len(kinds), "".join("M" if k else "D" for k in kinds))
    return Placement(pp, vpp, kinds, sources, holds >= 0, blocks)


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
    gradient of a skipped slot is zero, so the transpose adds nothing to the layer it borrowed)."""
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
    `dim` (None: not split) -> its slots [vpp S, ...] (a skipped slot holds the weights of stored or local index 0)."""
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
    (skipped slots dropped; they are zero), scalars summed over the devices."""
    if not sums:
        return {}
    table = plan.sources["moe_layers"]  # [pp, vpp S]
    s_of, q_of = np.nonzero(table >= 0)
    order = np.argsort(table[s_of, q_of])  # stored index i -> the (device, slot) that runs it

    def one(v):
        return v.sum(0) if v.ndim <= 2 else v[s_of[order], q_of[order]]

    return {k: one(v) for k, v in sums.items()}
