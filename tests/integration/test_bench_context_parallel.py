"""benchmarks/bench_context_parallel.py end to end off GPU (a subprocess: its absl flags are global). --smoke runs
every stage at toy sizes with the kernels interpreted; the rates are checked against the FLOPs counted here (rank
0's share of the causal work is exactly 1/cp), and the balance against the per-(rank, step) times it reports."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~15 s on 2 cores: interpreted kernel compiles
def test_smoke_run_reports_consistent_rates(tmp_path):
    out = tmp_path / "cp.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_context_parallel", "--smoke", "--cps=2",
                           "--min_time_s=0.001", f"--json_out={out}"],
                          cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    t, (n, _, h) = report["seq"], report["heads"]
    total = 4 * n * (t * t / 2) * h  # causal forward FLOPs, batch 1
    one = report["one_kernel"]["pallas"]
    assert one["fwd_tflops"] == pytest.approx(total / (one["fwd_ms"] * 1e-3) / 1e12, rel=1e-9)
    ring = report["ring"]
    assert ring["fwd_error"] is None and ring["fwd_bwd_error"] is None
    assert ring["fwd_tflops"] == pytest.approx(total / 2 / (ring["fwd_ms"] * 1e-3) / 1e12, rel=1e-9)
    assert ring["fwd_bwd_tflops"] == pytest.approx(3.5 * total / 2 / (ring["fwd_bwd_ms"] * 1e-3) / 1e12, rel=1e-9)
    assert ring["fwd_of_one_kernel"] == pytest.approx(ring["fwd_tflops"] / one["fwd_tflops"], rel=1e-9)
    balanced, naive = report["balance"]["cp2_balanced_ms"], report["balance"]["cp2_naive_ms"]
    assert len(balanced) == len(naive) == 2 and all(len(row) == 2 for row in balanced + naive)
    ring_ms = {name: sum(max(row) for row in steps) for name, steps in (("b", balanced), ("n", naive))}
    assert report["balance"]["cp2_speedup"] == pytest.approx(ring_ms["n"] / ring_ms["b"], rel=1e-9)
    assert "target >= 90%" in proc.stdout and "target >= 1.3x" in proc.stdout
