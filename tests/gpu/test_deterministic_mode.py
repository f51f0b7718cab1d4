"""On the GPU: with --deterministic_mode two training processes agree bitwise, with the attention kernel `auto`
picks then (Mosaic on Hopper: cuDNN's attention fails at run time under XLA's deterministic ops, so validation
refuses it by name and auto skips it) and the Triton one.

Without the flag, runs with cuDNN's attention did not agree; runs of this test's model with the Mosaic or Triton
kernel agreed without it too (H200; H100 also with a 512-token vocabulary: docs/performance.md, "Determinism"), so
the test catches runs with the flag that stop repeating, not runs that would part without it.
tests/integration/test_deterministic_mode.py checks on CPU that every compile of a run takes the options.

    JAX_PLATFORMS=cuda python3 -m pytest -m gpu tests/gpu/test_deterministic_mode.py -q
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
STEPS = 4


def _train(tmp_path, tag, attention_impl):
    metrics = tmp_path / f"{tag}.jsonl"
    # llama3.2-1b's layer shapes, narrower (pytest workers hold most of the GPU's memory); no warm-up, so that
    # every step moves the parameters and a difference in one step's gradients reaches the next step's loss
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), "--config=llama3.2-1b", "--model.num_layers=2",
           "--model.hidden_size=1024", "--model.num_attention_heads=16", "--model.num_query_groups=4",
           "--model.ffn_hidden_size=4096", "--model.vocab_size=32000", "--mock_data", f"--train_iters={STEPS}",
           "--log_interval=1", "--global_batch_size=4", "--seq_length=1024", "--lr_warmup_iters=0",
           f"--attention_impl={attention_impl}", "--deterministic_mode", f"--metrics_file={metrics}"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"}
    env.update(PYTHONPATH=str(ROOT), XLA_PYTHON_CLIENT_PREALLOCATE="false")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return [(r["loss"], r["grad_norm"]) for r in map(json.loads, metrics.read_text().splitlines())]


def test_two_processes_train_bitwise_alike(tmp_path):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    for impl in ("auto", "pallas"):  # one pair after another: a pair's processes never share the GPU's memory
        first, second = _train(tmp_path, f"{impl}_a", impl), _train(tmp_path, f"{impl}_b", impl)
        assert len(first) == STEPS, impl
        assert first == second, impl
