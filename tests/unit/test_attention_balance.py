"""Attention-work balancing (mjax/parallel/attention_balance.py) against pairs counted on explicit masks."""

import numpy as np
import pytest

from mjax.parallel.attention_balance import balance_batch, imbalance, rank_work, token_work
from mjax.parallel.context_parallel import load_balance_order


def _segments(lengths_per_row, t):
    rows = []
    for lengths in lengths_per_row:
        assert sum(lengths) == t
        rows.append(np.repeat(np.arange(len(lengths)), lengths))
    return np.stack(rows).astype(np.int32)


def _visible_pairs(seg_row, window):
    """Per query: keys it attends, counted on the explicit [T, T] mask."""
    t = seg_row.size
    q, k = np.arange(t)[:, None], np.arange(t)[None, :]
    mask = (k <= q) & (seg_row[:, None] == seg_row[None, :])
    if window is not None:
        mask &= q - k < window
    return mask.sum(1)


@pytest.mark.parametrize("window", [None, 5])
def test_token_work_counts_the_visible_keys(window):
    seg = _segments([[3, 9, 1, 19], [32], [16, 16]], 32)
    np.testing.assert_array_equal(token_work(seg, window), np.stack([_visible_pairs(r, window) for r in seg]))


def test_rank_work_sums_each_ranks_tokens():
    seg = _segments([[5, 27], [32]], 32)
    work = token_work(seg, None)
    order = load_balance_order(32, 4)
    want = np.stack([[work[b, order[r * 8:(r + 1) * 8]].sum() for r in range(4)] for b in range(2)])
    np.testing.assert_array_equal(rank_work(work, 4), want)
    assert len(set(rank_work(token_work(seg[1:], None), 4)[0])) == 1  # one causal sequence: balanced exactly


def _batch(seg):
    rng = np.random.default_rng(1)
    b, t = seg.shape
    index = np.arange(t)
    start = np.where(np.diff(seg, axis=1, prepend=-1) != 0, index, 0)
    inputs = rng.integers(0, 1000, (b, t)).astype(np.int32)
    return {"inputs": inputs, "targets": inputs + 1, "loss_mask": rng.random((b, t)).astype(np.float32),
            "positions": (index - np.maximum.accumulate(start, axis=1)).astype(np.int32), "segment_ids": seg}


def _documents(batch, row):
    """The row's documents as sets of (input, target, loss mask, position) tuples, each in order."""
    seg = batch["segment_ids"][row]
    cuts = np.flatnonzero(np.diff(seg)) + 1
    keys = ("inputs", "targets", "loss_mask", "positions")
    return sorted(tuple(zip(*(np.split(batch[k][row], cuts)[i].tolist() for k in keys)))
                  for i in range(cuts.size + 1))


def test_balancing_keeps_every_document_whole_and_lowers_the_imbalance():
    t, cp, bins = 64, 2, 2
    # row 0: one long document (all its work on the late chunks); row 1: many short ones; row 2, 3: mixtures
    seg = _segments([[60, 2, 2], [4] * 16, [2, 2, 40, 20], [30, 30, 4]], t)
    batch = _batch(seg)
    out, stats = balance_batch(batch, cp=cp, bins=bins, window=None)
    # the same documents (content, targets, masks, positions travel with their tokens), rows permuted
    before = sorted(_documents(batch, r) for r in range(4))
    assert sorted(_documents(out, r) for r in range(4)) == before
    for row in range(4):
        seg_row = out["segment_ids"][row]
        assert len(set(seg_row.tolist())) == np.count_nonzero(np.diff(seg_row)) + 1  # each document contiguous
    assert stats["attention_imbalance_before"] == pytest.approx(imbalance(token_work(seg, None), cp, bins))
    assert stats["attention_imbalance"] == pytest.approx(imbalance(token_work(out["segment_ids"], None), cp, bins))
    assert stats["attention_imbalance"] < stats["attention_imbalance_before"]
    assert stats["attention_imbalance"] < 1.1, stats
    assert (np.diff(out["segment_ids"], axis=1) >= 0).all()  # renumbered in order: the kernels' block skipping


def test_an_all_to_all_group_counts_as_one_rank():
    """a2a: every rank of the group attends its heads over the group's whole sequences, so its ranks share the work
    evenly: with the whole cp axis one group, only the bins can be out of balance."""
    seg = _segments([[60, 2, 2], [4] * 16], 64)
    work = token_work(seg, None)
    assert imbalance(work, cp=4, bins=1) > 1.05  # per rank: the long document's late chunks
    assert imbalance(work, cp=4, bins=1, parts=1) == 1.0
    np.testing.assert_array_equal(rank_work(work, 4, parts=2), rank_work(work, 4).reshape(2, 2, 2).sum(2))


def test_one_document_per_row_is_left_alone():
    seg = _segments([[64]] * 4, 64)
    batch = _batch(seg)
    out, stats = balance_batch(batch, cp=4, bins=2, window=None)
    for k in batch:
        np.testing.assert_array_equal(out[k], batch[k])
    assert stats == {"attention_imbalance": 1.0, "attention_imbalance_before": 1.0}
