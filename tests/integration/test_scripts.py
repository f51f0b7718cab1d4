"""The command-line entry points, run as a user would (subprocesses on 8 CPU devices)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Training runs and compiled steps: the full suite (make test-all) only, not make test.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "8"}


def _train(*flags, cwd=ROOT):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *flags], env=ENV, cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def corpus_run(tmp_path_factory):
    """(output directory, finished process) of one train.py run on the bundled corpus (no data flags) in a parallel
    layout with metrics and TensorBoard: the tests below check different parts of it."""
    tmp = tmp_path_factory.mktemp("corpus_run")
    out = _train("--tp=2", "--fsdp=2", "--dp=2", "--train_iters=2", "--log_interval=1", "--eval_interval=2",
                 f"--data_cache_path={tmp}", f"--metrics_file={tmp / 'm.jsonl'}", f"--tensorboard_dir={tmp / 'tb'}")
    assert out.returncode == 0, out.stderr[-3000:]
    return tmp, out


def test_train_script_runs_a_parallel_layout_and_writes_metrics(corpus_run):
    tmp, out = corpus_run
    assert "tensor=2" in out.stderr and "fsdp=2" in out.stderr and "data=2" in out.stderr
    records = [json.loads(line) for line in (tmp / "m.jsonl").read_text().splitlines()]
    train = [r for r in records if "split" not in r]
    assert [r["step"] for r in train] == [1, 2]
    for key in ("step", "loss", "grad_norm", "lr", "tokens_per_s", "tflops_per_device", "mfu", "peak_memory_bytes"):
        assert key in train[-1]
    assert [(r["step"], r["split"]) for r in records if "split" in r] == [(2, "valid"), (2, "test")]
    assert list((tmp / "tb").glob("events.out.tfevents.*"))


def test_run_without_data_flags_trains_on_the_bundled_corpus(corpus_run):
    _, out = corpus_run
    assert "valid loss" in out.stderr and "test loss" in out.stderr and "step      2" in out.stderr


def test_config_errors_exit_2_with_the_flag_named():
    out = _train("--model.num_attention_heads=3", "--mock_data")
    assert out.returncode == 2
    assert "--model.num_attention_heads=3" in out.stderr and "Traceback" not in out.stderr


def test_layout_check_script_matches_one_device_on_the_layouts_asked_for(tmp_path):
    """The program end to end on a representative pair (every layout's numbers: test_parallel.py, test_pipeline.py)."""
    env = {**ENV, "JAX_NUM_CPU_DEVICES": "2"}
    run = lambda *f: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "benchmarks.check_layouts", *f], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=300)
    out = run("--steps=2", "--seq_length=64", "--layouts=tp2 sp dp1,pp2 dp1", f"--json_out={tmp_path / 'l.json'}")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    report = json.loads((tmp_path / "l.json").read_text())
    assert [r["layout"] for r in report["rows"]] == ["tp2 sp dp1", "pp2 dp1"]
    assert all(r["max_rel_diff"] < 1e-4 and len(r["losses"]) == 2 for r in report["rows"])
    assert len(report["reference"]) == 2 and "1 device" in out.stdout and "pp2 dp1" in out.stdout
    bad = run("--layouts=dp2,pp3")  # bad input: one line, exit 2 (a failed comparison is exit 1)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("check_layouts: --layouts=dp2,pp3: "
                                                                               "unknown ['pp3']"), bad.stderr[-2000:]
    stray = run("dp2")
    assert stray.returncode == 2 and "unexpected arguments: dp2" in stray.stderr


def test_qkv_grad_bench_prints_the_kernel_next_to_its_ceiling(tmp_path):
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_qkv_grad", "--smoke",
                          f"--out={tmp_path / 'q.json'}"], env=ENV, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "q.json").read_text())["rows"]
    assert [r["case"].split(":")[0] for r in rows] == ["copy of the same bytes (ceiling)", "xla", "pallas"]
    assert rows[0]["of_copy"] == 1.0 and all(r["us"] > 0 for r in rows)


def test_convergence_script_trains_each_recipe_from_the_same_start(tmp_path):
    """Two recipes (the reference and FP8), two steps: the program's table and JSON, not each recipe's numbers."""
    run = lambda *f: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "benchmarks.convergence", "--config=tiny", "--model.num_layers=1",
         "--train_iters=2", "--window=1", "--bf16", "--global_batch_size=8", "--seq_length=64", *f],
        env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = run("--recipes=bf16,tensorwise", "--eval_interval=2", "--eval_iters=1", f"--out={tmp_path / 'c.json'}")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "c.json").read_text())["recipes"]
    assert list(rows) == ["bf16", "tensorwise"] and rows["bf16"]["max_abs_diff"] == 0
    assert all(len(r["windows"]) == 2 for r in rows.values())
    assert all(5 < r["final_eval_loss"] < 8 for r in rows.values())
    assert 0 < rows["tensorwise"]["max_abs_diff"] < 0.2  # a different run, and not a diverged one
    assert all(5 < w < 8 for r in rows.values() for w in r["windows"])  # ~ln(vocab) at the start, finite
    assert "tensorwise" in out.stdout and "eval" in out.stdout
    bad = run("--recipes=bf16,fp3")
    assert bad.returncode == 2 and "--recipes: unknown ['fp3']" in bad.stderr


def test_source_corpus_writes_each_utf8_file_once_in_path_order(tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "b.py").write_text("print('b')\n")
    (src / "pkg" / "a.py").write_text("x = 1\n")
    (src / "pkg" / "bad.py").write_bytes(b"\xff\xfe not utf-8")
    (src / "notes.txt").write_text("not a .py file")
    script = ["-m", "tools.source_corpus"]
    out = subprocess.run([sys.executable, *script, f"--roots={src},{src / 'pkg'}", f"--out={tmp_path / 'c.jsonl'}"],
                         env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    docs = [json.loads(line)["text"] for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert docs == ["print('b')\n", "x = 1\n"]  # sorted paths, the nested root not twice, bad bytes skipped
    bad = subprocess.run([sys.executable, *script, f"--roots={tmp_path / 'nope'}", f"--out={tmp_path / 'd.jsonl'}"],
                         env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--roots: not a directory" in bad.stderr
