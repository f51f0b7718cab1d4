"""GPT packing, document ids, positions and masks on hand-made documents; splits; blending; determinism."""

import numpy as np
import pytest

from mjax.config import ConfigError
from mjax.data.blend import BlendedDataset, block_counts, parse_data_path
from mjax.data.dataset import GPTDataset, parse_split, split_ranges
from mjax.data.indexed import IndexedDataset, IndexedDatasetWriter
from mjax.data.loader import make_batch

LENGTHS = [3, 5, 0, 1, 7, 4, 2, 9, 6, 3]  # one empty document, as Megatron may write


@pytest.fixture
def docs(tmp_path):
    """Document k holds tokens 100k+1 .. 100k+len, so every token names its document."""
    with IndexedDatasetWriter(tmp_path / "ds", np.uint16) as w:
        for k, n in enumerate(LENGTHS):
            w.add_document(100 * k + 1 + np.arange(n))
    return IndexedDataset(tmp_path / "ds")


def expected_sample(ds: GPTDataset, slot: int, epoch: int = 0):
    """Slot `slot` of an epoch, from the epoch's document order, computed the slow obvious way."""
    order = ds._epoch(epoch)[0]
    stream = [(t, k) for k in order for t in 100 * (ds.first + k) + 1 + np.arange(LENGTHS[ds.first + k])]
    piece = stream[slot * ds.seq_length: slot * ds.seq_length + ds.seq_length + 1]
    tokens, owners = [t for t, _ in piece], [k for _, k in piece]
    ids = np.cumsum([1] + [int(a != b) for a, b in zip(owners, owners[1:])])
    return tokens, ids.tolist()


@pytest.mark.parametrize("seq_length", [1, 4, 7, 39])
def test_packing_and_document_ids(docs, seq_length):
    ds = GPTDataset(docs, (0, len(LENGTHS)), seq_length, seed=3)
    assert ds.samples_per_epoch == (sum(LENGTHS) - 1) // seq_length
    slots = ds._epoch(0)[2]
    assert sorted(slots.tolist()) == list(range(ds.samples_per_epoch))  # every slot exactly once an epoch
    for i in range(2 * ds.samples_per_epoch):  # two epochs
        tokens, ids = ds[i]
        e, j = divmod(i, ds.samples_per_epoch)
        want_tokens, want_ids = expected_sample(ds, int(ds._epoch(e)[2][j]), e)
        assert tokens.tolist() == want_tokens and ids.tolist() == want_ids
        assert tokens.shape == ids.shape == (seq_length + 1,)


def test_epochs_reshuffle_and_seeds_determine(docs):
    a, b = GPTDataset(docs, (0, 10), 4, seed=1), GPTDataset(docs, (0, 10), 4, seed=1)
    c = GPTDataset(docs, (0, 10), 4, seed=2)
    s = a.samples_per_epoch
    first = [a[i][0].tolist() for i in range(s)]
    assert first == [b[i][0].tolist() for i in range(s)]
    assert first != [c[i][0].tolist() for i in range(s)]
    assert first != [a[s + i][0].tolist() for i in range(s)]  # epoch 1 is another order
    assert a[s - 1][0].tolist() == b[s - 1][0].tolist()  # random access, any order: same answer


