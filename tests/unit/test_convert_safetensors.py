"""Safetensors files through mjax's reader (the library) and its streaming writer: FP8 and bf16 both ways against
Hugging Face's library, the sharded layout `save_pretrained` writes, aligned data, and host memory of one tensor in
either direction."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from mjax.convert.safetensors_io import INDEX, SafetensorsReader, SafetensorsWriter

ROOT = Path(__file__).resolve().parents[2]
# Each float8 format's finite values (every bit pattern but NaN/inf) and a few bf16/f32 ones.
E4M3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
E5M2 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e5m2)
TENSORS = {
    "fp8.e4m3": E4M3[np.isfinite(E4M3.astype(np.float32))].reshape(2, -1),
    "fp8.e5m2": E5M2[np.isfinite(E5M2.astype(np.float32))].reshape(-1, 4),
    "bf16": np.array([[1.0, -2.5, 3.140625], [1e-3, 65280.0, -0.0]], np.float32).astype(ml_dtypes.bfloat16),
    "f32": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
}
SAFETENSORS_NAMES = {"fp8.e4m3": "F8_E4M3", "fp8.e5m2": "F8_E5M2", "bf16": "BF16", "f32": "F32"}


def _header(path) -> tuple[dict, int]:
    """The header as the format specifies it: 8-byte little-endian length, then JSON (an oracle of our own)."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), 8 + n


def _same(a: np.ndarray, b: np.ndarray):
    assert (a.dtype, a.shape) == (b.dtype, b.shape)
    assert a.tobytes() == b.tobytes()


