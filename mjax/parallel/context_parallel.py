"""Context parallelism: attention across the ranks of the `context` mesh axis, each holding 1/cp of every sequence.

Every activation outside attention is split over the sequence by GSPMD (logical `seq` -> `context`); attention, the
one op that mixes positions, runs here inside a `shard_map` manual over `context`.

Load balancing (Megatron's dual-chunk placement): a sequence of T tokens is cut into 2cp chunks of c = T / (2cp);
rank r holds chunks r and 2cp - 1 - r, so under a causal mask every rank has the same attention work.
`load_balance_order` is that token order; the train loop applies it once to every [.., T] array of a batch (tokens,
targets, loss mask, positions, segment ids) before placing it, so token-wise layers need nothing, RoPE reads the
permuted positions, and the loss, a sum over tokens, is unchanged.

--cp_comm_type:
p2p         ring attention: K/V (and their segment ids) travel around the ring with `ppermute` while the block in
            hand is computed; each rank's two query chunks meet each visiting K/V chunk as one kernel call whose
            query offset (chunk distance x c) places the causal mask, the window and the kernel's block skipping
            exactly; partial outputs merge by their log-sum-exp. The backward is a second ring: K/V travel again
            with their gradient accumulators, each block's gradients recomputed against the merged output and
            log-sum-exp, and after the last step dK/dV take one more hop home. Saved per layer: this rank's q, k,
            v, output and log-sum-exp only.
all_gather  K/V (never Q, never the residual stream) are all-gathered, put in sequence order, and each query
            chunk attends to them with its offset; the backward reduce-scatters dK/dV.
a2a         Ulysses: all-to-all from sequence-split to head-split (heads grouped per tensor shard, so tensor
            parallelism keeps its split), whole-sequence attention with any kernel (cuDNN too, unless the run
            compiles with deterministic ops), and back. K/V heads fewer than tp x the all-to-all group are
            repeated up to it (their gradients summed back).

Blocks are attention with a traced query offset and the log-sum-exp (`dot_product_attention(..., offset=,
return_lse=True)`): the Pallas kernel (GPU) or the XLA reference; cuDNN takes neither and serves only a2a.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from mjax.kernels.attention import ATTN_CORE, attention_block_backward, dot_product_attention
from mjax.sharding import current_logical_sharding



def chunk_ids(rank, cp: int, load_balanced: bool = True):
    """The two chunks (of 2cp) that `rank` holds: (rank, 2cp - 1 - rank) load-balanced, else (2 rank, 2 rank + 1).
    `rank` may be traced."""
    return (rank, 2 * cp - 1 - rank) if load_balanced else (2 * rank, 2 * rank + 1)


def load_balance_order(seq_length: int, cp: int, load_balanced: bool = True) -> np.ndarray:
    """Token order [T] of the context-parallel layout: rank r's tokens are [r T/cp, (r + 1) T/cp) of it."""
    c = seq_length // (2 * cp)
    chunks = [g for r in range(cp) for g in chunk_ids(r, cp, load_balanced)]
    return np.concatenate([np.arange(g * c, (g + 1) * c) for g in chunks])


def to_context_layout(batch: dict, cp: int) -> dict:
    """Batch arrays [.., T] (numpy) in the load-balanced token order (identity for cp = 1). The positions are
    added first where the batch has none: the model's default (0..T-1) would be wrong in this order."""
    if cp == 1:
        return batch
    if "positions" not in batch:
        inputs = batch["inputs"]
        batch = {**batch, "positions": np.broadcast_to(np.arange(inputs.shape[-1], dtype=np.int32), inputs.shape)}
    return {k: np.take(v, load_balance_order(v.shape[-1], cp), axis=-1) for k, v in batch.items()}


