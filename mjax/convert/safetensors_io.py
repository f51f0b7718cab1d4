"""Streaming safetensors: read one tensor at a time from single or sharded (indexed) files, and write shards whose
headers are planned up front so tensors can be written in any order. Host memory stays at one tensor.

The format: 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets: [begin, end]}}
(offsets relative to the end of the header), then the raw little-endian bytes.
"""

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from mjax.convert.spec import ConversionError

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "I64": np.int64,
          "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _read_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


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
        self.entries: dict[str, tuple[Path, dict, int]] = {}
        for name in files:
            path = self.directory / name
            if not path.exists():
                raise ConversionError(f"{index}: lists shard {name}, which is missing")
            header, start = _read_header(path)
            for tensor, info in header.items():
                self.entries[tensor] = (path, info, start)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple:
        return tuple(self.entries[name][1]["shape"])

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(DTYPES[self.entries[name][1]["dtype"]])

    def get(self, name: str) -> np.ndarray:
        if name not in self.entries:
            raise ConversionError(f"tensor {name!r} is missing from the checkpoint in {self.directory}")
        path, info, start = self.entries[name]
        if info["dtype"] not in DTYPES:
            raise ConversionError(f"tensor {name!r} in {path.name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        out = np.empty(tuple(info["shape"]), DTYPES[info["dtype"]])
        if out.nbytes != end - begin:
            raise ConversionError(f"tensor {name!r} in {path.name}: {end - begin} bytes for shape {info['shape']}")
        with open(path, "rb") as f:
            f.seek(start + begin)
            got = f.readinto(memoryview(out.reshape(-1).view(np.uint8)))
        if got != out.nbytes:
            raise ConversionError(f"tensor {name!r}: {path.name} is truncated ({got} of {out.nbytes} bytes)")
        return out


class SafetensorsWriter:
    """Writes a planned set of tensors into shards of at most `max_shard_bytes` (plus an index when > 1 shard).

    `plan` is an ordered list of (name, shape, dtype); every planned tensor must then be `write`-n exactly once,
    in any order, before `close`.
    """

    def __init__(self, directory, plan: list[tuple[str, tuple, np.dtype]], max_shard_bytes: int = 5 << 30):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        # Never written over: a stale shard or index left beside new ones would be loaded instead of them.
        old = sorted(p.name for p in self.directory.iterdir() if p.name.endswith(".safetensors") or p.name == INDEX)
        if old:
            raise ConversionError(f"--output={self.directory} already holds a model ({', '.join(old[:3])}"
                                  f"{', ...' if len(old) > 3 else ''}); choose an empty directory or remove them")
        shards: list[list] = [[]]
        size = 0
        for name, shape, dtype in plan:
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((name, tuple(shape), np.dtype(dtype), nbytes))
            size += nbytes
        n = len(shards)
        self.files = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.where: dict[str, tuple[str, int, tuple, np.dtype]] = {}
        self.total = 0
        for fname, shard in zip(self.files, shards):
            header, offset = {"__metadata__": {"format": "pt"}}, 0
            for name, shape, dtype, nbytes in shard:
                header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
                offset += nbytes
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)
            with open(self.directory / fname, "wb") as f:
                f.write(struct.pack("<Q", len(raw)) + raw)
                f.truncate(8 + len(raw) + offset)
            for name, shape, dtype, nbytes in shard:
                self.where[name] = (fname, 8 + len(raw) + header[name]["data_offsets"][0], shape, dtype)
            self.total += offset
        self.pending = set(self.where)

    def write(self, name: str, array: np.ndarray):
        fname, pos, shape, dtype = self.where[name]
        if array.shape != shape or array.dtype != dtype:
            raise ConversionError(f"tensor {name!r}: got {array.shape} {array.dtype}, planned {shape} {dtype}")
        with open(self.directory / fname, "r+b") as f:
            f.seek(pos)
            f.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
        self.pending.discard(name)

    def close(self):
        if self.pending:
            raise ConversionError(f"tensors planned but never written: {', '.join(sorted(self.pending))}")
        if len(self.files) > 1:
            index = {"metadata": {"total_size": self.total},
                     "weight_map": {name: w[0] for name, w in self.where.items()}}
            (self.directory / INDEX).write_text(json.dumps(index, indent=2))
