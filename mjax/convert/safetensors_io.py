"""Safetensors files: read through Hugging Face's `safetensors` library, written by a streaming writer of our own.
Both handle single or sharded (indexed) model directories, with the index `save_pretrained` writes.

Reading opens each file with `safe_open(framework="numpy", backend="pread")`: every `get` reads just that tensor's
bytes into a fresh array. The default mmap backend keeps every page it has touched mapped while the file is open, so
the resident size grows towards the whole shard (measured in docs/convert.md).

FP8: the library's numpy path cannot build float8 arrays (it looks up `numpy.float8_e4m3fn`, which numpy lacks;
safetensors 0.8.0), though it lists them with dtype and shape and validates their offsets when the file opens. Their
bytes are read from the byte range the file's header gives them (the layout the format specifies: an 8-byte
little-endian header length, the JSON header, then the data) and viewed as the ml_dtypes type.

Writing: the library's `save_file` writes a whole file from arrays in memory, so a shard's tensors would wait in
memory until its last one arrives (up to one shard, 5 GB by default; docs/convert.md measures both writers). The
writer here plans every shard's header up front, pre-sizes the file and writes each tensor into its byte range as it
arrives, so it holds nothing. A shard is written as `<name>.incomplete` and renamed when its last tensor is in, so a
shard under its real name is always whole.
"""

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open

from mjax.convert.spec import ConversionError, InputError

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "I64": np.int64,
          "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
          "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}  # numpy dtype -> safetensors name (F8_E4M3, BF16, ...)
RAW = {"F8_E4M3", "F8_E5M2"}  # read from their byte range: the library's numpy path cannot return them
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
METADATA = {"format": "pt"}  # transformers refuses a file whose metadata names no framework it knows


def _open(path: Path):
    try:
        return safe_open(path, framework="numpy", backend="pread")
    except Exception as e:  # SafetensorError or OSError: a truncated file, a bad header
        raise ConversionError(f"{path}: not a readable safetensors file ({e})") from e