@dataclasses.dataclass(frozen=True)
class ContextParallelAttention:
    """The model's core attention under a mesh (hashable: part of the model's static graph). Without context
    parallelism in the current sharding rules it is `dot_product_attention`."""
    comm_type: str = "p2p"  # --cp_comm_type
    a2a_size: int | None = None  # a2a+p2p: ranks of each all-to-all group (--hierarchical_context_parallel_sizes)
    load_balanced: bool = True  # False: contiguous chunks (the naive ring; benchmarks)
    deterministic: bool = False  # --deterministic_mode (a per-compile option; the dispatch reads XLA_FLAGS itself)

    def __call__(self, q, k, v, *, causal=True, sliding_window=None, segment_ids=None, scale=None, impl="auto"):
        """q [B, T, N, H], k/v [B, T, K, H] in the context layout, segment_ids [B, T] or None -> out [B, T, N, H]."""
        ctx = current_logical_sharding()
        mesh, rules = ctx if ctx is not None else (None, {})
        axes = tuple(rules.get("seq") or ())
        cp = 1 if mesh is None else int(np.prod([mesh.shape[a] for a in axes]))
        if cp == 1:
            return dot_product_attention(q, k, v, causal=causal, sliding_window=sliding_window,
                                         segment_ids=segment_ids, scale=scale, impl=impl,
                                         deterministic=self.deterministic)
        if len(axes) != 1:
            raise ValueError(f"context parallelism runs over one mesh axis, not {axes}")
        if q.shape[1] % (2 * cp):
            raise ValueError(f"context parallelism: a sequence of {q.shape[1]} tokens does not split into 2 x cp = "
                             f"{2 * cp} chunks; use a --seq_length divisible by {2 * cp}")
        a2a = {"p2p": 1, "all_gather": 1, "a2a": cp, "a2a+p2p": self.a2a_size}[self.comm_type]
        if a2a is None or cp % a2a:
            raise ValueError(f"--cp_comm_type=a2a+p2p needs an all-to-all group size dividing cp={cp}, got {a2a}")
        heads = tuple(rules.get("heads") or ())
        how = AttentionPlan(axis=axes[0], cp=cp, a2a=a2a, load_balanced=self.load_balanced, causal=bool(causal),
                   window=sliding_window, scale=scale, impl=impl, heads_axes=heads,
                   tp=int(np.prod([mesh.shape[a] for a in heads])), deterministic=self.deterministic)
        local = _allgather_attention if self.comm_type == "all_gather" else _attention
        return _shard_over_context(functools.partial(local, how), mesh, how.axis, q, k, v, segment_ids)


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """The static facts of one context-parallel attention call."""
    axis: str
    cp: int
    a2a: int  # ranks per all-to-all group (consecutive context ranks); the ring runs over cp / a2a groups
    load_balanced: bool
    causal: bool
    window: int | None
    scale: float | None
    impl: str
    heads_axes: tuple
    tp: int  # the heads' shards (tensor parallelism): the all-to-all keeps them
    deterministic: bool = False  # as ContextParallelAttention.deterministic

    @property
    def ring(self) -> int:
        return self.cp // self.a2a

    def attend(self, q, k, v, q_seg, kv_seg, offset=None, return_lse=False):
        seg = None if q_seg is None else (q_seg, kv_seg)
        return dot_product_attention(q, k, v, causal=self.causal, sliding_window=self.window, segment_ids=seg,
                                     scale=self.scale, impl=self.impl, return_lse=return_lse, offset=offset,
                                     deterministic=self.deterministic)

    def block_backward(self, q, k, v, out, lse, do, q_seg, kv_seg, offset):
        seg = None if q_seg is None else (q_seg, kv_seg)
        return attention_block_backward(q, k, v, out, lse, do, causal=self.causal, sliding_window=self.window,
                                        segment_ids=seg, scale=self.scale, impl=self.impl, offset=offset,
                                        deterministic=self.deterministic)

    def ring_position(self):
        return lax.axis_index(self.axis) // self.a2a

    def pieces(self, group):
        """The chunks, in order, of the sequence a ring position holds: its a2a group's ranks' chunks."""
        return [g for r in range(self.a2a) for g in chunk_ids(group * self.a2a + r, self.cp, self.load_balanced)]

    def groups(self):
        """The all-to-all groups (None: the whole axis)."""
        if self.a2a == self.cp:
            return None
        return [[g * self.a2a + r for r in range(self.a2a)] for g in range(self.ring)]

    def natural_order(self) -> np.ndarray:
        """Index [2cp]: where chunk g sits among the 2cp chunks gathered in rank order."""
        where = np.empty(2 * self.cp, np.int32)
        for r in range(self.cp):
            for i, g in enumerate(chunk_ids(r, self.cp, self.load_balanced)):
                where[g] = 2 * r + i
        return where


