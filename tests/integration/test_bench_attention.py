"""benchmarks/bench_attention.py end to end off GPU (a subprocess, as its absl flags are global): --smoke runs the
block-size sweep and the table at toy sizes with the kernels interpreted (here at one sequence length); the TFLOP/s
it reports are checked against the causal FLOP count computed here and its ceiling against the table header."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.attention_cases import summarise_passes
from benchmarks.harness import pass_ratios, sm_clock_mhz

ROOT = Path(__file__).resolve().parents[2]


def causal_pairs(t, window):
    """Visible (query, key) pairs of a causal (sliding-window) mask by FlashAttention's convention (T^2 / 2,
    T W - W^2 / 2), checked against the pairs counted on the mask itself: T / 2 (W / 2) more, so within 1 / T."""
    q, k = np.arange(t)[:, None], np.arange(t)[None, :]
    visible = int(((k <= q) & ((q - k < window) if window is not None else True)).sum())
    w = t if window is None else min(window, t)
    convention = t * w - w * w / 2
    assert visible - convention == w / 2, (t, window, visible, convention)
    return convention



def test_pass_ratios_are_taken_within_each_pass():
    """A clock that halves in the third pass changes no ratio; a pass where either side failed is left out."""
    mine, cudnn = [1.0, 1.0, 2.0, None, 1.0], [1.1, 1.2, 2.2, 1.0, None]
    median, (low, high) = pass_ratios(mine, cudnn)
    assert median == pytest.approx(1.1) and low == pytest.approx(1.1) and high == pytest.approx(1.2)
    assert pass_ratios([None, 1.0], [1.0, None]) is None


def test_a_kernels_row_holds_its_median_times_and_its_speedup_over_cudnn_within_each_pass():
    # seconds (forward, forward + backward, error) over three passes, the clock halving in the last; the kernel's
    # forward + backward failed in the second
    kernel = [(1.0, 4.0, None, None, None), (1.0, None, "OOM", None, None), (2.0, 8.0, None, None, None)]
    cudnn = [(1.1, 4.4, None, None, None), (1.2, 4.8, None, None, None), (2.2, 8.8, None, None, None)]
    row = summarise_passes({}, kernel, cudnn, flop=1e12, ceiling=10.0)
    assert row["passes"] == 3 and row["error"] == "OOM"
    assert row["fwd_ms"] == 1000.0 and row["fwd_tflops"] == 1.0 and row["fwd_of_ceiling"] == 0.1
    assert row["fwd_bwd_ms"] == 6000.0 and row["fwd_bwd_tflops"] == pytest.approx(3.5 / 6.0)
    assert row["fwd_x_cudnn"] == pytest.approx(1.1) and row["fwd_x_cudnn_range"] == pytest.approx([1.1, 1.2])
    assert row["fwd_bwd_x_cudnn"] == pytest.approx(1.1)  # the failed pass left out
    one = summarise_passes({}, kernel[:1], None, flop=1e12, ceiling=10.0)
    assert one["passes"] == 1 and "fwd_x_cudnn" not in one and "fwd_x_cudnn_range" not in one
    assert "fwd_of_unpacked" not in row and "fwd_of_unpacked" not in one


@pytest.mark.parametrize("prints, visible, answers_id, want", [
    ("1755", None, 0, 1755), ("[N/A]", None, 0, None), (None, None, 0, None),
    ("1755", "3,1", 3, 1755), ("1755", "1", 3, None)])
def test_the_clock_is_nvidia_smis_number_for_jaxs_first_gpu_or_none(tmp_path, monkeypatch, prints, visible,
                                                                     answers_id, want):
    """A stand-in nvidia-smi on PATH that prints `prints` only when asked for GPU `answers_id` (JAX's first GPU is
    the first of CUDA_VISIBLE_DEVICES, else 0); (None) no nvidia-smi at all."""
    if prints is not None:
        fake = tmp_path / "nvidia-smi"
        fake.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = --id={answers_id} ] && echo "{prints}"; done\n')
        fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert sm_clock_mhz() == want


def test_a_row_holds_the_clock_read_after_each_of_its_loops_where_one_was_read():
    # the second pass's forward + backward failed (no clock after it), the third read no clock after its forward
    timed = [(1.0, 4.0, None, 1980, 1755), (1.0, None, "OOM", 1410, None), (2.0, 8.0, None, None, 1500)]
    unpacked = [(2.0, 8.0, None, 1965, 1740)] * 3
    row = summarise_passes({}, timed, None, flop=1e12, ceiling=10.0, unpacked_times=unpacked)
    assert row["fwd_clock_mhz"] == [1980, 1410, None] and row["fwd_bwd_clock_mhz"] == [1755, None, 1500]
    assert row["unpacked_fwd_clock_mhz"] == [1965] * 3 and row["unpacked_fwd_bwd_clock_mhz"] == [1740] * 3
    assert row["error"] == "OOM" and row["fwd_bwd_ms"] == 6000.0
    alone = summarise_passes({}, timed, None, flop=1e12, ceiling=10.0)  # no unpacked runs: no clocks of theirs
    assert not any(key.startswith("unpacked_") for key in alone), alone


def test_a_packed_row_holds_its_time_over_the_unpacked_rows_within_each_pass():
    # the packed kernel takes about half the unpacked time; the clock halves in the last pass, the packed
    # forward + backward failed in the second, the unpacked one in the third
    packed = [(0.5, 2.2, None, None, None), (0.6, None, "OOM", None, None), (1.0, 4.2, None, None, None)]
    unpacked = [(1.0, 4.0, None, None, None), (1.0, 4.0, None, None, None), (2.0, None, "OOM", None, None)]
    row = summarise_passes({}, packed, None, flop=1e12, ceiling=10.0, unpacked_times=unpacked)
    assert row["fwd_of_unpacked"] == pytest.approx(0.5) and row["fwd_of_unpacked_range"] == pytest.approx([0.5, 0.6])
    assert row["fwd_bwd_of_unpacked"] == pytest.approx(0.55)  # the one pass where both ran
    assert row["fwd_bwd_of_unpacked_range"] == pytest.approx([0.55, 0.55]) and "fwd_x_cudnn" not in row


TABLE_WITH_STUBBED_TIMING = """
import json, types
from benchmarks import bench_attention

