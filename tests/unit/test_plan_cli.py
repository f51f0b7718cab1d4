"""scripts/plan.py end to end: a plan with its JSON, and bad input as one line with exit code 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--config=tiny", "--num_layers=2", "--seq_length=64", "--global_batch_size=8", "--remat_policies=none",
         "--max_pp=2", "--max_cp=2"]


def _plan(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "scripts/plan.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_plan_ranks_layouts_and_writes_the_winner_command(tmp_path):
    out = tmp_path / "plan.json"
    r = _plan(*SMALL, "--num_gpus=8", "--gpu=h100", f"--json_out={out}")
    assert r.returncode == 0, r.stderr
    plan = json.loads(out.read_text())
    winner = plan["ranked"][0]
    assert f"winner: {winner['command']}" in r.stdout
    assert winner["command"].startswith("python scripts/train.py --config=tiny ")
    times = [row["step_time_s"] for row in plan["ranked"]]
    assert times == sorted(times) and all(row["reject"] is None for row in plan["ranked"])


def test_bad_input_is_one_line_and_exit_code_2():
    for args, word in ((["--num_gpus=8", "--gpu=a100"], "--gpu=a100"), (["--gpu=h100"], "--num_gpus"),
                       (["--num_gpus=12", "--gpus_per_node=8", "--gpu=h100"], "--num_gpus=12"),
                       (["--num_gpus=8", "--gpu=h100", "--remat_policies=some"], "--remat_policies")):
        r = _plan(*SMALL, *args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and word in lines[0], (args, r.stderr)
