"""The Mosaic GPU (Hopper) flash-attention kernels off the GPU: the block runs they read, against a NumPy mask, and
that forward and backward lower for CUDA (the Mosaic GPU compiler's passes run at lowering; the values are checked
on a Hopper GPU by tests/gpu/test_attention_kernels.py).

The kernels apply no mask at all in a run's unmasked middle blocks (not even segment ids), so the runs must be exact
in both directions: no block holding a visible (query, key) pair outside [lo, hi), no block holding a masked one in
[full_lo, full_hi). They come from `mosaic.block_runs` on the operands `flash._prepare` pads, as the kernels get them.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mjax.kernels.attention import flash, mosaic
from mjax.kernels.attention.flash import flash_attention
from mjax.kernels.attention.mosaic import MosaicBlocks, default_mosaic_blocks
from mjax.kernels.attention.persistent import (ROW_ORDER_SLACK, deal, deal_order, deal_pairs, item_works,
                                              modelled_work, persistent_work, persistent_works, program_loads)
from mjax.kernels.options import ATTN_CORE

DEFAULT = default_mosaic_blocks(128)
# 128-row query tiles against 64-row key blocks and back: the other ratio of tile to streamed block in each kernel
OTHER = MosaicBlocks(block_q=128, block_kv=64, block_q_dq=128, block_kv_dq=128, block_q_dkv=128, block_kv_dkv=64)

# (id, batch, T, S, offset): ragged lengths, the default offset S - T, static offsets (negative: the first queries
# see no key), and a traced per-row offset (context parallelism's blocks; 300: queries past every key)
LENGTHS = [
    ("t300", 2, 300, 300, None),
    ("t200-s333", 2, 200, 333, None),
    ("t256-s384-off40", 2, 256, 384, 40),
    ("t256-off-50", 2, 256, 256, -50),
    ("t256-s320-traced", 4, 256, 320, (-100, 0, 37, 300)),
]
# none; packed documents (sorted ids, each query in its key position's document); independently sorted query and
# key ids (a ring attention pair); arbitrary ids
SEGMENTS = ["none", "packed", "sorted", "unsorted"]
DOCS = 4


def _offsets(b, t, s, offset):
    if offset is None:
        return np.full(b, s - t)
    return np.full(b, offset) if isinstance(offset, int) else np.asarray(offset)


def _segment_ids(kind, rng, b, t, s, offsets):
    if kind == "none":
        return None
    if kind == "unsorted":
        return rng.integers(0, DOCS, (b, t)), rng.integers(0, DOCS, (b, s))
    if kind == "sorted":
        return np.sort(rng.integers(0, DOCS, (b, t)), 1), np.sort(rng.integers(0, DOCS, (b, s)), 1)
    kv = np.sort(rng.integers(0, DOCS, (b, s)), 1)
    pos = np.clip(np.arange(t)[None] + offsets[:, None], 0, s - 1)
    return np.take_along_axis(kv, pos, 1), kv


def _visible(offsets, tp, sp, *, causal, window, kv_len, q_seg=None, kv_seg=None):
    """[B, Tp, Sp] bool: padded query row i sits at key position i + offsets[b] and sees key j when j < kv_len,
    j <= i + offset (causal), i + offset - j < window, and q_seg[i] == kv_seg[j]."""
    i = np.arange(tp)[None, :, None] + offsets[:, None, None]
    j = np.arange(sp)[None, None, :]
    vis = np.broadcast_to(j < kv_len, (len(offsets), tp, sp))
    if causal:
        vis = vis & (j <= i)
    if window is not None:
        vis = vis & (i - j < window)
    if q_seg is not None:
        vis = vis & (q_seg[:, :, None] == kv_seg[:, None, :])
    return vis


def _per_tile(vis, bq, bk, by_query):
    """([B, tiles, blocks] any visible, all visible) over tiles of bq query rows and key blocks of bk (by_query),
    or tiles of bk keys and query blocks of bq."""
    b, tp, sp = vis.shape
    blocks = vis.reshape(b, tp // bq, bq, sp // bk, bk)
    any_, all_ = blocks.any((2, 4)), blocks.all((2, 4))
    return (any_, all_) if by_query else (any_.swapaxes(1, 2), all_.swapaxes(1, 2))


def _check_runs(runs, vis, loose, *, tight, case):
    """runs [B, tiles, 4] against the mask; `loose` is the per-tile visibility with key padding ignored, which
    bounds hi where the range math is known to overshoot (see the test)."""
    any_v, all_v = vis
    n = any_v.shape[-1]
    assert runs.shape == (*any_v.shape[:2], 4), case
    for row, tile in np.ndindex(runs.shape[:2]):
        lo, full_lo, full_hi, hi = (int(x) for x in runs[row, tile])
        at = f"{case} row={row} tile={tile} runs=({lo}, {full_lo}, {full_hi}, {hi}) of {n} blocks"
        assert 0 <= lo <= full_lo <= full_hi <= hi <= n, at
        seen = np.flatnonzero(any_v[row, tile])
        skipped = seen[(seen < lo) | (seen >= hi)]
        assert skipped.size == 0, f"{at}: skips blocks {skipped.tolist()} that hold visible pairs"
        masked = full_lo + np.flatnonzero(~all_v[row, tile, full_lo:full_hi])
        assert masked.size == 0, f"{at}: runs blocks {masked.tolist()} unmasked that hold masked pairs"
        if tight and seen.size:
            last = seen[-1] + 1
            bound = last if loose is None else np.flatnonzero(loose[row, tile])[-1] + 1
            assert lo == seen[0] and last <= hi <= bound, \
                f"{at}: not tight, visible pairs lie in blocks [{seen[0]}, {last})"


CASES = [
    pytest.param(*lengths[1:], causal, window, segments, blocks, seed,
                 id=f"{lengths[0]}-{'causal' if causal else 'full'}-w{window}-{segments}-{name}")
    for seed, (lengths, causal, window, segments, (name, blocks)) in enumerate(itertools.product(
        LENGTHS, [True, False], [None, 70], SEGMENTS, [("default", DEFAULT), ("other", OTHER)]))
]


@pytest.mark.parametrize("b,t,s,offset,causal,window,segments,blocks,seed", CASES)
def test_block_runs_match_the_mask(b, t, s, offset, causal, window, segments, blocks, seed):
    """For each kernel's runs: every visible pair is visited, the unmasked runs are fully visible, and (no ids or
    packed documents) lo and hi are the first and one past the last block with a visible pair."""
    rng = np.random.default_rng(seed)
    offsets = _offsets(b, t, s, offset)
    ids = _segment_ids(segments, rng, b, t, s, offsets)
    q = jnp.zeros((b, t, 2, 8), jnp.bfloat16)
    k = jnp.zeros((b, s, 1, 8), jnp.bfloat16)
    call = flash._prepare(q, k, k, causal, window, None if ids is None else tuple(map(jnp.asarray, ids)), None,
                          offset if offset is None or isinstance(offset, int) else jnp.asarray(offset, jnp.int32),
                          blocks, None, "mosaic")
    spec, q_seg, kv_seg, offset_operand = call.spec, *call.operands[3:]
    tp, sp = spec.q_len_padded, spec.kv_len_padded
    assert tp % blocks.q_multiple == 0 and sp % blocks.k_multiple == 0 and tp >= t and sp >= s
    assert spec.dynamic_offset == (offset_operand is not None) == (offset is not None and not isinstance(offset, int))
    offset_rows = mosaic._offsets(spec, offset_operand, b)
    np.testing.assert_array_equal(np.asarray(offset_rows), offsets)
    mask = dict(causal=causal, window=window, kv_len=s)
    if ids is not None:
        q_seg, kv_seg = np.asarray(q_seg), np.asarray(kv_seg)
        np.testing.assert_array_equal(q_seg, np.pad(ids[0], ((0, 0), (0, tp - t)), mode="edge"))
        np.testing.assert_array_equal(kv_seg, np.pad(ids[1], ((0, 0), (0, sp - s)), mode="edge"))
        mask.update(q_seg=q_seg, kv_seg=kv_seg)
    vis = _visible(offsets, tp, sp, **mask)
    # Known overshoot: q_block_ranges bounds a key tile's window from its last key, padded or not, so a tile holding
    # padded keys may visit query blocks that only the padding would see (all masked: time, not results).
    loose = _visible(offsets, tp, sp, **{**mask, "kv_len": sp})
    for name, bq, bk, by_query in (("forward", blocks.block_q, blocks.block_kv, True),
                                   ("dq", blocks.block_q_dq, blocks.block_kv_dq, True),
                                   ("dkv", blocks.block_q_dkv, blocks.block_kv_dkv, False)):
        runs = mosaic.block_runs(spec, offset_rows, None if ids is None else jnp.asarray(q_seg),
                                 None if ids is None else jnp.asarray(kv_seg), block_q=bq, block_kv=bk,
                                 by_query=by_query)
        assert runs.dtype == jnp.int32
        loose_any = None if by_query or window is None else _per_tile(loose, bq, bk, by_query)[0]
        _check_runs(np.asarray(runs), _per_tile(vis, bq, bk, by_query), loose_any,
                    tight=segments in ("none", "packed"), case=f"seed={seed} {name} bq={bq} bk={bk}")
        # the work the deal sorts items by: the blocks the kernels stream for each item, from the first block either
        # of its two tiles visits to the last (a tile with an empty run adds none)
        r = np.asarray(runs)
        streamed = [[_span([(r[row, 2 * i + j, 0], r[row, 2 * i + j, 3]) for j in (0, 1)])
                     for i in range(r.shape[1] // 2)] for row in range(b)]
        np.testing.assert_array_equal(np.asarray(item_works(runs)), streamed)


def _span(runs):
    """Blocks from the first to the last of the non-empty [lo, hi) runs, 0 if all are empty."""
    runs = [(lo, hi) for lo, hi in runs if lo < hi]
    return max(hi for _, hi in runs) - min(lo for lo, _ in runs) if runs else 0


def _lower(b, t, s, n, kh, h, dtype, *, segments=False, traced_offset=False, **kw):
    """(mosaic_gpu custom calls in the forward alone, in forward + backward, shapes of the gradients)."""
    def attention(q, k, v, *extra):
        offset = extra[0] if traced_offset else None
        seg = extra[-1] if segments else None
        return flash_attention(q, k, v, segment_ids=seg, offset=offset, kernel="mosaic", interpret=False, **kw)

    def fwd_bwd(q, k, v, cotangent, *extra):
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, *extra), q, k, v)
        return out, vjp(cotangent)

    qkv = (jax.ShapeDtypeStruct((b, t, n, h), dtype), *[jax.ShapeDtypeStruct((b, s, kh, h), dtype)] * 2)
    extra = (((jax.ShapeDtypeStruct((b,), jnp.int32),) if traced_offset else ())
             + ((jax.ShapeDtypeStruct((b, t), jnp.int32),) if segments else ()))
    cotangent = jax.eval_shape(attention, *qkv, *extra)

    def calls(f, *args):
        traced = jax.jit(f).trace(*args)
        return traced.lower(lowering_platforms=("cuda",)).as_text().count("stablehlo.custom_call @mosaic_gpu"), traced

    forward, _ = calls(attention, *qkv, *extra)
    both, traced = calls(fwd_bwd, *qkv, cotangent, *extra)
    grads = jax.tree.map(lambda x: (x.shape, x.dtype), traced.out_info[1])
    assert grads == tuple((x.shape, x.dtype) for x in qkv)
    return forward, both


@pytest.mark.parametrize("b,t,s,n,kh,h,dtype,kw,calls", [
    pytest.param(2, 512, 512, 4, 2, 128, jnp.bfloat16, dict(causal=True), 3, id="gqa2-causal-bf16-h128"),
    pytest.param(2, 300, 300, 4, 2, 64, jnp.float16, dict(causal=True, sliding_window=100, segments=True), 3,
                 id="window-packed-ragged-f16-h64"),
    # dk and dv in two passes of the dkv kernel at head dim 256
    pytest.param(1, 256, 256, 2, 2, 256, jnp.bfloat16, dict(causal=False, return_lse=True), 4,
                 id="full-lse-bf16-h256"),
    pytest.param(2, 256, 384, 4, 1, 96, jnp.bfloat16, dict(causal=True, traced_offset=True), 3,
                 id="mqa-traced-offset-bf16-h96"),
])
def test_forward_and_backward_lower_for_cuda(b, t, s, n, kh, h, dtype, kw, calls):
    assert _lower(b, t, s, n, kh, h, dtype, **kw) == (1, calls)  # forward; forward, dq, dkv (one or two passes)


def test_gradient_under_remat_lowers_for_cuda():
    """The model's path: jax.grad through jax.checkpoint keeping the kernel's results (remat name attn_core); the
    custom_vjp's primal and forward rule must return the same container (a list from the kernel failed here)."""
    def loss(q, k, v):
        attend = jax.checkpoint(lambda q, k, v: flash_attention(q, k, v, kernel="mosaic", interpret=False),
                                policy=jax.checkpoint_policies.save_only_these_names(ATTN_CORE))
        return attend(q, k, v).astype(jnp.float32).sum()

    args = [jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)] + [jax.ShapeDtypeStruct((1, 256, 2, 64),
                                                                                         jnp.bfloat16)] * 2
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 3