def test_library_written_fp8_and_bf16_read_by_mjax(tmp_path):
    save_file(TENSORS, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reader = SafetensorsReader(tmp_path)
    assert sorted(reader.names()) == sorted(TENSORS)
    for name, want in TENSORS.items():
        assert (reader.shape(name), reader.dtype(name)) == (want.shape, want.dtype)
        _same(reader.get(name), want)


def test_mjax_written_fp8_and_bf16_read_by_the_library(tmp_path):
    writer = SafetensorsWriter(tmp_path, [(k, v.shape, v.dtype) for k, v in TENSORS.items()])
    for name in reversed(TENSORS):  # any order
        writer.write(name, TENSORS[name])
    writer.close()
    path = tmp_path / "model.safetensors"
    header, start = _header(path)
    raw = path.read_bytes()
    with safe_open(path, framework="numpy") as f:
        assert sorted(f.keys()) == sorted(TENSORS) and f.metadata() == {"format": "pt"}
        for name, want in TENSORS.items():
            view = f.get_slice(name)
            assert (view.get_dtype(), tuple(view.get_shape())) == (SAFETENSORS_NAMES[name], want.shape)
            if name in ("bf16", "f32"):
                _same(f.get_tensor(name), want)
            begin, end = header[name]["data_offsets"]  # fp8: numpy has no float8 type for the library
            assert raw[start + begin:start + end] == want.tobytes()


def test_shards_and_index_as_save_pretrained_writes_them(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {f"layers.{i}.w": rng.standard_normal((16, 8)).astype(np.float32) for i in range(5)}  # 512 B each
    tensors["layers.2.w"] = tensors["layers.2.w"].astype(ml_dtypes.bfloat16)  # 256 B
    writer = SafetensorsWriter(tmp_path / "sharded", [(k, v.shape, v.dtype) for k, v in tensors.items()],
                               max_shard_bytes=1100)
    for k, v in tensors.items():
        writer.write(k, v)
    writer.close()
    out = tmp_path / "sharded"
    names = ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
             "model-00003-of-00003.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == sorted(names + [INDEX])
    index = json.loads((out / INDEX).read_text())
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in tensors.values())
    assert index["weight_map"] == {"layers.0.w": names[0], "layers.1.w": names[0], "layers.2.w": names[1],
                                   "layers.3.w": names[1], "layers.4.w": names[2]}  # cut in plan order at 1100 B
    for name in names:
        header, start = _header(out / name)
        assert header["__metadata__"] == {"format": "pt"}
        assert (out / name).stat().st_size - start <= 1100
    reader = SafetensorsReader(out)
    for k, v in tensors.items():
        _same(reader.get(k), v)

    one = SafetensorsWriter(tmp_path / "single", [("x", (3,), np.dtype(np.float32))])
    one.write("x", np.ones(3, np.float32))
    one.close()
    assert [p.name for p in (tmp_path / "single").iterdir()] == ["model.safetensors"]  # no index for one shard


def test_data_is_aligned_and_a_shard_appears_only_when_complete(tmp_path):
    """Every tensor starts at a multiple of its itemsize (numpy/torch views need it), whatever the plan order; a
    shard keeps a temporary name until its last tensor is in, so a crash leaves no whole-looking shard."""
    tensors = {"a.fp8": E4M3[:5], "b.f32": TENSORS["f32"], "c.bf16": TENSORS["bf16"][:1, :1],
               "d.f64": np.arange(3, dtype=np.float64), "e.bf16": TENSORS["bf16"]}
    writer = SafetensorsWriter(tmp_path, [(k, v.shape, v.dtype) for k, v in tensors.items()])
    for name in ("a.fp8", "b.f32", "c.bf16", "d.f64"):
        writer.write(name, tensors[name])
    assert not (tmp_path / "model.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors.incomplete"]
    writer.write("e.bf16", tensors["e.bf16"])
    writer.close()
    header, start = _header(tmp_path / "model.safetensors")
    assert start % 8 == 0
    for name, want in tensors.items():
        begin, end = header[name]["data_offsets"]
        assert (start + begin) % want.dtype.itemsize == 0, name
        assert end - begin == want.nbytes
    with safe_open(tmp_path / "model.safetensors", framework="numpy") as f:  # the library accepts the layout
        for name in ("b.f32", "c.bf16", "d.f64", "e.bf16"):
            _same(f.get_tensor(name), tensors[name])
    reader = SafetensorsReader(tmp_path)
    for name, want in tensors.items():
        _same(reader.get(name), want)


def test_writer_refuses_unplanned_repeated_and_missing_tensors(tmp_path):
    from mjax.convert import ConversionError

    writer = SafetensorsWriter(tmp_path, [("a", (2,), np.dtype(np.float32)), ("b", (2,), np.dtype(np.float32))])
    with pytest.raises(ConversionError, match="'c' was not planned"):
        writer.write("c", np.zeros(2, np.float32))
    with pytest.raises(ConversionError, match=r"'a': got \(3,\) float32, planned \(2,\) float32"):
        writer.write("a", np.zeros(3, np.float32))
    writer.write("a", np.zeros(2, np.float32))
    with pytest.raises(ConversionError, match="'a' written twice"):
        writer.write("a", np.zeros(2, np.float32))
    with pytest.raises(ConversionError, match="never written: b"):
        writer.close()


MEMORY_PROBE = """
import sys, numpy as np
from mjax.convert.safetensors_io import SafetensorsReader, SafetensorsWriter
def peak():  # this process's own high-water mark (ru_maxrss would start at the parent's: Linux keeps it over exec)
    return next(int(ln.split()[1]) * 1024 for ln in open("/proc/self/status") if ln.startswith("VmHWM"))
n, size, mode, out = 8, 16 << 20, sys.argv[1], sys.argv[2]  # 8 tensors of 16 MiB in shards of 32 MiB
if mode == "write":
    writer = SafetensorsWriter(out, [(f"t{i}", (size // 4,), np.dtype(np.float32)) for i in range(n)], 2 * size)
    base = peak()
    for i in range(n):
        writer.write(f"t{i}", np.full(size // 4, i, np.float32))  # each array is dropped by us after the call
    writer.close()
else:
    reader = SafetensorsReader(out)
    base = peak()
    for i in range(n):
        x = reader.get(f"t{i}")
        assert x[0] == i and x[-1] == i
        del x
print((peak() - base) / size)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from Linux /proc")
def test_host_memory_is_one_tensor_writing_and_reading(tmp_path):
    """Peak RSS growth in units of one tensor, each direction in a fresh process: the caller's one array (measured
    1.0 both ways). A writer holding a shard until it is complete (the library's save_file) reaches the shard's 2
    tensors (measured 2.0); an mmap'd reader the 8 tensors of the files (touched pages stay resident
    while a file is open: measured 9.0)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    growth = {}
    for mode in ("write", "read"):
        out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, mode, str(tmp_path / "m")], capture_output=True,
                             text=True, env=env, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        growth[mode] = float(out.stdout)
    assert growth["write"] < 1.5, growth
    assert growth["read"] < 1.5, growth