def _shard_over_context(local, mesh, axis, q, k, v, segment_ids):
    """shard_map manual over the context axis (nested inside the pipeline's when there is one)."""
    context = jax.sharding.get_abstract_mesh()
    nested = not context.empty and any(t == AxisType.Manual for t in context.axis_types)
    seq = P(None, axis)
    fn = jax.checkpoint(local) if nested else local  # JAX cannot lower a nested shard_map's saved residuals
    return jax.shard_map(fn, mesh=context if nested else mesh, axis_names={axis}, check_vma=False,
                         in_specs=(seq, seq, seq, None if segment_ids is None else seq), out_specs=seq,
                         )(q, k, v, segment_ids)


def _split(x, m: int, axis=1):  # [B, m c, ...] -> m arrays [B, c, ...]
    c = x.shape[axis] // m
    return [lax.slice_in_dim(x, i * c, (i + 1) * c, axis=axis) for i in range(m)]


def _seg_split(seg, m: int):
    return [None] * m if seg is None else _split(seg, m)


def _shift(tree, how: AttentionPlan):
    """Every array to the next position of the ring (the same rank of the next a2a group), so each rank receives
    its predecessor's."""
    perm = [(i, (i + how.a2a) % how.cp) for i in range(how.cp)]
    return jax.tree.map(lambda x: lax.ppermute(x, how.axis, perm), tree)


def _merge(acc, block):
    """Two partial attentions (out f32 [B, c, N, H], lse [B, N, c]) of one query chunk -> their union's."""
    (o1, l1), (o2, l2) = acc, block
    lse = jnp.logaddexp(l1, l2)
    safe = jnp.where(jnp.isneginf(lse), 0.0, lse)  # a row no key reached so far stays (0, -inf)
    w1, w2 = (jnp.swapaxes(jnp.exp(x - safe), 1, 2)[..., None] for x in (l1, l2))  # [B, N, c] -> [B, c, N, 1]
    return o1 * w1 + o2.astype(jnp.float32) * w2, lse


def _attention(how, q, k, v, seg):
    """One rank of p2p, a2a and a2a+p2p: heads <-> sequence all-to-all within the a2a groups (none for p2p),
    then ring attention over the groups (one group for a2a: whole-sequence attention)."""
    if how.a2a > 1:
        q, k, v, seg = _heads_split(how, q, k, v, seg)
    if how.ring == 1:
        out = _whole_sequence(how, q, k, v, seg)
    else:
        out = _ring_attention(how, q, k, v, seg)
    return _seq_split(how, out) if how.a2a > 1 else out


# ---- p2p: ring attention ----

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attention(how, q, k, v, seg):
    return _ring_forward(how, q, k, v, seg)[0]


def _ring_forward(how, q, k, v, seg):
    """One ring position: q [B, m c, N, H], k/v [B, m c, K, H], seg [B, m c] or None (m = 2 x a2a chunks) ->
    (out [B, m c, N, H], lse [B, N, m c])."""
    b, t, n, h = q.shape
    m = 2 * how.a2a
    c = t // m
    mine = how.pieces(how.ring_position())
    qs, q_segs = _split(q, m), _seg_split(seg, m)
    acc = [(jnp.zeros((b, c, n, h), jnp.float32), jnp.full((b, n, c), -jnp.inf, jnp.float32))] * m
    held = (k, v, seg)  # the K/V block in hand: ring position (mine - step)'s
    for step in range(how.ring):
        theirs = how.pieces((how.ring_position() - step) % how.ring)
        arriving = _shift(held, how) if step < how.ring - 1 else None  # in flight while this block is computed
        acc = ring_step_forward(how, qs, q_segs, mine, held, theirs, acc)
        held = arriving
    out = jnp.concatenate([o for o, _ in acc], axis=1).astype(q.dtype)  # [B, m c, N, H]
    lse = jnp.concatenate([l for _, l in acc], axis=2)  # [B, N, m c]
    return out, lse