def _deal(num_sms, heads, tiles, batch, order, work=None):
    """{item: its place in the order} over every program's items, through the kernels' deal_pairs and
    persistent_work (vectorised over programs and their items), and each program's work: `work` [batch, tiles]
    blocks per tile (default causal: t + 1)."""
    work = modelled_work(tiles, batch, causal=True) if work is None else work
    dealt = deal_pairs(jnp.asarray(work), order)
    counts = [int(persistent_works(jnp.int32(sm), heads * tiles * batch, num_sms)) for sm in range(num_sms)]
    sm = np.repeat(np.arange(num_sms), counts)
    i = np.concatenate([np.arange(c) for c in counts])
    tile, head, row = (np.asarray(x) for x in persistent_work(jnp.asarray(sm), jnp.asarray(i), num_sms, heads, tiles,
                                                              dealt))
    places = dict(zip(zip(tile.tolist(), head.tolist(), row.tolist()),
                      (i * num_sms + np.where(i % 2 == 0, sm, num_sms - 1 - sm)).tolist()))
    assert len(i) == len(places) == heads * tiles * batch  # no item twice
    assert sorted(places) == [(t, h, r) for t in range(tiles) for h in range(heads) for r in range(batch)]
    return places, np.bincount(sm, weights=work[row, tile], minlength=num_sms)