def test_split_documents_stay_in_their_split(docs):
    ranges = split_ranges(parse_split("6,2,2"), len(LENGTHS))
    assert ranges == [(0, 6), (6, 8), (8, 10)]
    for s, (lo, hi) in enumerate(ranges):
        ds = GPTDataset(docs, (lo, hi), 2, seed=0, split=s)
        owners = {int(t) // 100 for i in range(ds.samples_per_epoch) for t in ds[i][0]}
        assert owners <= set(range(lo, hi)) and len(owners) > 0


def test_parse_split():
    assert parse_split("98,1,1") == pytest.approx((0.98, 0.01, 0.01))
    assert parse_split("98/2") == pytest.approx((0.98, 0.02, 0.0))
    assert parse_split("1") == (1.0, 0.0, 0.0)
    for bad in ("a,b", "1,2,3,4", "0,0,0", "-1,2", ""):
        with pytest.raises(ConfigError, match="--split="):
            parse_split(bad)


def test_split_ranges_follow_megatron_rounding():
    assert split_ranges((0.98, 0.01, 0.01), 1000) == [(0, 980), (980, 990), (990, 1000)]
    assert split_ranges((0.969, 0.03, 0.001), 1275) == [(0, 1236), (1236, 1274), (1274, 1275)]
    # 3.33 rounds to 3 three times; Megatron shifts every boundary by the shortfall, so the last ends at n.
    assert split_ranges((1 / 3, 1 / 3, 1 / 3), 10) == [(0, 4), (4, 7), (7, 10)]


def megatron_positions(inputs, eod):
    """Megatron's `_get_ltor_masks_and_position_ids` positions and document starts, by EOD in the inputs."""
    positions, starts = np.arange(len(inputs)), np.zeros(len(inputs), bool)
    for i in np.flatnonzero(inputs == eod):
        positions[i + 1:] -= positions[i + 1] if i + 1 < len(inputs) else 0
        starts[i + 1:i + 2] = True
    return positions, np.cumsum(starts) + 1


def test_make_batch_hand_made():
    tokens = np.array([[5, 6, 0, 7, 8, 0, 9, 10, 11]])
    ids = np.array([[1, 1, 1, 2, 2, 2, 3, 3, 3]])
    b = make_batch(tokens, ids, eod_id=0, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
    assert b["inputs"].tolist() == [[5, 6, 0, 7, 8, 0, 9, 10]]
    assert b["targets"].tolist() == [[6, 0, 7, 8, 0, 9, 10, 11]]
    assert b["positions"].tolist() == [[0, 1, 2, 0, 1, 2, 0, 1]]
    assert b["segment_ids"].tolist() == [[1, 1, 1, 2, 2, 2, 3, 3]]
    assert b["loss_mask"].tolist() == [[1, 1, 0, 1, 1, 0, 1, 1]]
    plain = make_batch(tokens, ids, eod_id=0)
    assert plain["positions"].tolist() == [list(range(8))] and plain["segment_ids"].tolist() == [[1] * 8]
    assert plain["loss_mask"].tolist() == [[1.0] * 8]
    assert {k: v.dtype.name for k, v in b.items()} == {"inputs": "int32", "targets": "int32", "loss_mask": "float32",
                                                        "positions": "int32", "segment_ids": "int32"}


def test_positions_and_segments_match_megatron_on_eod_data(tmp_path):
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(tmp_path / "eod", np.uint16) as w:
        for n in rng.integers(1, 12, 40):
            w.add_document(np.append(rng.integers(1, 50, n), 0))  # --append_eod, EOD = 0
    ds = GPTDataset(IndexedDataset(tmp_path / "eod"), (0, 40), 16, seed=0)
    tokens, ids = map(np.stack, zip(*(ds[i] for i in range(ds.samples_per_epoch))))
    b = make_batch(tokens, ids, eod_id=0, reset_position_ids=True, reset_attention_mask=True)
    for row in range(len(tokens)):
        positions, segments = megatron_positions(b["inputs"][row], 0)
        assert b["positions"][row].tolist() == positions.tolist()
        assert b["segment_ids"][row].tolist() == segments.tolist()


def test_parse_data_path():
    assert parse_data_path(["a"]) == (["a"], [1.0])
    assert parse_data_path(["0.3", "a", "0.7", "b.bin"]) == (["a", "b"], pytest.approx([0.3, 0.7]))
    assert parse_data_path(["3", "a", "1", "b"])[1] == pytest.approx([0.75, 0.25])
    assert parse_data_path(["a", "b"]) == (["a", "b"], None)
    for bad, message in [(["0.3", "a", "0.7"], "weight/prefix pairs"), (["x", "a", "0.7", "b"], "'x' is not a weight"),
                         (["0.3", "a", "b", "c"], "weight/prefix pairs"), (["-1", "a", "2", "b"], "non-negative"),
                         (["0", "a", "0", "b"], "positive sum"), (["nan", "a", "1", "b"], "finite"), ([], "empty")]:
        with pytest.raises(ConfigError, match=message):
            parse_data_path(bad)


class Numbered:
    def __init__(self, d):
        self.d = d

    def __getitem__(self, j):
        return self.d, j


@pytest.mark.parametrize("weights, block", [([0.2, 0.3, 0.5], 100), ([0.7, 0.3], 1000), ([0.05, 0.0, 0.95], 64)])
def test_blending_proportions(weights, block):
    blend = BlendedDataset([Numbered(d) for d in range(len(weights))], weights, block=block)
    assert block_counts(weights, block).sum() == block
    picks = [blend[i] for i in range(3 * block + 17)]
    for d, w in enumerate(weights):
        mine = [j for dd, j in picks if dd == d]
        assert mine == list(range(len(mine)))  # each dataset read in order, nothing skipped or repeated
        for n in (10, 50, block, len(picks)):  # every prefix is close to the weights
            assert abs(sum(dd == d for dd, _ in picks[:n]) - w * n) <= 1 + n / block


def test_blending_rejects_a_weight_too_small_to_read():
    with pytest.raises(ConfigError, match="never be read"):
        BlendedDataset([Numbered(0), Numbered(1)], [1e-9, 1 - 1e-9], names=["tiny", "big"])
