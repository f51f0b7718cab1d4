"""Bad input to scripts/train.py, run as a user would: exit code 2 and one line naming the flag or file, no traceback.

Every case fails before the train step is compiled; the model's init is compiled once and shared through a
persistent compilation cache (the same small model in every case but the gpt2 one)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mjax.data import IndexedDatasetWriter

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--num_layers=1", "--hidden_size=64", "--num_attention_heads=2", "--ffn_hidden_size=128",
         "--seq_length=32", "--train_iters=2", "--eval_interval=0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Prefixes of small indexed datasets: good (ids < 1000), too_big_ids (ids up to 4999, beyond the sample
    tokenizer's 1024), no_idx (the .bin alone), truncated_idx (the .idx cut in half); bad.json, no tokenizer."""
    d = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    for name, high in (("good", 1000), ("too_big_ids", 5000)):
        with IndexedDatasetWriter(d / name, np.uint16) as w:
            for _ in range(20):
                w.add_document(rng.integers(1, high, 200))
    shutil.copy(d / "good.bin", d / "no_idx.bin")
    shutil.copy(d / "good.bin", d / "truncated_idx.bin")
    idx = (d / "good.idx").read_bytes()
    (d / "truncated_idx.idx").write_bytes(idx[:len(idx) // 2])
    (d / "bad.json").write_text('{"not": "a tokenizer"}')
    return d


CASES = {  # name -> data directory -> (flags, what the error line must name)
    "unknown flag": lambda d: (["--no_such_flag=1"], ["no_such_flag"]),
    "missing .idx": lambda d: ([f"--data_path={d / 'no_idx'}"], [f"{d / 'no_idx'}.idx"]),
    "truncated .idx": lambda d: ([f"--data_path={d / 'truncated_idx'}"], [f"{d / 'truncated_idx'}.idx"]),
    "ids beyond the tokenizer": lambda d: ([f"--data_path={d / 'too_big_ids'}"],
                                           [f"{d / 'too_big_ids'}.bin", "--tokenizer_type", "--tokenizer_model"]),
    "missing tokenizer file": lambda d: (["--tokenizer_type=huggingface", f"--tokenizer_model={d / 'none.json'}",
                                          f"--data_path={d / 'good'}"], ["--tokenizer_model", "none.json"]),
    "unreadable tokenizer file": lambda d: (["--tokenizer_type=huggingface", f"--tokenizer_model={d / 'bad.json'}",
                                             f"--data_path={d / 'good'}"], ["--tokenizer_model", "bad.json"]),
    # the preset's tokenizer_model is the hub name "gpt2", not a file: mjax reads local files only
    "gpt2 preset's hub tokenizer": lambda d: (["--config=gpt2", f"--data_path={d / 'good'}"],
                                              ["--tokenizer_model=gpt2"]),
    "keep=0": lambda d: (["--mock_data", f"--save={d / 'run'}", "--keep=0"], ["--keep=0"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_exits_2_with_one_line_naming_it(data, case):
    flags, named = CASES[case](data)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1",
           "JAX_COMPILATION_CACHE_DIR": str(data / "jax_cache"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *SMALL, *flags], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert all(n in last for n in named), out.stderr[-3000:]
    assert not (data / "run").exists()  # nothing was trained or saved