def ring_step_forward(how, qs, q_segs, mine, held, theirs, acc):
    """One step of one ring position: its query chunks `qs` (global chunk ids `mine`) meet the K/V block in hand
    `held` = (k, v, segment ids or None) holding chunks `theirs`; each (query chunk, key chunk) is one attention
    call at offset (chunk distance x c), merged into `acc` [(out f32, lse)] per query chunk."""
    m = len(qs)
    c = qs[0].shape[1]
    ks, vs, kv_segs = _split(held[0], m), _split(held[1], m), _seg_split(held[2], m)
    acc = list(acc)
    for i in range(m):
        for j in range(m):
            block = how.attend(qs[i], ks[j], vs[j], q_segs[i], kv_segs[j], (mine[i] - theirs[j]) * c,
                               return_lse=True)
            acc[i] = _merge(acc[i], block)
    return acc


def _ring_fwd(how, q, k, v, seg):
    out, lse = _ring_forward(how, q, k, v, seg)
    # Named as the flash kernel names its results: a remat policy that keeps attn_core keeps the ring's output
    # instead of rerunning the whole ring in the backward.
    out, lse = checkpoint_name(out, ATTN_CORE), checkpoint_name(lse, ATTN_CORE)
    return out, (q, k, v, seg, out, lse)


def _ring_bwd(how, residuals, do):
    q, k, v, seg, out, lse = residuals
    m = 2 * how.a2a
    mine = how.pieces(how.ring_position())
    qs, q_segs, outs, dos, lses = _split(q, m), _seg_split(seg, m), _split(out, m), _split(do, m), _split(lse, m, 2)
    dq = [jnp.zeros(x.shape, jnp.float32) for x in qs]
    held = (k, v, seg)
    grads = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))  # travel with the block in hand
    for step in range(how.ring):
        theirs = how.pieces((how.ring_position() - step) % how.ring)
        arriving = _shift(held, how) if step < how.ring - 1 else None
        dq, grads = ring_step_backward(how, (qs, q_segs, outs, lses, dos), mine, held, theirs, dq, grads)
        grads = _shift(grads, how)  # with the block to the next position; after the last step: home
        held = arriving
    dq = jnp.concatenate(dq, axis=1).astype(q.dtype)
    return dq, grads[0].astype(k.dtype), grads[1].astype(v.dtype), None


def ring_step_backward(how, queries, mine, held, theirs, dq, grads):
    """The backward of ring_step_forward: `queries` = (q chunks, their segment ids, the merged out, lse and the
    out's cotangent, each per chunk); adds this block's dq per query chunk to `dq` and its dK, dV (accumulated in
    f32, the whole block) to `grads`."""
    qs, q_segs, outs, lses, dos = queries
    m = len(qs)
    c = qs[0].shape[1]
    ks, vs, kv_segs = _split(held[0], m), _split(held[1], m), _seg_split(held[2], m)
    dks, dvs, dq = _split(grads[0], m), _split(grads[1], m), list(dq)
    for i in range(m):
        for j in range(m):
            dqi, dkj, dvj = how.block_backward(qs[i], ks[j], vs[j], outs[i], lses[i], dos[i], q_segs[i], kv_segs[j],
                                               (mine[i] - theirs[j]) * c)
            dq[i] = dq[i] + dqi.astype(jnp.float32)
            dks[j] = dks[j] + dkj.astype(jnp.float32)
            dvs[j] = dvs[j] + dvj.astype(jnp.float32)
    return dq, (jnp.concatenate(dks, axis=1), jnp.concatenate(dvs, axis=1))


_ring_attention.defvjp(_ring_fwd, _ring_bwd)


# ---- all_gather ----

def _allgather_attention(how, q, k, v, seg):
    """One rank: gathers K/V in sequence order; each query chunk attends with its offset (backward: autodiff,
    the gather's transpose reduce-scatters dK/dV)."""
    c = q.shape[1] // 2
    kn, vn = (_in_sequence_order(how, lax.all_gather(x, how.axis, axis=1, tiled=True), c) for x in (k, v))
    kv_seg = None if seg is None else _in_sequence_order(how, lax.all_gather(seg, how.axis, axis=1, tiled=True), c)
    mine = chunk_ids(lax.axis_index(how.axis), how.cp, how.load_balanced)
    qs, q_segs = _split(q, 2), _seg_split(seg, 2)
    return jnp.concatenate([how.attend(qs[i], kn, vn, q_segs[i], kv_seg, mine[i] * c) for i in range(2)], axis=1)


