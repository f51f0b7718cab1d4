"""Multi-process runs of scripts/train.py on one machine: started from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES
and JAX_PROCESS_ID only process 0 logs steps and writes metrics; a peer that never connects ends the run after
--distributed_timeout_s with one line and exit code 5."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mjax.config import ConfigError, ParallelConfig
from mjax.parallel.distributed import coordinates

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--mock_data", "--num_layers=1", "--hidden_size=64", "--num_attention_heads=2", "--ffn_hidden_size=128",
         "--seq_length=32", "--global_batch_size=8", "--eval_interval=0", "--log_interval=1", "--noprogress"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    """2 CPU devices a process; no multi-process coordinates but the ones given."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
                                                              "JAX_PROCESS_ID")}
    return {**env, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2", **extra}


def test_coordinates_come_from_the_flags_or_all_three_environment_variables(monkeypatch):
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    assert coordinates(ParallelConfig()) is None  # a single-process run
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "host:1234")
    with pytest.raises(ConfigError, match="JAX_NUM_PROCESSES and JAX_PROCESS_ID"):
        coordinates(ParallelConfig())
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    assert coordinates(ParallelConfig()) == ("host:1234", 4, 3)
    flags = ParallelConfig(coordinator_address="other:1", num_processes=2, process_id=0)
    assert coordinates(flags) == ("other:1", 2, 0)  # explicit flags win
    monkeypatch.setenv("JAX_PROCESS_ID", "4")
    with pytest.raises(ConfigError, match="JAX_PROCESS_ID"):
        coordinates(ParallelConfig())


@pytest.mark.slow
def test_two_processes_from_the_environment_log_and_write_each_step_once(tmp_path):
    metrics, address = tmp_path / "metrics.jsonl", f"localhost:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, str(ROOT / "scripts" / "train.py"), *SMALL, "--train_iters=3",
                               f"--metrics_file={metrics}"], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=_env(JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)))
             for i in range(2)]
    try:
        errs = [p.communicate(timeout=300)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n----\n".join(e[-3000:] for e in errs)
    assert "process 0 of 2; 2 local / 4 global devices" in errs[0]  # one run over both processes' devices
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3]
    for step in (1, 2, 3):
        assert f"step {step:>6} | loss" in errs[0]
        assert f"step {step:>6} |" not in errs[1], errs[1][-3000:]


def test_a_missing_peer_ends_the_run_after_the_timeout_with_exit_5(tmp_path):
    address = f"localhost:{_free_port()}"
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *SMALL, "--train_iters=1",
                          "--num_processes=2", "--process_id=0", f"--coordinator_address={address}",
                          "--distributed_timeout_s=3"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=120)
    elapsed = time.monotonic() - t0
    assert out.returncode == 5, out.stderr[-3000:]
    assert elapsed < 30, elapsed
    errors = [line for line in out.stderr.splitlines() if "--distributed_timeout_s" in line and "failed" in line]
    assert len(errors) == 1 and "Traceback" not in out.stderr and "Check failure" not in out.stderr, out.stderr
