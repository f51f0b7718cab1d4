"""Expert parallelism: MoE tokens travel to the ranks holding their experts and back (Megatron's token dispatchers).

The experts [E, ...] are split over the mesh axes of the logical `experts` axis (`expert`, and `tensor` too under
MoE parallel folding, --expert_tensor_parallel_size=1): rank r of those ep ranks holds experts
[r * E/ep, (r + 1) * E/ep). Inside a `shard_map` manual over the batch axes and the sequence's (`context`, and
`tensor` when folded) each device routes its own tokens (one dispatch group, as the single-device model's) and
then, by --moe_token_dispatcher_type:

alltoall   sorts its assignments by expert (mjax/model/moe_dispatch.py), exchanges the per-(rank, expert) counts,
           sends each rank exactly the rows for its experts, runs the grouped GEMMs on what it received (re-sorted by
           local expert), sends the results back, and each token sums its slots. The exchange
           (--moe_alltoall_impl) is `ragged_all_to_all` (moves the routed rows only) or an `all_to_all` of
           [ep, R, D] blocks, each padded to R = the rows of one group (every assignment of a group may go to one
           rank: exact, never drops a token; the padding is zeros). Both land rows in the same [ep, R, D] receive
           buffer, R rows per source, so their results are bitwise the same. auto: ragged on a GPU, padded where
           the backend has no ragged all-to-all (XLA:CPU).
allgather  gathers every rank's tokens and routing, computes its own experts' share of every token and
           reduce-scatters the sums back (dropless only, as in Megatron). No sort across ranks; ep x the tokens'
           bytes move each way.

With every expert local (ep 1) under context parallelism the same shard_map runs with no exchange, so a rank
dispatches only its own T / cp tokens (GSPMD's dispatch groups, MoE.route_and_dispatch, split the batch only);
FP8 experts keep those groups, as their per-tensor scales span all of them. Without cp: MoE.route_and_dispatch.

Each exchange is a custom_vjp whose backward is the other direction's exchange, and every reordering is a gather
whose backward is the inverse gather: no scatter-add, deterministic. The dispatch stats are summed over the
manual axes. Under the pipeline's shard_map (--pp > 1) the region is nested and recomputed in the backward: JAX
cannot lower a nested shard_map's saved residuals.

Bytes a rank sends per MoE layer and micro-batch (docs/moe.md): alltoall n*k*(1 - 1/ep) rows of D each way (their
mean under balanced routing; ragged moves just those, padded moves ep*R rows), allgather (ep - 1)*n rows of D plus
the routing, and the reduce-scatter of (ep - 1)*n rows of D in float32.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from mjax.model.moe import dispatch_stats
from mjax.model.moe_dispatch import permute, plan_dispatch, row_weights, unpermute
from mjax.sharding import current_logical_sharding


@dataclasses.dataclass(frozen=True)
class TokenDispatcher:
    """The MoE layers' dispatcher under a mesh (hashable: part of the model's static graph)."""
    dispatcher_type: str = "alltoall"  # --moe_token_dispatcher_type
    alltoall_impl: str = "auto"  # --moe_alltoall_impl

    def __call__(self, layer, x, logits):
        """x [B, T, D], router logits [B*T, E] -> (y [B, T, D] float32, stats), as MoE.route_and_dispatch (which it
        is without expert parallelism)."""
        ctx = current_logical_sharding()
        mesh, rules = ctx if ctx is not None else (None, {})
        ep_axes = tuple(rules.get("experts") or ())
        if mesh is None:
            return layer.route_and_dispatch(x, logits)
        if math.prod(mesh.shape[a] for a in ep_axes) == 1:
            # Every expert local. Under context parallelism each rank still dispatches its own tokens (GSPMD's
            # dispatch groups split the batch only: each rank would compute its sequences' whole expert work);
            # FP8 experts keep GSPMD's groups, their per-tensor scales spanning all of them.
            split_seq = any(mesh.shape[a] > 1 for a in rules.get("seq") or ())
            if not split_seq or layer.experts.quant is not None:
                return layer.route_and_dispatch(x, logits)
            return _expert_parallel(layer, x, logits, mesh=mesh, rules=rules, ep_axes=(), dispatcher_type="local",
                                    impl=None)
        if layer.experts.quant is not None:
            raise ValueError("FP8 expert GEMMs with expert parallelism are not supported: their per-tensor scales "
                             "need the amax over every rank; use --ep=1 or drop --fp8_recipe")
        return _expert_parallel(layer, x, logits, mesh=mesh, rules=rules, ep_axes=ep_axes,
                                dispatcher_type=self.dispatcher_type, impl=self._impl())

    def _impl(self) -> str:
        if self.alltoall_impl != "auto":
            return self.alltoall_impl
        return "ragged" if jax.default_backend() == "gpu" else "padded"


def _expert_parallel(layer, x, logits, *, mesh, rules, ep_axes, dispatcher_type, impl):
    b, t, d = x.shape
    e = logits.shape[-1]
    context = jax.sharding.get_abstract_mesh()
    nested = not context.empty and any(a == AxisType.Manual for a in context.axis_types)
    already = {n for n, a in zip(context.axis_names, context.axis_types) if a == AxisType.Manual} if nested else set()
    batch = tuple(a for a in rules["batch"] if a not in already)
    # Each device routes its own tokens: context parallelism's ranks and folded tensor ranks each take their part
    # of the sequence (in residual_seq's order, so no reshard moves rows between them).
    seq = tuple(dict.fromkeys(a for a in (*(rules.get("seq") or ()), *ep_axes)
                              if a not in batch and a not in already and mesh.shape[a] > 1))
    manual = tuple(sorted(set(batch) | set(seq)))
    groups = math.prod(mesh.shape[a] for a in batch)
    if b % groups or t % math.prod(mesh.shape[a] for a in seq):
        raise ValueError(f"expert parallelism: a batch of {b} sequences of {t} tokens does not split over the "
                         f"{groups} batch shards x {seq} of the mesh; use a batch (and --seq_length) that does")
    token_spec, per_seq = P(batch or None, seq or None, None), P(batch or None)
    kernels = layer.experts.kernels(layer.dtype)
    kernel_specs = tuple(None if w is None else P(ep_axes or None) for w in kernels)
    local = {"alltoall": functools.partial(_alltoall, layer, axes=ep_axes, impl=impl),
             "allgather": functools.partial(_allgather, layer, axes=ep_axes),
             "local": functools.partial(_local, layer)}[dispatcher_type]

    # An input, not a closure: under the pipeline's shard_map a value closed over cannot enter the nested one.
    bias = layer.router.bias()  # [E] or None

    def per_device(x, logits, kernels, bias):  # this device's tokens, routed here: top-k stays local
        bl, tl, _ = x.shape
        flat = logits.reshape(bl * tl, e)
        weights, experts = layer.route(flat, bias)  # [n, k]
        y, tokens, kept = local(x, weights.reshape(bl, tl, -1), experts.reshape(bl, tl, -1), kernels)
        router = {k: jax.lax.psum(v, seq) if seq else v for k, v in layer.router_stats(flat, bl).items()}
        return y, router, jax.lax.psum(tokens, manual), jax.lax.psum(kept, manual)

    if nested:
        per_device = jax.checkpoint(per_device)
    y, router, tokens, kept = jax.shard_map(
        per_device, mesh=context if nested else mesh, axis_names=set(manual), check_vma=False,
        in_specs=(token_spec, token_spec, kernel_specs, None if bias is None else P()),
        out_specs=(token_spec, per_seq, P(), P()),
    )(x.astype(layer.dtype), logits.reshape(b, t, e), kernels, bias)
    return y, {**router, **dispatch_stats(tokens, kept)}


def _alltoall(layer, x, weights, experts, kernels, *, axes, impl):
    """One device: x [b, t, D], weights / experts [b, t, k], its experts' kernels -> (y [b, t, D] f32, routed and
    kept assignments per expert [E] of its tokens)."""
    b, t, d = x.shape
    k = weights.shape[-1]
    n = b * t
    ep = jax.lax.axis_size(axes)
    num_local = layer.cfg.num_experts // ep
    plan = layer.plan(weights.reshape(n, k), experts.reshape(n, k), b, t)
    xs = permute(x.reshape(n, d), plan.row_token, plan.row_valid, plan.dest, plan.keep)  # [n, D] -> [R, D]
    ws = row_weights(weights.reshape(n, k), plan)  # [R]
    rows = xs.shape[0]
    by_rank = plan.group_sizes.reshape(ep, num_local)  # [E] -> [ep, E/ep]: rows for each rank's experts
    counts = jax.lax.all_to_all(by_rank, axes, 0, 0, tiled=True)  # [ep (source), E/ep]: rows I receive
    send = by_rank.sum(1)
    route = _Route(send=send, offset=jnp.cumsum(send) - send, recv=counts.sum(1),
                   remote_offset=None if impl == "padded" else jax.lax.all_to_all(
                       jnp.cumsum(send) - send, axes, 0, 0, tiled=True))
    exchange = functools.partial(_dispatch, (axes, impl, rows))
    received = exchange(xs, route)  # [R, D] -> [ep, R, D]
    received_w = exchange(ws[:, None], route)[..., 0]  # [ep, R]
    order = _expert_order(counts, rows)
    sorted_x = checkpoint_name(_reorder(received.reshape(ep * rows, d), *order), "moe_dispatch")  # [ep*R, D]
    sorted_w = _reorder(received_w.reshape(ep * rows, 1), *order)[:, 0]
    y = layer.expert_rows(sorted_x, sorted_w, counts.sum(0), kernels, None)  # [ep*R, D]
    gather, inverse, valid_in, valid_out = order
    back = _reorder(y, inverse, gather, valid_out, valid_in).reshape(ep, rows, d)
    y_rows = _combine((axes, impl, rows), back, route)  # [ep, R, D] -> [R, D]
    y = unpermute(y_rows, plan.dest, plan.keep, plan.row_token, plan.row_valid)  # [R, D] -> [n, D]
    return y.reshape(b, t, d), plan.tokens_per_expert, plan.kept_tokens_per_expert


def _local(layer, x, weights, experts, kernels):
    """As _alltoall with every expert on this device: its tokens are one dispatch group, nothing is exchanged."""
    b, t, d = x.shape
    k = weights.shape[-1]
    y, plan = layer.dispatch_group(x.reshape(b * t, d), weights.reshape(b * t, k), experts.reshape(b * t, k), kernels,
                                   None, b, t)  # [n, D]; FP8 experts never come here (no metas)
    return y.reshape(b, t, d), plan.tokens_per_expert, plan.kept_tokens_per_expert


def _allgather(layer, x, weights, experts, kernels, *, axes):
    """As _alltoall, with every rank's tokens gathered and the partial sums reduce-scattered back (dropless)."""
    b, t, d = x.shape
    k = weights.shape[-1]
    n = b * t
    ep = jax.lax.axis_size(axes)
    num_local = layer.cfg.num_experts // ep
    gather = functools.partial(jax.lax.all_gather, axis_name=axes, axis=0, tiled=True)
    xa, wa, ea = gather(x.reshape(n, d)), gather(weights.reshape(n, k)), gather(experts.reshape(n, k))  # [ep*n, .]
    local = ea - jax.lax.axis_index(axes) * num_local
    mine = (local >= 0) & (local < num_local)
    # Other ranks' experts go to one extra group sorted last: its rows are past the local groups' sum, padding.
    plan = plan_dispatch(jnp.where(mine, local, num_local), wa, num_experts=num_local + 1)
    plan = plan._replace(keep=plan.keep & mine)
    xs = checkpoint_name(permute(xa, plan.row_token, plan.row_valid, plan.dest, plan.keep), "moe_dispatch")
    rows = layer.expert_rows(xs, row_weights(wa, plan), plan.group_sizes[:num_local], kernels, None)
    y = unpermute(rows, plan.dest, plan.keep, plan.row_token, plan.row_valid)  # [ep*k*n, D] -> [ep*n, D] f32
    y = jax.lax.psum_scatter(y, axes, scatter_dimension=0, tiled=True)  # [ep*n, D] -> [n, D]
    tokens = jnp.bincount(experts.reshape(-1), length=layer.cfg.num_experts).astype(jnp.int32)
    return y.reshape(b, t, d), tokens, tokens


