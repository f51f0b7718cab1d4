"""The benchmark harness runs on CPU: a sweep gives one row per case, with the ceiling and JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mjax.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
from benchmarks import benchmark

# Training runs and compiled steps: the full suite (make test-all) only, not make test.
pytestmark = pytest.mark.slow


def test_sweep_grid_and_field_names():
    cases = benchmark.parse_sweep("remat_policy=none,full; tp=1,2")
    assert cases == [{"remat_policy": "none", "tp": "1"}, {"remat_policy": "none", "tp": "2"},
                     {"remat_policy": "full", "tp": "1"}, {"remat_policy": "full", "tp": "2"}]
    cfg, options = benchmark.apply_case(load_config("tiny"), {"model.num_layers": "3", "micro_batch_size": "2"})
    assert cfg.model.num_layers == 3 and cfg.train.micro_batch_size == 2 and options is None
    with pytest.raises(ConfigError, match="unknown config field 'bogus'"):
        benchmark.apply_case(load_config("tiny"), {"bogus": "1"})


def test_sweep_tuple_fields_and_xla_options():
    cfg, options = benchmark.apply_case(load_config("tiny"), {
        "remat_save_names": "mlp_up+mlp_out", "xla": "xla_gpu_enable_triton_gemm:false+xla_dump_max_hlo_modules:3"})
    assert cfg.execution.remat_save_names == ("mlp_up", "mlp_out")
    assert options == {"xla_gpu_enable_triton_gemm": False, "xla_dump_max_hlo_modules": 3}
    assert benchmark.apply_case(load_config("tiny"), {"xla": "default"})[1] is None
    with pytest.raises(ConfigError, match="not name:value"):
        benchmark.apply_case(load_config("tiny"), {"xla": "xla_gpu_enable_triton_gemm"})


def test_benchmark_script_prints_a_table_and_json(tmp_path):
    """One sweep case and the baseline (the sweep's grid: above; remat's equal losses: test_train.py)."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.benchmark", "--config=tiny", "--model.num_layers=2", "--seq_length=64",
         "--steps=2", "--sweep=remat_policy=full", "--baseline", f"--json_out={tmp_path / 'b.json'}"],
        env={**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "8"}, capture_output=True, text=True,
        timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "matmul ceiling measured in this run" in out.stdout
    assert "remat_policy=full" in out.stdout and "plain-JAX baseline (1 device)" in out.stdout
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["devices"] == 8 and data["ceiling_tflops"] > 0
    rows = data["results"]
    assert [r["name"] for r in rows] == ["remat_policy=full", "plain-JAX baseline (1 device)"]
    assert all(r["error"] is None and r["tokens_per_s"] > 0 for r in rows)
    # Random tokens over the tiny vocab, near initialisation: both steps compute the language-model loss.
    assert all(abs(r["loss"] - np.log(1024)) < 0.5 for r in rows)
