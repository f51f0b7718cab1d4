"""The flash kernels per shard under a mesh (mjax/kernels/per_shard.py). XLA cannot partition a Pallas call, so
without this every device would gather the whole batch and all heads; here each device attends over its own batch
rows and query heads, forward and backward (each kernel wrapped: custom_partitioning has no autodiff rule).

Factors: q [b t n h], k/v [b s k h], the offset [b], segment ids [b t] and [b s], out [b t n h], lse [b n t].
Batch and heads keep the operands' split; sequences and the head dim are whole (a split sequence is gathered:
context parallelism is another algorithm, and `check_whole_sequences` refuses rules that split it). K/V heads are
split with the query heads or not at all; whole K/V heads beside split query heads are sliced to the ones this
shard's queries use (their gradients summed over the query-head shards), and query heads that would straddle KV
groups stay whole.
"""

import functools
import math

import jax
import jax.numpy as jnp

from mjax.kernels.attention.errors import AttentionUnsupported
from mjax.kernels.attention.flash_backward import flash_backward
from mjax.kernels.attention.flash_forward import flash_forward
from mjax.kernels.per_shard import Shard, per_shard
from mjax.sharding import current_logical_sharding, shards

_QKV = "b t n h, b s k h, b s k h"
_SEGMENTS = ", b t, b s"
_WHOLE = ("t", "s", "h")


def check_whole_sequences(q_len: int, kv_len: int) -> None:
    """The kernel sees whole sequences: under sharding rules that split them (--cp > 1), it is the wrong algorithm,
    unless the sequence's mesh axes are manual here (inside context parallelism's shard_map: a local block)."""
    ctx = current_logical_sharding()
    axes = set((ctx[1] if ctx else {}).get("seq") or ())
    context = jax.sharding.get_abstract_mesh()
    manual = set() if context.empty else {a for a, t in zip(context.axis_names, context.axis_types)
                                          if t == jax.sharding.AxisType.Manual}
    n = shards("seq")
    if n > 1 and not axes <= manual and (q_len % n == 0 or kv_len % n == 0):
        raise AttentionUnsupported("the pallas attention kernel sees whole sequences; with --cp > 1 attention "
                                   "must go through context-parallel attention")


def _split_heads_together(axes: dict, sizes: dict, mesh_shape: dict) -> dict:
    """K/V heads split only as the query heads are; query heads whole where a shard's would straddle KV groups."""
    heads, kv_heads = axes["n"], axes["k"]
    if heads is not None and kv_heads != heads:
        local = sizes["n"] // math.prod(mesh_shape[a] for a in heads)
        group = sizes["n"] // sizes["k"]
        if local % group and group % local:
            heads = None
    return axes | {"n": heads, "k": kv_heads if kv_heads == heads else None}


def _kv_slice(n_local: int, kv_heads: int, shards: dict) -> tuple:
    """(first KV head, count) that this shard's query heads use, or None when K/V are split with them."""
    heads, kv = shards["n"], shards["k"]
    if heads.count == kv.count:
        return None
    group = n_local * heads.count // kv_heads
    return heads.index * n_local // group, max(n_local // group, 1)


def _kernels(kernel: str):
    """(forward, backward) of the Triton ("pallas") or the Hopper ("mosaic") kernels; one interface."""
    if kernel == "mosaic":
        from mjax.kernels.attention.mosaic import mosaic_backward_op, mosaic_forward_op  # noqa: PLC0415

        return mosaic_forward_op, mosaic_backward_op
    return flash_forward, flash_backward


@functools.cache
def _ops(kernel, spec, blocks, scale, interpret):
    """The (forward, backward) per-shard ops of one kernel configuration."""
    forward_kernel, backward_kernel = _kernels(kernel)
    # the operands both kernels take: q, k, v, then the per-row offset and the segment ids when the spec has them
    qkv = _QKV + (", b" if spec.dynamic_offset else "") + (_SEGMENTS if spec.segments else "")
    common = dict(replicated=_WHOLE, shard_index=("n", "k"), adjust=_split_heads_together)
    config = dict(spec=spec, blocks=blocks, scale=scale, interpret=interpret)
    n_extra = int(spec.dynamic_offset) + 2 * int(spec.segments)

    def split(args):  # (offset, q_seg, kv_seg) with Nones for what this spec lacks, and the remaining args
        extra, args = list(args[:n_extra]), args[n_extra:]
        offset = extra.pop(0) if spec.dynamic_offset else None
        q_seg, kv_seg = extra if spec.segments else (None, None)
        return (offset, q_seg, kv_seg), args

    def forward(q, k, v, *rest, shards):
        (offset, q_seg, kv_seg), () = split(rest)
        if (cut := _kv_slice(q.shape[2], k.shape[2], shards)) is not None:
            k, v = (jax.lax.dynamic_slice_in_dim(x, *cut, axis=2) for x in (k, v))  # [B, S, K, H] -> [B, S, c, H]
        return forward_kernel(q, k, v, q_seg, kv_seg, offset, **config)

    def backward(q, k, v, *rest, shards):
        (offset, q_seg, kv_seg), (out, lse, do, dlse) = split(rest)
        cut = _kv_slice(q.shape[2], k.shape[2], shards)
        kk, vv = (k, v) if cut is None else (jax.lax.dynamic_slice_in_dim(x, *cut, axis=2) for x in (k, v))
        dq, dk, dv = backward_kernel(q, kk, vv, q_seg, kv_seg, out, lse, do, dlse, offset, **config)
        if cut is not None:  # this shard's part of the whole K/V heads' gradients, summed over the shards
            dk, dv = (jax.lax.dynamic_update_slice_in_dim(jnp.zeros_like(x), d, cut[0], axis=2)
                      for x, d in ((k, dk), (v, dv)))  # [B, S, c, H] -> [B, S, K, H]
        return dq, dk, dv

    if kernel == "mosaic" and interpret:
        # The Mosaic GPU interpreter's callbacks are ordered effects, which custom_partitioning cannot lower: the
        # interpreted kernels (tests, off the GPU) run on the whole arrays.
        whole = {"n": Shard(0, 1), "k": Shard(0, 1)}
        return functools.partial(forward, shards=whole), functools.partial(backward, shards=whole)
    return (per_shard(forward, f"{qkv} -> b t n h, b n t", **common),
            per_shard(backward, f"{qkv}, b t n h, b n t, b t n h, b n t -> b t n h, b s k h, b s k h",
                      sum_over_shards=(1, 2), **common))


def _extra(offset, q_seg, kv_seg) -> tuple:
    return (() if offset is None else (offset,)) + (() if q_seg is None else (q_seg, kv_seg))


def sharded_forward(q, k, v, q_seg, kv_seg, offset, *, kernel="pallas", spec, blocks, scale, interpret):
    """The forward kernel per shard: padded q [B,Tp,N,Hp], k/v [B,Sp,K,Hp], segment ids and the offset [B] or
    None -> (out, lse)."""
    return _ops(kernel, spec, blocks, scale, interpret)[0](q, k, v, *_extra(offset, q_seg, kv_seg))


def sharded_backward(q, k, v, q_seg, kv_seg, offset, out, lse, do, dlse, *, kernel="pallas", spec, blocks, scale,
                     interpret):
    """The backward kernels per shard -> (dq, dk, dv)."""
    return _ops(kernel, spec, blocks, scale, interpret)[1](q, k, v, *_extra(offset, q_seg, kv_seg), out, lse, do, dlse)
