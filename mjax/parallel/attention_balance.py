"""Balancing attention work over the context- and data-parallel ranks, on the host, before a batch is placed.

With packed documents (--reset_attention_mask) the attention of a row costs the sum over its documents of their
visible (query, key) pairs, about L^2 / 2 per document (L x window with a sliding window), not its token count: two
rows of the same length can differ many times over, and so can the context-parallel ranks' shares of one row (the
dual-chunk placement balances one causal sequence, not a row of documents). Since documents never see each other,
the order of the documents in a row and the order of the rows in a batch do not change the loss; so, as WLB-LLM
and NVIDIA's dynamic context parallelism balance by attention work:

rows, heaviest first, go to a (micro-batch, data-parallel rank) bin, each in one of a few orders of its documents
(as loaded, longest first or last, seeded shuffles), choosing the bin and order after which that bin's busiest
context-parallel rank (load-balanced placement) has the least work.

`attention_imbalance` is the busiest rank's work over the mean rank's (1 is perfect; the step waits for the
busiest), for the order used and for the order as loaded; an all-to-all group (a2a, a2a+p2p) counts as one rank, as
its ranks share the heads of the group's sequences evenly. Segment ids come back renumbered in order (the kernels
skip key blocks by sorted ids). Not for MoE models: their load-balancing terms and capacity are per micro-batch.
The rows of one process are balanced over that process's data-parallel ranks (with several processes, each
balances its own rows).
"""

import numpy as np

from mjax.parallel.context_parallel import load_balance_order

CANDIDATES = 6  # seeded shuffles tried per row, besides the order as loaded and longest first / last


def token_work(segment_ids: np.ndarray, window: int | None) -> np.ndarray:
    """[B, T] -> [B, T]: the keys each query attends (causal within its document, and the window)."""
    b, t = segment_ids.shape
    index = np.broadcast_to(np.arange(t), (b, t))
    start = np.where(np.diff(segment_ids, axis=1, prepend=segment_ids[:, :1] - 1) != 0, index, 0)
    work = index - np.maximum.accumulate(start, axis=1) + 1
    return work if window is None else np.minimum(work, window)


def rank_work(work: np.ndarray, cp: int, parts: int | None = None) -> np.ndarray:
    """[B, T] token work -> [B, parts]: the share of each row of each of `parts` (default cp) consecutive groups of
    context-parallel ranks (load-balanced placement). The ranks that share work evenly whatever the mask (an a2a
    group: each has its heads of the group's whole sequences) count as one part."""
    b, t = work.shape
    parts = cp if parts is None else parts
    if parts == 1:
        return work.sum(1, keepdims=True)
    return work[:, load_balance_order(t, cp)].reshape(b, parts, t // parts).sum(2)


def _documents(seg_row: np.ndarray) -> list[np.ndarray]:
    cuts = np.flatnonzero(np.diff(seg_row)) + 1
    return np.split(np.arange(seg_row.size), cuts)


def _candidates(seg_row: np.ndarray, cp: int, parts: int, window, rng) -> list[tuple[np.ndarray, np.ndarray]]:
    """(token order [T], its work per context-parallel rank [cp]) for each order of the row's documents tried: as
    loaded first, then longest first and last, then seeded shuffles; every document kept whole."""
    docs = _documents(seg_row)
    orders = [np.arange(len(docs))]
    if len(docs) > 1:
        lengths = np.array([d.size for d in docs])
        orders += [np.argsort(-lengths, kind="stable"), np.argsort(lengths, kind="stable")]
        orders += [rng.permutation(len(docs)) for _ in range(CANDIDATES)]
    out = []
    for order in orders:
        tokens = np.concatenate([docs[i] for i in order])
        out.append((tokens, rank_work(token_work(seg_row[tokens][None], window), cp, parts)[0]))
    return out


def imbalance(work: np.ndarray, cp: int, bins: int, parts: int | None = None) -> float:
    """The busiest (micro-batch x data-parallel, context-parallel) rank's work over the mean rank's, for rows in
    placement order (consecutive runs of B / bins rows per bin)."""
    per_part = rank_work(work, cp, parts)  # [B, parts]
    per_bin = per_part.reshape(bins, -1, per_part.shape[1]).sum(1)  # [B, parts] -> [bins, parts]
    mean = per_bin.mean()
    return float(per_bin.max() / mean) if mean > 0 else 1.0


def balance_batch(batch: dict, *, cp: int, bins: int, window: int | None, parts: int | None = None,
                  seed: int = 0) -> tuple[dict, dict]:
    """(the batch with documents reordered within rows and rows across the bins, the imbalance before and after).
    `batch` arrays are [B, T] numpy with `segment_ids`; `bins` = micro-batches x this process's data-parallel
    ranks, in row order (B / bins rows each).

    Greedy on the step's own objective: rows heaviest first, each placed, in the document order of its candidates,
    into the open bin where the busiest rank of that bin ends up least loaded. Kept as loaded if that is better."""
    seg = batch["segment_ids"]
    b = seg.shape[0]
    parts = cp if parts is None else parts
    before = imbalance(token_work(seg, window), cp, bins, parts)
    rng = np.random.default_rng(seed)
    candidates = [_candidates(row, cp, parts, window, rng) for row in seg]
    per_bin = b // bins
    load, members = np.zeros((bins, parts)), [[] for _ in range(bins)]
    for row in np.argsort([-c[0][1].sum() for c in candidates], kind="stable"):
        options = [(max(load[i] + work), load[i].sum(), i, j) for i in range(bins) if len(members[i]) < per_bin
                   for j, (_, work) in enumerate(candidates[row])]
        _, _, target, choice = min(options)
        load[target] += candidates[row][choice][1]
        members[target].append((row, choice))
    after = float(load.max() / load.mean()) if load.mean() > 0 else 1.0
    if after >= before:  # nothing moves unless it helps
        return batch, {"attention_imbalance": before, "attention_imbalance_before": before}
    placed = [(row, candidates[row][choice][0]) for m in members for row, choice in m]
    rows = np.array([row for row, _ in placed])
    tokens = np.stack([order for _, order in placed])  # [B, T]
    reordered = {k: np.take_along_axis(v[rows], tokens, axis=1) for k, v in batch.items()}
    # renumbered in order again: the kernels skip key blocks by the sorted ids' ranges (equality is unchanged)
    new = reordered["segment_ids"]
    reordered["segment_ids"] = np.cumsum(np.diff(new, axis=1, prepend=new[:, :1] - 1) != 0, axis=1).astype(new.dtype)
    return reordered, {"attention_imbalance": after, "attention_imbalance_before": before}