@pytest.mark.parametrize("order", ["row", "tile"])
@pytest.mark.parametrize("num_sms,heads,tiles,batch", [
    (132, 32, 32, 8),   # T=4096, B=8, 32 heads: 8192 items, 62 full rounds and a partial one
    (132, 4, 32, 8),    # 4 heads (32 under tp=8): the row order leaves one program 1.78x the mean
    (114, 1, 16, 16),   # one head, 114 SMs: 2.1x
    (132, 32, 16, 1),   # one row
    (132, 4, 3, 5),     # fewer items than programs: some programs get none
    (7, 3, 5, 2),       # 30 items: an even number of full rounds and a partial one
])
def test_persistent_forward_deals_every_item_once(num_sms, heads, tiles, batch, order):
    """Each (tile, head, batch row) is dealt to exactly one program, heads fastest; the row order takes one row
    after another, the last row's tiles heaviest (causal) first and the rows before it alternating (so that no
    program takes every row's heaviest tile); the tile order takes tiles heaviest first and
    keeps the busiest program's causal work within one heaviest item of the mean. program_loads, which picks the
    order, counts the same work as the deal."""
    places, work = _deal(num_sms, heads, tiles, batch, order)
    ordered = sorted(places, key=places.get)
    assert [h for _, h, _ in ordered] == [w % heads for w in range(len(ordered))]
    if order == "row":
        assert [r for _, _, r in ordered] == sorted(r for _, _, r in ordered)
        for r in range(batch):
            tiles_of_r = [t for t, h, rr in ordered if rr == r and h == 0]
            assert tiles_of_r == sorted(tiles_of_r, reverse=(batch - 1 - r) % 2 == 0), r
    else:
        assert [t for t, _, _ in ordered] == sorted((t for t, _, _ in ordered), reverse=True)
        assert work.max() <= work.mean() + tiles, (work.max(), work.mean())
    np.testing.assert_array_equal(program_loads(modelled_work(tiles, batch, True), heads, num_sms, order), work)


