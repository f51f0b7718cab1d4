"""benchmarks/cp_memory.py end to end on the tiny preset (a subprocess: its absl flags are global): every cell of the
table is compiled and printed, the temporaries fall with cp and grow with the sequence, the arguments are the
FSDP-sharded train state, and a bad flag is one line with exit code 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "8"}


def _run(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "benchmarks.cp_memory", "--config=tiny", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def _state_bytes_per_device(fsdp):
    """The tiny preset's train state per device, counted here from its shapes: fp32 params and two fp32 Adam moments
    (12 bytes a parameter), matrices (untied embedding and output layer) split over fsdp, norm scales whole on every
    device."""
    d, layers, heads, groups, ffn, vocab = 128, 4, 4, 2, 384, 1024  # mjax/config/presets/tiny.py
    head_dim = d // heads
    matrices = 2 * vocab * d + layers * (d * (heads + 2 * groups) * head_dim + heads * head_dim * d + 3 * d * ffn)
    norms = (2 * layers + 1) * d
    return 12 * (matrices // fsdp + norms)


@pytest.mark.slow  # ~1 min on 2 cores: 6 compiles, the Pallas kernels interpreted
def test_table_has_every_cell_and_temporaries_fall_with_cp(tmp_path):
    out = tmp_path / "cp_memory.json"
    proc = _run("--seqs=1k,2k", "--cps=1,2", "--num_devices=8", f"--json_out={out}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    cases = {(c["seq"], c["cp"]): c for c in report["cases"]}
    assert set(cases) == {(s, cp) for s in (1024, 2048) for cp in (1, 2)}
    assert all(c["error"] is None for c in [*cases.values(), *report["state_only"]]), report

    table = proc.stdout[proc.stdout.index("| seq |"):].splitlines()
    assert table[0] == "| seq | cp=1 (fsdp 8) | cp=2 (fsdp 4) |", table[0]
    rows = {line.split("|")[1].strip(): line for line in table if line.startswith("| ")}
    for seq in ("1k", "2k"):
        assert rows[seq].count("/") == 2 and rows[seq].count("[") == 2, rows[seq]  # temp / total [estimate]

    for seq in (1024, 2048):
        one, two = cases[seq, 1], cases[seq, 2]
        # the activations (most of the temporaries: the state here is ~1.5 MiB) split over the context ranks;
        # measured 0.74-0.79 at cp 2 (the ring's fp32 accumulators and K/V in flight are extra)
        assert two["temp_bytes"] < 0.85 * one["temp_bytes"], (seq, one["temp_bytes"], two["temp_bytes"])
        assert two["estimate"]["total_bytes"] * 2 == one["estimate"]["total_bytes"]
        for c in (one, two):
            assert c["total_bytes"] == c["argument_bytes"] + c["output_bytes"] - c["alias_bytes"] + c["temp_bytes"]
    for cp in (1, 2):
        assert cases[2048, cp]["temp_bytes"] > 1.5 * cases[1024, cp]["temp_bytes"]
        # arguments: the state as sharded, and the batch: 4 int32/f32 rows of a whole sequence per device (placed
        # split over the batch only; the context ranks take their part inside the step)
        for seq in (1024, 2048):
            want = _state_bytes_per_device(8 // cp) + 4 * 4 * seq
            assert cases[seq, cp]["argument_bytes"] == pytest.approx(want, rel=1e-3), (seq, cp)


def test_bad_flag_is_one_line_and_exit_2():
    proc = _run("--cps=3", "--num_devices=8", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == ["cp_memory: --cps: [3] do not divide --num_devices=8 (the layout is "
                                                "cp x fsdp)"]
