"""Megatron `.bin/.idx`: round trip, byte compatibility with Megatron's layout both ways, and bad files."""

import struct

import numpy as np
import pytest

from mjax.data.indexed import DataError, IndexedDataset, IndexedDatasetWriter, optimal_dtype

_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.uint16: 8}


def megatron_write(prefix, documents, dtype, modes=None):
    """The byte layout of Megatron-LM's `IndexedDatasetBuilder` (megatron/core/datasets/indexed_dataset.py, per
    ../shared/reference/megatron.md §5), written independently of mjax: `documents` is a list of documents, each a
    list of sequences (Megatron's --split-sentences), each a list of token ids."""
    sequences = [s for doc in documents for s in doc]
    itemsize = np.dtype(dtype).itemsize
    with open(f"{prefix}.bin", "wb") as f:
        for s in sequences:
            f.write(np.array(s, dtype=dtype).tobytes(order="C"))
    lengths = [len(s) for s in sequences]
    pointers = [sum(lengths[:i]) * itemsize for i in range(len(lengths))]
    doc_indices = [0]
    for doc in documents:
        doc_indices.append(doc_indices[-1] + len(doc))
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", _CODES[dtype]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_indices)))
        f.write(np.array(lengths, dtype=np.int32).tobytes(order="C"))
        f.write(np.array(pointers, dtype=np.int64).tobytes(order="C"))
        f.write(np.array(doc_indices, dtype=np.int64).tobytes(order="C"))
        if modes is not None:
            f.write(np.array(modes, dtype=np.int8).tobytes(order="C"))


DOCS = [[5, 6, 7, 0], [1, 2, 0], [9, 0], [3, 4, 5, 6, 7, 8, 0]]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_round_trip(tmp_path, dtype):
    with IndexedDatasetWriter(tmp_path / "ds", dtype) as w:
        for d in DOCS:
            w.add_document(d)
    ds = IndexedDataset(tmp_path / "ds")
    assert ds.dtype == np.dtype(dtype) and len(ds) == 4 and ds.num_documents == 4 and ds.num_tokens == 16
    assert [ds[i].tolist() for i in range(4)] == DOCS
    assert ds.get(3, 2, 3).tolist() == [5, 6, 7]
    assert ds.document_indices.tolist() == [0, 1, 2, 3, 4]
    assert ds.sequence_pointers.tolist() == [0, 4 * ds.dtype.itemsize, 7 * ds.dtype.itemsize, 9 * ds.dtype.itemsize]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.bin", "ds.idx"]  # no temporaries left


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_written_bytes_equal_megatrons(tmp_path, dtype):
    """Files written here are byte for byte what Megatron writes, so Megatron reads them."""
    megatron_write(tmp_path / "meg", [[d] for d in DOCS], dtype)
    with IndexedDatasetWriter(tmp_path / "ours", dtype) as w:
        for d in DOCS:
            w.add_document(d)
    for ext in ("bin", "idx"):
        assert (tmp_path / f"ours.{ext}").read_bytes() == (tmp_path / f"meg.{ext}").read_bytes()


def test_reads_megatron_sentence_split_and_multimodal(tmp_path):
    docs = [[[1, 2], [3]], [[4, 5, 6]], [[7], [8], [9, 10]]]  # documents of several sequences
    megatron_write(tmp_path / "meg", docs, np.int32, modes=[0, 1, 0, 0, 1, 0])
    ds = IndexedDataset(tmp_path / "meg")
    assert len(ds) == 6 and ds.num_documents == 3
    assert ds.document_indices.tolist() == [0, 2, 3, 6]
    assert [ds[i].tolist() for i in range(6)] == [s for d in docs for s in d]
    assert ds.sequence_modes.tolist() == [0, 1, 0, 0, 1, 0]


def test_writer_multi_sequence_documents(tmp_path):
    docs = [[[1, 2], [3]], [[4, 5, 6]]]
    megatron_write(tmp_path / "meg", docs, np.uint16)
    with IndexedDatasetWriter(tmp_path / "ours", np.uint16) as w:
        for doc in docs:
            for s in doc:
                w.add_item(s)
            w.end_document()
    assert (tmp_path / "ours.idx").read_bytes() == (tmp_path / "meg.idx").read_bytes()


def test_optimal_dtype_is_megatrons():
    assert optimal_dtype(1024) == np.uint16 and optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32 and optimal_dtype(128256) == np.int32


def test_writer_rejects_ids_that_do_not_fit(tmp_path):
    with pytest.raises(DataError, match="do not fit uint16"):
        with IndexedDatasetWriter(tmp_path / "ds", np.uint16) as w:
            w.add_document([1, 70000])
    assert list(tmp_path.iterdir()) == []  # the failed write left nothing behind
    with pytest.raises(DataError, match="cannot hold token ids"):
        IndexedDatasetWriter(tmp_path / "f", np.float32)


@pytest.fixture
def good(tmp_path):
    megatron_write(tmp_path / "ds", [[d] for d in DOCS], np.uint16)
    return tmp_path / "ds"


def test_missing_files(good):
    good.with_suffix(".bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"ds\.bin does not exist"):
        IndexedDataset(good)
    with pytest.raises(FileNotFoundError, match=r"nothere\.idx does not exist"):
        IndexedDataset(good.parent / "nothere")


def _patch(path, offset, data):
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage, message", [
    (lambda idx: idx.write_bytes(b"\x00" * 100), "not a Megatron indexed-dataset index"),  # foreign file
    (lambda idx: idx.write_bytes(b"TNTIDX\x00\x00" + b"\x00" * 60), "not a Megatron indexed-dataset index"),
    (lambda idx: idx.write_bytes(idx.read_bytes()[:20]), "truncated"),  # inside the header
    (lambda idx: idx.write_bytes(idx.read_bytes()[:-5]), "truncated"),  # inside the arrays
    (lambda idx: idx.write_bytes(idx.read_bytes() + b"\x00" * 3), "larger than its header"),
    (lambda idx: _patch(idx, 9, struct.pack("<Q", 2)), "index version 2"),
    (lambda idx: _patch(idx, 17, b"\x09"), "unknown dtype code 9"),
    (lambda idx: _patch(idx, 17, b"\x07"), "float32 values, not token ids"),
])
def test_bad_index(good, damage, message):
    idx = good.with_suffix(".idx")
    damage(idx)
    with pytest.raises(DataError, match=message) as e:
        IndexedDataset(good)
    assert str(idx) in str(e.value)


def test_truncated_bin(good):
    b = good.with_suffix(".bin")
    b.write_bytes(b.read_bytes()[:-2])
    with pytest.raises(DataError, match=rf"{b}.*truncated"):
        IndexedDataset(good)