@pytest.mark.parametrize("num_sms,heads,tiles,batch,order", [
    (132, 32, 32, 8, "row"), (132, 32, 64, 4, "row"), (132, 32, 128, 2, "row"),  # the benchmark's causal shapes
    (132, 4, 32, 8, "tile"), (114, 1, 16, 16, "tile"),  # where the row order's deal is uneven
])
def test_the_row_order_is_taken_only_where_its_deal_is_even(num_sms, heads, tiles, batch, order):
    assert deal_order(num_sms, heads, tiles, batch, causal=True, segments=False) == order
    row, tile = (program_loads(modelled_work(tiles, batch, True), heads, num_sms, o) for o in ("row", "tile"))
    assert row.max() <= 1.02 * row.mean() if order == "row" else row.max() > 1.2 * tile.max()
    # equal items: both deals are alike
    assert deal_order(num_sms, heads, tiles, batch, causal=False, segments=False) == "row"


def test_the_deal_follows_the_documents_of_packed_rows():
    """With segment ids a tile's work follows its document (a sawtooth along each row, not one slope): the deal
    sorts the items by it, and the order is picked at run time on it by the rule the static model applies to causal
    work. The dk/dv kernel's shape at T=8192, B=4, 8 KV heads, 4 documents a row: the row order would leave one
    program over 1.1x the mean, so the tile order is picked, its busiest program within one heaviest item of the
    mean. With the forward's 32 heads the row order stays within ROW_ORDER_SLACK of it and is kept."""
    num_sms, tiles, batch = 132, 64, 4
    rng = np.random.default_rng(0)
    work = np.stack([np.concatenate([np.arange(n, 0, -1) for n in np.diff(np.r_[0, cuts, tiles])])
                     for cuts in np.sort([rng.choice(np.arange(1, tiles), 3, replace=False) for _ in range(batch)])])
    runs = jnp.asarray(np.stack([np.zeros_like(work), np.zeros_like(work), work, work], -1).repeat(2, axis=1))
    assert deal_order(num_sms, 8, tiles, batch, causal=True, segments=True) == "work"
    for heads, order in ((8, "tile"), (32, "row")):
        np.testing.assert_array_equal(deal(runs, heads, num_sms, "work"), deal_pairs(jnp.asarray(work), order))
        loads = {o: program_loads(work, heads, num_sms, o) for o in ("row", "tile")}
        if order == "tile":
            assert loads["row"].max() > 1.1 * loads["row"].mean()
        else:
            assert loads["row"].max() <= ROW_ORDER_SLACK * loads["tile"].max()
    places, loads = _deal(num_sms, 8, tiles, batch, "tile", work)
    ordered = sorted(places, key=places.get)
    assert [work[r, t] for t, _, r in ordered] == sorted(work.reshape(-1).repeat(8), reverse=True)
    assert loads.max() <= loads.mean() + work.max(), (loads.max(), loads.mean())
    np.testing.assert_array_equal(loads, program_loads(work, 8, num_sms, "tile"))


