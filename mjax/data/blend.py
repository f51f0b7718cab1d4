"""Weighted blending of datasets: `--data_path 0.3 prefixA 0.7 prefixB`.

Megatron's rule for the flag: one prefix alone, or weight/prefix pairs, or several prefixes without weights (then
weighted by their token counts). Samples are interleaved in a fixed pattern of BLOCK samples repeated forever: each
block takes exactly round(w_d * BLOCK) samples from dataset d (largest remainders), spread evenly through the block.
Every prefix of the stream is therefore within a few samples of the weights, and sample i maps straight to
(dataset, index in that dataset) without counting, so nothing depends on the run length.
"""

import numpy as np

from mjax.config import ConfigError

BLOCK = 1 << 16


def parse_data_path(data_path) -> tuple[list[str], list[float] | None]:
    """(prefixes, weights normalised to sum 1, or None when no weights were given)."""
    items = [str(x) for x in data_path]
    if not items:
        raise ConfigError("--data_path is empty")
    if len(items) == 1:
        return [_strip(items[0])], [1.0]

    def number(x):
        try:
            return float(x)
        except ValueError:
            return None

    if all(number(x) is None for x in items):
        return [_strip(x) for x in items], None
    weights, prefixes = items[0::2], items[1::2]
    bad = [w for w in weights if number(w) is None]
    if len(items) % 2 or bad or any(number(p) is not None for p in prefixes):
        raise ConfigError(f"--data_path={' '.join(items)}: expected weight/prefix pairs like "
                          f"'0.3 prefixA 0.7 prefixB'" + (f"; {bad[0]!r} is not a weight" if bad else ""))
    values = [number(w) for w in weights]
    if any(not np.isfinite(v) or v < 0 for v in values) or sum(values) <= 0:
        raise ConfigError(f"--data_path weights {weights} must be finite, non-negative, with a positive sum")
    return [_strip(p) for p in prefixes], [v / sum(values) for v in values]


def _strip(prefix: str) -> str:
    """Accepts `name.bin` / `name.idx` for the prefix `name`."""
    return prefix[:-4] if prefix.endswith((".bin", ".idx")) else prefix


def block_counts(weights, block: int = BLOCK) -> np.ndarray:
    """Samples of each dataset per block: round(w * block) by largest remainders, summing to `block`."""
    exact = np.asarray(weights, dtype=np.float64) * block
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(-(exact - counts), kind="stable")[:block - counts.sum()]] += 1
    return counts


class BlendedDataset:
    """`ds[i]` is `datasets[d][j]` for the (d, j) the blending pattern assigns to sample i."""

    def __init__(self, datasets, weights, names=None, block: int = BLOCK):
        self.datasets, self.block = datasets, block
        self.names = list(names) if names is not None else [str(i) for i in range(len(datasets))]
        self.counts = block_counts(weights, block)  # [num_datasets]
        for c, w, name in zip(self.counts, weights, names or range(len(datasets))):
            if w > 0 and c == 0:
                raise ConfigError(f"--data_path weight {w:.3g} of {name} is below 1/{block}; it would never be read")
        # Slot k of dataset d sits at time (k + 0.5) / count_d in the block; sorting the times interleaves evenly.
        ds = np.repeat(np.arange(len(datasets)), self.counts)  # [block]
        ks = np.concatenate([np.arange(c) for c in self.counts])  # [block]
        order = np.argsort((ks + 0.5) / self.counts[ds], kind="stable")
        self.pattern_dataset, self.pattern_index = ds[order], ks[order]  # [block], [block]

    def locate(self, i: int) -> tuple[int, int]:
        """(dataset, sample index within it) of blended sample i."""
        d = int(self.pattern_dataset[i % self.block])
        return d, (i // self.block) * int(self.counts[d]) + int(self.pattern_index[i % self.block])

    def __getitem__(self, i: int):
        d, j = self.locate(i)
        return self.datasets[d][j]
