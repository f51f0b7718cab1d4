"""Megatron-LM's indexed dataset format: a `.bin` of raw token arrays and an `.idx` that locates them.

Byte compatible both ways with `megatron/core/datasets/indexed_dataset.py`. The `.idx` is little-endian:

    magic b"MMIDIDX\\x00\\x00" (9 B) | version <Q = 1 | dtype code <B | sequence_count N <Q | document_count D <Q
    | sequence_lengths int32[N] | sequence_pointers int64[N] (byte offsets into .bin) | document_indices int64[D]
    | optional sequence_modes int8[N] (multimodal data only; read if present, never written here)

`document_indices` starts at 0 and ends at N: document j spans sequences [doc[j], doc[j+1]).
"""

import os
import struct
import uuid
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count: 34 bytes

# Megatron's `DType` codes.
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}


class DataError(ValueError):
    """A data file or data setting that cannot be used; the message names the file or flag."""


def optimal_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice: uint16 when every id fits with room to spare, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def data_file_paths(prefix: str | os.PathLike) -> tuple[Path, Path]:
    """(`prefix.bin`, `prefix.idx`)."""
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


def dataset_exists(prefix: str | os.PathLike) -> bool:
    return all(p.is_file() for p in data_file_paths(prefix))


class IndexedDataset:
    """A memory-mapped, read-only view of `prefix.bin` / `prefix.idx`; `ds[i]` is sequence i as a numpy array."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = str(prefix)
        bin_path, idx_path = data_file_paths(prefix)
        for p in (idx_path, bin_path):
            if not p.is_file():
                raise FileNotFoundError(f"indexed dataset file {p} does not exist (dataset prefix {self.prefix!r})")
        self.idx_path, self.bin_path = idx_path, bin_path
        self._read_index(idx_path)
        self._map_bin(bin_path)

    def _read_index(self, path: Path) -> None:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
        if head[:len(MAGIC)] != MAGIC:
            raise DataError(f"{path} is not a Megatron indexed-dataset index: it does not start with {MAGIC!r}")
        if len(head) < _HEADER.size:
            raise DataError(f"{path} is truncated: {size} bytes, shorter than the {_HEADER.size}-byte header")
        _, version, code, n, d = _HEADER.unpack(head)
        if version != VERSION:
            raise DataError(f"{path} has index version {version}; only version {VERSION} exists in Megatron")
        if code not in DTYPE_CODES:
            raise DataError(f"{path} has unknown dtype code {code}; known codes: {sorted(DTYPE_CODES)}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        if self.dtype.kind == "f":
            raise DataError(f"{path} holds {self.dtype} values, not token ids")
        expected = _HEADER.size + 4 * n + 8 * n + 8 * d
        if size not in (expected, expected + n):  # `+ n`: Megatron's multimodal sequence_modes int8[N]
            state = "truncated" if size < expected else "larger than its header says"
            raise DataError(f"{path} is {state}: {size} bytes, but {n} sequences and {d} document indices need "
                            f"{expected} (or {expected + n} with sequence modes)")
        idx = np.memmap(path, dtype=np.uint8, mode="r")
        off = _HEADER.size
        self.sequence_lengths = idx[off:off + 4 * n].view("<i4")  # [N]
        off += 4 * n
        self.sequence_pointers = idx[off:off + 8 * n].view("<i8")  # [N]
        off += 8 * n
        self.document_indices = idx[off:off + 8 * d].view("<i8")  # [D]
        off += 8 * d
        self.sequence_modes = idx[off:off + n].view(np.int8) if size == expected + n else None  # [N] or None
        if d == 0 or self.document_indices[0] != 0 or self.document_indices[-1] != n:
            raise DataError(f"{path}: document indices must run from 0 to the sequence count {n}")

    def _map_bin(self, path: Path) -> None:
        size = path.stat().st_size
        n = len(self.sequence_lengths)
        need = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize if n else 0
        if size != need:
            state = "truncated" if size < need else "larger than its index says"
            raise DataError(f"{path} is {state}: {size} bytes, but {self.idx_path} locates {need} bytes of "
                            f"{self.dtype} tokens")
        self._bin = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        """Number of sequences (documents, unless Megatron split them into sentences)."""
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence i, without copying."""
        total = int(self.sequence_lengths[i])
        length = total - offset if length is None else length
        if not 0 <= offset <= offset + length <= total:
            raise IndexError(f"tokens [{offset}, {offset + length}) outside sequence {i} of length {total}")
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return self._bin[start:start + length * self.dtype.itemsize].view(self.dtype)  # [length]

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def first_tokens(self, count: int) -> np.ndarray:
        """Up to `count` tokens from the start of the .bin, where sequences lie back to back."""
        count = min(count, len(self._bin) // self.dtype.itemsize)
        return self._bin[:count * self.dtype.itemsize].view(self.dtype)  # [count]


class IndexedDatasetWriter:
    """Writes `prefix.bin` / `prefix.idx` as Megatron's `IndexedDatasetBuilder` does.

    Files are written under temporary names and renamed into place by `finalize()` (`.idx` last), so a reader never
    sees a half-written dataset and two processes writing the same dataset at once do not corrupt it.
    Use as a context manager; leaving it by an exception removes the temporary files.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type):
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF or self.dtype.kind not in "iu":
            raise DataError(f"dtype {self.dtype} cannot hold token ids in Megatron's format; use uint16 or int32")
        self.bin_path, self.idx_path = data_file_paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        tag = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._tmp_bin, self._tmp_idx = Path(str(self.bin_path) + tag), Path(str(self.idx_path) + tag)
        self._bin = open(self._tmp_bin, "wb")
        self._lengths: list[int] = []
        self._documents: list[int] = [0]

    def add_item(self, tokens) -> None:
        """Appends one sequence."""
        arr = np.asarray(tokens)
        if arr.size and (arr.min() < np.iinfo(self.dtype).min or arr.max() > np.iinfo(self.dtype).max):
            raise DataError(f"{self.bin_path}: token ids in [{arr.min()}, {arr.max()}] do not fit {self.dtype}")
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.append(arr.size)

    def end_document(self) -> None:
        """Closes the current document (the sequences added since the last call)."""
        self._documents.append(len(self._lengths))

    def add_document(self, tokens) -> None:
        """Appends a document of one sequence."""
        self.add_item(tokens)
        self.end_document()

    def finalize(self) -> None:
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int64)
        pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * self.dtype.itemsize if len(lengths) else lengths
        with open(self._tmp_idx, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], len(lengths), len(self._documents)))
            f.write(lengths.astype("<i4").tobytes())
            f.write(np.asarray(pointers, dtype="<i8").tobytes())
            f.write(np.asarray(self._documents, dtype="<i8").tobytes())
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(self._tmp_idx, self.idx_path)

    def discard(self) -> None:
        self._bin.close()
        for p in (self._tmp_bin, self._tmp_idx):
            p.unlink(missing_ok=True)

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.discard()