def _in_sequence_order(how, x, c: int, inverse: bool = False):
    """[B, 2cp c, ...] with the chunks in rank order (as gathered) -> in sequence order (or back, `inverse`)."""
    where = how.natural_order()
    x = x.reshape(x.shape[0], 2 * how.cp, c, *x.shape[2:])[:, np.argsort(where) if inverse else where]
    return x.reshape(x.shape[0], 2 * how.cp * c, *x.shape[3:])


# ---- a2a: Ulysses (whole sequences within each all-to-all group) ----

def _whole_sequence(how, q, k, v, seg):
    """a2a: q/k/v hold whole sequences (chunks in rank order); attention in sequence order with any kernel."""
    c = q.shape[1] // (2 * how.cp)
    order = functools.partial(_in_sequence_order, how, c=c)
    seg = None if seg is None else order(seg)
    return order(how.attend(order(q), order(k), order(v), seg, seg), inverse=True)


def _heads_split(how, q, k, v, seg):
    """[B, 2c, heads, H] per rank -> [B, 2c a2a, heads / a2a, H]: each rank of an a2a group gets its share of the
    heads (within every tensor shard's heads) for the group's whole sequence (chunks in rank order)."""
    n, kh = q.shape[2], k.shape[2]
    slots = how.tp * how.a2a  # head groups: tensor shard major, a2a rank minor
    if n % slots:
        raise ValueError(f"--cp_comm_type=a2a / a2a+p2p: {n} attention heads do not split over tp x the "
                         f"all-to-all group = {slots}")
    if kh % slots and slots % kh:
        raise ValueError(f"--cp_comm_type=a2a / a2a+p2p: {kh} KV heads neither split over nor divide tp x the "
                         f"all-to-all group = {slots}")
    if kh < slots:
        k, v = jnp.repeat(k, slots // kh, axis=2), jnp.repeat(v, slots // kh, axis=2)  # [B, 2c, tp a2a, H]
    q, k, v = (_exchange(how, x, to_heads=True) for x in (q, k, v))
    if seg is not None:
        seg = lax.all_gather(seg, how.axis, axis=1, tiled=True, axis_index_groups=how.groups())
    return q, k, v, seg


def _seq_split(how, out):
    """The inverse of _heads_split for the attention output: [B, 2c a2a, N / a2a, H] -> [B, 2c, N, H]."""
    return _exchange(how, out, to_heads=False)


def _exchange(how, x, *, to_heads: bool):
    """The all-to-all between sequence-split [B, t, heads, H] and head-split [B, t a2a, heads / a2a, H]."""
    b, t, heads, h = x.shape
    if to_heads:
        x = _constrain_heads(x.reshape(b, t, how.tp, how.a2a, heads // (how.tp * how.a2a), h), how)
        x = lax.all_to_all(x, how.axis, 3, 1, tiled=True, axis_index_groups=how.groups())  # [B, t a2a, tp, 1, g, H]
        return x.reshape(b, t * how.a2a, heads // how.a2a, h)
    x = _constrain_heads(x.reshape(b, t, how.tp, 1, heads // how.tp, h), how)
    x = lax.all_to_all(x, how.axis, 1, 3, tiled=True, axis_index_groups=how.groups())  # [B, t / a2a, tp, a2a, g, H]
    return x.reshape(b, t // how.a2a, heads * how.a2a, h)


def _constrain_heads(x, how: AttentionPlan):
    """Keeps [B, T, tp, a2a, g, H]'s tensor split on its tp dim, where the heads' split puts it."""
    if how.tp == 1:
        return x
    axes = how.heads_axes[0] if len(how.heads_axes) == 1 else how.heads_axes
    return lax.with_sharding_constraint(x, P(None, None, axes))