class _Route(dict):
    """The sizes of one exchange (a pytree of int32 arrays): rows sent to each rank [ep] and where they start in
    the sender's rows, rows received from each rank [ep], and (ragged) where the sender's rows for this rank start
    at each rank."""

    def __init__(self, *, send, offset, recv, remote_offset):
        super().__init__(send=send, offset=offset, recv=recv, remote_offset=remote_offset)


jax.tree_util.register_pytree_node(_Route, lambda r: ((r["send"], r["offset"], r["recv"], r["remote_offset"]), None),
                                   lambda _, c: _Route(send=c[0], offset=c[1], recv=c[2], remote_offset=c[3]))


def _to_blocks(rows, sizes, offsets, block: int):
    """rows [R, D] -> [ep, block, D]: block r holds rows[offsets[r] : offsets[r] + sizes[r]], zeros after."""
    j = jnp.arange(block, dtype=jnp.int32)
    index = offsets[:, None] + j  # [ep, block]
    valid = j < sizes[:, None]
    return jnp.where(valid[..., None], rows[jnp.clip(index, 0, rows.shape[0] - 1)], jnp.zeros((), rows.dtype))


def _from_blocks(blocks, sizes, offsets, rows: int):
    """The inverse: blocks [ep, block, D] -> rows [R, D], row offsets[r] + j from blocks[r, j] (zeros elsewhere)."""
    i = jnp.arange(rows, dtype=jnp.int32)
    rank = jnp.clip(jnp.searchsorted(offsets, i, side="right") - 1, 0, blocks.shape[0] - 1)
    within = i - offsets[rank]
    valid = (within >= 0) & (within < sizes[rank])
    picked = blocks[rank, jnp.clip(within, 0, blocks.shape[1] - 1)]
    return jnp.where(valid[:, None], picked, jnp.zeros((), blocks.dtype))