calls = []

def time_or_error(fn, q, k, v, ids, *do, min_s):
    calls.append((fn, ids is not None))
    return (0.5 if ids is not None else 1.0) * (4.0 if do else 1.0), None

bench_attention.FLAGS = types.SimpleNamespace(passes=3, min_time_s=0.0)
bench_attention.time_or_error = time_or_error
bench_attention.attention_fns = lambda impl, *_: (f"{impl} fwd", f"{impl} fwd_bwd")
rows = []
# the "clock" names the timing call it follows
bench_attention.table((2, 1, 8), [16], 32, 64, {"pallas": None}, 1.0, True, rows, [], lambda: len(calls))
print(json.dumps({"rows": rows, "calls": calls}))
"""


def test_the_table_times_a_packed_kernel_unpacked_in_the_same_passes_in_alternating_order():
    """table() with the timing stubbed (in a subprocess: the script's absl flags are global): a packed kernel's time
    is half its unpacked time (forward + backward four times its forward), so the per-pass ratios are 0.5 only if
    the unpacked calls got no ids and the packed ones the case's; the passes run unpacked then packed, then the
    reverse; each pass's clock is the one read right after that pass's own loop."""
    proc = subprocess.run([sys.executable, "-c", TABLE_WITH_STUBBED_TIMING], cwd=ROOT,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    rows, calls = report["rows"], report["calls"]
    packed = next(r for r in rows if r["packed"])
    assert packed["fwd_of_unpacked"] == 0.5 and packed["fwd_bwd_of_unpacked"] == 0.5
    assert packed["fwd_bwd_of_unpacked_range"] == [0.5, 0.5] and "unpacked_error" not in packed
    assert not any("fwd_of_unpacked" in r for r in rows if not r["packed"])
    # the packed case's calls: each pass forward then forward + backward of unpacked and packed, odd passes reversed
    start = next(i for i, (_, with_ids) in enumerate(calls) if with_ids) - 2
    case = [[fn.split()[1], with_ids] for fn, with_ids in calls[start:start + 12]]
    unpacked, packed_ = [["fwd", False], ["fwd_bwd", False]], [["fwd", True], ["fwd_bwd", True]]
    assert case == unpacked + packed_ + packed_ + unpacked + unpacked + packed_, case
    # the stub's clock after call i (1-based) reads i: the packed row's passes followed calls 3-4, 5-6 and 11-12
    assert packed["fwd_clock_mhz"] == [start + 3, start + 5, start + 11], packed
    assert packed["fwd_bwd_clock_mhz"] == [start + 4, start + 6, start + 12], packed
    assert packed["unpacked_fwd_clock_mhz"] == [start + 1, start + 7, start + 9], packed
    clocks = f"MHz after fwd/f+b: {start + 3}/{start + 4} {start + 5}/{start + 6} {start + 11}/{start + 12}"
    assert clocks in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow  # ~15 s on 2 cores, more when loaded: ~13 interpreted kernel compiles
def test_smoke_run_prints_the_ceiling_and_writes_every_row(tmp_path):
    out = tmp_path / "attention.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_attention", "--smoke", "--seqs=128",
                           "--min_time_s=0.001", "--passes=2", f"--json_out={out}"],
                          cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    ceiling = report["matmul_ceiling_tflops"]
    assert ceiling > 0
    assert report["env"]["jax"] and report["env"]["device"]

    header = re.search(r"bf16 matmul ceiling measured in this run: ([0-9.e+-]+) TFLOP/s", proc.stdout)
    assert header, proc.stdout[-2000:]
    assert float(header.group(1)) == pytest.approx(ceiling, rel=1e-3)  # printed to 4 significant digits
    columns = proc.stdout[header.end():].splitlines()[1]  # the column names under the header line
    assert columns.count("of ceil") == 2, columns

    shape = report["shape"]
    n, h = shape["heads"], shape["head_dim"]

    # The sweep: every forward and backward configuration ran; FLOPs of the backward alone are 2.5x the forward's.
    tune_flop = 4 * shape["tune_batch"] * n * causal_pairs(shape["tune_seq"], None) * h
    assert [r["kind"] for r in report["tuning"]] == ["fwd"] * 2 + ["bwd"] * 2  # --smoke: two of each
    for r in report["tuning"]:
        assert r["error"] is None and r["ms"] > 0
        mult = 1.0 if r["kind"] == "fwd" else 2.5
        want = mult * tune_flop / (r["ms"] * 1e-3) / 1e12
        assert r["tflops"] == pytest.approx(want, rel=1e-9)
        assert r["of_ceiling"] == pytest.approx(r["tflops"] / ceiling, rel=1e-9)
    assert set(report["blocks"]) == {"pallas"}  # mosaic: timed on Hopper only
    assert set(report["blocks"]["pallas"]) >= {"block_q", "block_k", "block_q_dq", "block_k_dkv"}

    # The table: pallas and xla at the seq (cudnn skipped off GPU, saying why), then packed and window rows; xla's
    # forward + backward skipped above the smoke threshold (64).
    rows = report["table"]
    assert [(r["label"], r["seq"]) for r in rows] == [
        ("pallas", 128), ("xla", 128), ("pallas packed (4 docs/row)", 128), ("pallas window=64", 128),
        ("xla window=64", 128)]
    assert len(report["cudnn_skipped"]) == 2 and all("GPU" in s["reason"] for s in report["cudnn_skipped"])
    assert proc.stdout.count("| cudnn") == 2 and "skipped: cudnn needs a GPU" in proc.stdout
    packed = rows[2]  # its ratio to the same kernel unpacked, timed in its own passes
    low, high = packed["fwd_bwd_of_unpacked_range"]
    assert 0 < low <= packed["fwd_bwd_of_unpacked"] <= high
    assert re.search(r"\| pallas packed .* of unpacked: fwd [0-9.]+x, f\+b [0-9.]+x", proc.stdout), proc.stdout
    assert not any("fwd_of_unpacked" in r for r in rows if not r["packed"])
    for r in rows:
        assert r["error"] is None, r
        assert r["passes"] == 2 and "fwd_x_cudnn" not in r  # no cuDNN off GPU: no speed-up against it
        assert r["batch"] == max(1, shape["tokens"] // r["seq"])
        flop = 4 * r["batch"] * n * causal_pairs(r["seq"], r["window"]) * h
        modes = [("fwd_", 1.0)] + ([] if r["fwd_bwd_skipped"] else [("fwd_bwd_", 3.5)])
        assert r["fwd_bwd_skipped"] == (r["impl"] == "xla" and r["seq"] > 64)
        if r["fwd_bwd_skipped"]:
            assert "fwd_bwd_ms" not in r
        for prefix, mult in modes:
            assert r[f"{prefix}ms"] > 0
            assert r[f"{prefix}tflops"] == pytest.approx(mult * flop / (r[f"{prefix}ms"] * 1e-3) / 1e12,
                                                         rel=1e-9)
            assert r[f"{prefix}of_ceiling"] == pytest.approx(r[f"{prefix}tflops"] / ceiling, rel=1e-9)


def test_an_unknown_mosaic_candidate_is_one_line_naming_the_flag():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_attention", "--mosaic_candidates=fwd-kv64-s3,nope"],
                          cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("bench_attention: --mosaic_candidates: unknown ['nope']"), lines[-3:]
    assert "Traceback" not in proc.stderr
