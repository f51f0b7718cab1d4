"""Runs a custom attention kernel per shard under the active mesh. XLA cannot partition a Pallas call, so without
this every device would gather the whole batch and all heads; here each device attends over its own batch rows and
heads (K/V heads replicated over tp are sliced down to the ones its query heads use)."""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mjax.kernels.attention.errors import AttentionUnsupported
from mjax.sharding import current_logical_sharding, logical_to_spec


def _axes(entry) -> tuple:
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def _size(mesh, entry) -> int:
    n = 1
    for a in _axes(entry):
        n *= mesh.shape[a]
    return n


def _drop_trivial(spec, mesh) -> tuple:
    """Spec entries without the mesh axes of size 1 (they shard nothing)."""
    out = []
    for entry in spec:
        kept = tuple(a for a in _axes(entry) if mesh.shape[a] > 1)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return tuple(out)


def shard_attention(kernel, q, k, v, *, segment_ids, return_lse, **kwargs):
    """kernel(q, k, v, segment_ids=..., return_lse=..., **kwargs) on each shard; identity wrapper without a mesh."""
    ctx = current_logical_sharding()
    if ctx is None or ctx[0] is None or ctx[0].size == 1:
        return kernel(q, k, v, segment_ids=segment_ids, return_lse=return_lse, **kwargs)
    mesh, rules = ctx
    q_spec = _drop_trivial(logical_to_spec(("batch", "seq", "heads", None), rules, q.shape, mesh), mesh)
    kv_spec = _drop_trivial(logical_to_spec(("batch", "seq", "kv_heads", None), rules, k.shape, mesh), mesh)
    if q_spec[1] is not None or kv_spec[1] is not None:
        raise AttentionUnsupported("the pallas attention kernel sees whole sequences; with --cp > 1 attention "
                                   "must go through context-parallel attention")
    batch, heads = q_spec[0], q_spec[2]
    if kv_spec[2] is not None and kv_spec[2] != heads:
        raise AttentionUnsupported(f"KV heads sharded over {kv_spec[2]} but query heads over {heads}")
    n, kv_heads = q.shape[2], k.shape[2]
    local_n = n // _size(mesh, heads)
    slice_kv = kv_spec[2] is None and heads is not None  # K/V replicated: take the heads this shard's queries use
    kv_in = P(batch, None, None if slice_kv else heads, None)
    seg_spec = P(batch, None)

    def body(q, k, v, seg):
        if slice_kv:
            group = n // kv_heads
            rank = jax.lax.axis_index(_axes(heads)) if heads else 0
            count = max(local_n // group, 1)
            start = rank * local_n // group
            k, v = (jax.lax.dynamic_slice_in_dim(x, start, count, axis=2) for x in (k, v))
        return kernel(q, k, v, segment_ids=seg, return_lse=return_lse, **kwargs)

    out_specs = (P(batch, None, heads, None), P(batch, heads, None)) if return_lse else P(batch, None, heads, None)
    seg = segment_ids if segment_ids is not None else jnp.zeros(q.shape[:2], jnp.int32)
    fn = body if segment_ids is not None else functools.partial(_without_segments, body)
    return jax.shard_map(fn, mesh=mesh, in_specs=(P(batch, None, heads, None), kv_in, kv_in, seg_spec),
                         out_specs=out_specs, check_vma=False)(q, k, v, seg)


def _without_segments(body, q, k, v, seg):
    del seg
    return body(q, k, v, None)
