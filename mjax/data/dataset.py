"""GPT samples: documents packed into `seq_length + 1` tokens, reshuffled every epoch, any sample by its index.

Sampling is deterministic given the seed, but it does not bit-match Megatron's `helpers.cpp`. Instead of one
document order built for the whole run, each epoch (one pass over a split's documents) is its own:

  epoch e: documents in the order of permutation P_e; their concatenation is cut into samples that start every
  `seq_length` tokens and hold `seq_length + 1` (neighbours share one token, as in Megatron); the last partial
  sample is dropped (at most `seq_length` tokens an epoch); samples are visited in the order of permutation Q_e.
  P_e and Q_e come from `numpy.random.default_rng((seed, split, dataset, e))`.

So the dataset is infinite, sample i needs only i (epoch i // S, slot i % S), no run length must be known in
advance, and a resumed run needs nothing but the count of samples consumed. The split is Megatron's: contiguous
ranges of documents (sequences) in proportion to `--split`.
"""

import re
import threading

import numpy as np

from mjax.config import ConfigError
from mjax.data.indexed import IndexedDataset

SPLITS = ("train", "valid", "test")


def parse_split(split: str) -> tuple[float, float, float]:
    """`--split=98,1,1` (or `98/1/1`, or fewer numbers, the rest 0) as normalised train/valid/test fractions."""
    parts = [p for p in re.split(r"[,/\s]+", split.strip()) if p]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 3 or any(not np.isfinite(v) or v < 0 for v in values) or sum(values) <= 0:
        raise ConfigError(f"--split={split!r}: expected up to three non-negative weights with a positive sum, "
                          f"like 98,1,1")
    values += [0.0] * (3 - len(values))
    return tuple(v / sum(values) for v in values)


def split_ranges(fractions: tuple[float, ...], n: int) -> list[tuple[int, int]]:
    """Megatron's `get_split_indices`: [start, end) of each split over n documents, rounding, last end at n."""
    bounds = [0]
    for f in fractions:
        bounds.append(bounds[-1] + int(round(f * n)))
    diff = bounds[-1] - n
    bounds = [0] + [b - diff for b in bounds[1:]]
    return list(zip(bounds[:-1], bounds[1:]))


class GPTDataset:
    """Samples of one split of one indexed dataset. `ds[i] -> (tokens [L+1], document ids [L+1])`; i is unbounded.

    Document ids number the documents met inside the sample from 1 (the first, often partial, document is 1).
    """

    def __init__(self, indexed: IndexedDataset, documents: tuple[int, int], seq_length: int, seed: int,
                 split: int = 0, dataset: int = 0):
        self.indexed, self.seq_length = indexed, seq_length
        self.first = documents[0]
        self.lengths = np.asarray(indexed.sequence_lengths[documents[0]:documents[1]], dtype=np.int64)  # [D]
        self.num_tokens = int(self.lengths.sum())
        self.samples_per_epoch = max(self.num_tokens - 1, 0) // seq_length
        self._seed = (seed, split, dataset)
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()  # iterators in several threads may share a dataset

    def _epoch(self, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(document order [D], token end of each ordered document [D], sample order [S]) of epoch e."""
        with self._lock:
            if e not in self._epochs:
                rng = np.random.default_rng((*self._seed, e))
                order = rng.permutation(len(self.lengths))  # [D]
                ends = np.cumsum(self.lengths[order])  # [D]
                self._epochs = {k: v for k, v in self._epochs.items() if k == e - 1}  # keep one epoch back
                self._epochs[e] = (order, ends, rng.permutation(self.samples_per_epoch))
            return self._epochs[e]

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        if self.samples_per_epoch == 0:
            raise IndexError(f"{self.indexed.prefix} has no sample of {self.seq_length + 1} tokens in this split")
        order, ends, samples = self._epoch(i // self.samples_per_epoch)
        start = int(samples[i % self.samples_per_epoch]) * self.seq_length
        stop = start + self.seq_length + 1
        first = int(np.searchsorted(ends, start, side="right"))
        last = int(np.searchsorted(ends, stop - 1, side="right"))
        tokens, ids = [], []
        for k in range(first, last + 1):  # the documents that overlap [start, stop)
            doc_start = int(ends[k] - self.lengths[order[k]])
            lo, hi = max(start, doc_start) - doc_start, min(stop, int(ends[k])) - doc_start
            if hi > lo:
                tokens.append(self.indexed.get(self.first + int(order[k]), lo, hi - lo))
                ids.append(np.full(hi - lo, len(ids) + 1, np.int32))
        return np.concatenate(tokens), np.concatenate(ids)  # [L+1], [L+1]