def _data_offsets(path: Path) -> tuple[dict, int]:
    """({tensor: [begin, end]}, where the data starts) from the file's header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v["data_offsets"] for k, v in header.items() if k != "__metadata__"}, 8 + n


class SafetensorsReader:
    """All tensors of an HF model directory by name; `get(name)` reads just that tensor from disk."""

    def __init__(self, directory):
        self.directory = Path(directory)
        index = self.directory / INDEX
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (self.directory / SINGLE).exists():
            files = [SINGLE]
        else:
            found = sorted(p.name for p in self.directory.glob("*.safetensors"))
            if not found:
                bins = sorted(p.name for p in self.directory.glob("*.bin"))
                hint = f" (found {', '.join(bins)}: re-save with safe_serialization=True)" if bins else ""
                raise ConversionError(f"{self.directory}: no {SINGLE} or {INDEX}{hint}")
            files = found
        self.entries: dict[str, tuple[Path, str, tuple]] = {}  # name -> (file, safetensors dtype, shape)
        self._files = {}
        for name in files:
            path = self.directory / name
            if not path.exists():
                raise ConversionError(f"{index}: lists shard {name}, which is missing")
            f = self._files[path] = _open(path)
            for tensor in f.keys():
                view = f.get_slice(tensor)
                self.entries[tensor] = (path, view.get_dtype(), tuple(view.get_shape()))

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple:
        return self.entries[name][2]

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(DTYPES[self.entries[name][1]])

    def get(self, name: str) -> np.ndarray:
        if name not in self.entries:
            raise ConversionError(f"tensor {name!r} is missing from the checkpoint in {self.directory}")
        path, dtype, shape = self.entries[name]
        if dtype not in DTYPES:
            raise ConversionError(f"tensor {name!r} in {path.name} has unsupported dtype {dtype}")
        if dtype in RAW:
            offsets, start = _data_offsets(path)
            begin, _ = offsets[name]
            count = int(np.prod(shape, dtype=np.int64))
            return np.fromfile(path, np.uint8, count, offset=start + begin).view(DTYPES[dtype]).reshape(shape)
        return self._files[path].get_tensor(name)


def shard_names(n: int) -> list[str]:
    """File names of n shards as `save_pretrained` writes them."""
    return [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


INCOMPLETE = ".incomplete"  # suffix of a shard still being written


def _header_bytes(shard: list) -> tuple[bytes, dict]:
    """(8-byte length + JSON header padded to 8 bytes, {name: data offset}) of one shard. The data is laid out by
    descending itemsize (then plan order), as the library lays it out, so every tensor starts aligned to its dtype."""
    header, offsets, end = {"__metadata__": METADATA}, {}, 0
    for name, shape, dtype, nbytes in sorted(shard, key=lambda t: -t[2].itemsize):  # stable: plan order within
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [end, end + nbytes]}
        offsets[name] = end
        end += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format allows trailing spaces; keeps the data 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw, {name: 8 + len(raw) + o for name, o in offsets.items()}


class SafetensorsWriter:
    """Writes a planned set of tensors into shards of at most `max_shard_bytes` (plus an index when > 1 shard).

    `plan` is an ordered list of (name, shape, dtype); shards are cut in plan order (a tensor larger than
    `max_shard_bytes` gets a shard of its own). Every planned tensor must then be `write`-n exactly once, in any
    order, before `close`. Each `write` goes straight to its byte range in the pre-sized file: no tensor is held.
    """

    def __init__(self, directory, plan: list[tuple[str, tuple, np.dtype]], max_shard_bytes: int = 5 << 30):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        # Never written over: a stale shard or index left beside new ones would be loaded instead of them.
        old = sorted(p.name for p in self.directory.iterdir() if p.name.endswith(".safetensors") or p.name == INDEX)
        if old:
            raise InputError(f"--output={self.directory} already holds a model ({', '.join(old[:3])}"
                             f"{', ...' if len(old) > 3 else ''}); choose an empty directory or remove them")
        shards: list[list] = [[]]
        size = 0
        for name, shape, dtype in plan:
            dtype = np.dtype(dtype)
            if dtype not in NAMES:
                raise ConversionError(f"tensor {name!r}: dtype {dtype} has no safetensors name")
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((name, tuple(shape), dtype, nbytes))
            size += nbytes
        self.files = shard_names(len(shards))
        self.where: dict[str, tuple[int, int, tuple, np.dtype]] = {}  # name -> (shard, file offset, shape, dtype)
        for i, shard in enumerate(shards):
            header, offsets = _header_bytes(shard)
            with open(self._partial(i), "wb") as f:
                f.write(header)
                f.truncate(len(header) + sum(t[3] for t in shard))  # sparse: the data arrives by `write`
            self.where.update({name: (i, offsets[name], shape, dtype) for name, shape, dtype, _ in shard})
        self.total = sum(t[3] for shard in shards for t in shard)
        self._waiting = [{t[0] for t in shard} for shard in shards]  # tensors each shard still lacks

    def _partial(self, i: int) -> Path:
        return self.directory / (self.files[i] + INCOMPLETE)

    def write(self, name: str, array: np.ndarray):
        if name not in self.where:
            raise ConversionError(f"tensor {name!r} was not planned")
        i, offset, shape, dtype = self.where[name]
        if array.shape != shape or array.dtype != dtype:
            raise ConversionError(f"tensor {name!r}: got {array.shape} {array.dtype}, planned {shape} {dtype}")
        if name not in self._waiting[i]:
            raise ConversionError(f"tensor {name!r} written twice")
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)  # no copy when already contiguous
        with open(self._partial(i), "r+b") as f:
            f.seek(offset)
            f.write(data.data)
        self._waiting[i].discard(name)
        if not self._waiting[i]:
            self._partial(i).rename(self.directory / self.files[i])

    def close(self):
        missing = sorted(n for waiting in self._waiting for n in waiting)
        if missing:
            raise ConversionError(f"tensors planned but never written: {', '.join(missing)}")
        if len(self.files) > 1:
            index = {"metadata": {"total_size": self.total},
                     "weight_map": {name: self.files[i] for name, (i, *_) in self.where.items()}}
            (self.directory / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