def test_equal_work_deals_the_later_pair_first():
    """Ties (equal work: no causal mask, or a window's full tiles) go to the later (row, tile) pair first, in both
    orders, so a causal row-order deal is the one a tile-index formula gave."""
    tiles, batch = 5, 3
    flat = jnp.asarray(modelled_work(tiles, batch, causal=False))
    np.testing.assert_array_equal(deal_pairs(flat, "tile"), np.arange(batch * tiles)[::-1])
    rows = np.asarray(deal_pairs(flat, "row")).reshape(batch, tiles)
    np.testing.assert_array_equal(rows[-1], np.arange(tiles)[::-1] + (batch - 1) * tiles)  # the last row: later first
    np.testing.assert_array_equal(rows[-2], np.arange(tiles) + (batch - 2) * tiles)  # the rows before: alternating


def test_an_unknown_deal_order_raises():
    with pytest.raises(ValueError, match="deal order 'rows'"):
        deal_pairs(jnp.ones((2, 3), jnp.int32), "rows")


def test_segment_ids_defer_the_order_to_the_runs():
    """The kernels' wrapper asks for the run-time pick exactly when segment ids make the work unknown statically."""
    q = jnp.zeros((4, 1024, 32, 128), jnp.bfloat16)
    for segments, order in ((False, "row"), (True, "work")):
        spec = flash.MaskSpec(causal=True, window=None, offset=0, kv_len=1024, kv_len_padded=1024,
                              q_len_padded=1024, segments=segments)
        assert mosaic._deal(q, 128, spec, interpret=True) == (mosaic.INTERPRET_PROGRAMS, order)