def _send(how, rows, route):
    """rows [R, D] in the sender's layout -> [ep, R, D]: block s the rows from rank s."""
    axes, impl, block = how
    ep = route["send"].shape[0]
    if impl == "padded":
        return jax.lax.all_to_all(_to_blocks(rows, route["send"], route["offset"], block), axes, 0, 0)
    me = jax.lax.axis_index(axes)
    out = jnp.zeros((ep * block, rows.shape[1]), rows.dtype)
    out = jax.lax.ragged_all_to_all(rows, out, route["offset"], route["send"],
                                    jnp.full((ep,), me * block, jnp.int32), route["recv"], axis_name=axes)
    return out.reshape(ep, block, rows.shape[1])


def _return(how, blocks, route):
    """The transpose of _send: blocks [ep, R, D] (block s for rank s) -> rows [R, D] in this rank's layout."""
    axes, impl, block = how
    ep, _, d = blocks.shape
    if impl == "padded":
        return _from_blocks(jax.lax.all_to_all(blocks, axes, 0, 0), route["send"], route["offset"], block)
    out = jnp.zeros((block, d), blocks.dtype)
    starts = jnp.arange(ep, dtype=jnp.int32) * block
    return jax.lax.ragged_all_to_all(blocks.reshape(ep * block, d), out, starts, route["recv"],
                                     route["remote_offset"], route["send"], axis_name=axes)


def _linear_pair(forward, transpose):
    """forward(how, x, route) as a custom_vjp whose backward is `transpose` (the exchange the other way)."""
    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def run(how, x, route):
        return forward(how, x, route)

    def bwd(how, route, dy):
        return transpose(how, dy, route), jax.tree.map(lambda _: None, route)

    run.defvjp(lambda how, x, route: (forward(how, x, route), route), bwd)
    return run


_dispatch = _linear_pair(_send, _return)  # rows [R, D] -> blocks [ep, R, D]
_combine = _linear_pair(_return, _send)  # blocks [ep, R, D] -> rows [R, D]


def _expert_order(counts, block: int):
    """The receive buffer [ep * block] (block s from rank s: counts[s, e] rows of local expert e, in expert order)
    sorted by local expert, then source: (gather [P] the buffer position of each sorted position, inverse [P] the
    sorted position of each buffer position, valid_in [P] buffer positions holding a row, valid_out [P] sorted
    positions holding one), P = ep * block. Sorted positions past the rows received are padding."""
    ep, num_local = counts.shape
    total = counts.sum(0)  # [E/ep]
    expert_start = jnp.cumsum(total) - total  # [E/ep]: first sorted position of each local expert
    source_before = jnp.cumsum(counts, axis=0) - counts  # [ep, E/ep]: rows of expert e from lower ranks
    within_start = jnp.cumsum(counts, axis=1) - counts  # [ep, E/ep]: where expert e starts in block s
    positions = ep * block
    pos = jnp.arange(positions, dtype=jnp.int32)
    s, j = pos // block, pos % block
    e = jnp.clip(_rank_of(within_start, s, j), 0, num_local - 1)
    valid_in = j < counts.sum(1)[s]
    inverse = expert_start[e] + source_before[s, e] + (j - within_start[s, e])
    p = pos  # sorted positions, read back to the buffer
    valid_out = p < total.sum()
    e2 = jnp.clip(jnp.searchsorted(expert_start, p, side="right") - 1, 0, num_local - 1)
    u = p - expert_start[e2]
    s2 = jnp.clip(_rank_of(source_before.T, e2, u), 0, ep - 1)
    gather = s2 * block + within_start[s2, e2] + (u - source_before[s2, e2])
    zero = jnp.zeros((), jnp.int32)
    return (jnp.where(valid_out, gather, zero), jnp.where(valid_in, inverse, zero), valid_in, valid_out)


def _rank_of(starts, row, value):
    """For each i: the last c with starts[row[i], c] <= value[i] (starts' rows ascending)."""
    return (starts[row] <= value[:, None]).sum(1).astype(jnp.int32) - 1


@jax.custom_vjp
def _reorder(x, gather, inverse, valid_in, valid_out):
    """x [P, D] -> [P, D]: row p is x[gather[p]] where valid_out[p], else zero. Its gradient is the inverse
    reordering (inverse, valid_in)."""
    return jnp.where(valid_out[:, None], x[gather], jnp.zeros((), x.dtype))


def _reorder_fwd(x, gather, inverse, valid_in, valid_out):
    return _reorder(x, gather, inverse, valid_in, valid_out), (gather, inverse, valid_in, valid_out)


def _reorder_bwd(res, dy):
    gather, inverse, valid_in, valid_out = res
    return _reorder(dy, inverse, gather, valid_out, valid_in), None, None, None, None


_reorder.defvjp(_reorder_fwd, _reorder_bwd)
