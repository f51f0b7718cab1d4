"""Resuming and stopping: nothing left to train exits without compiling, changed settings are reported, a converted
checkpoint needs --load_params_only, a SIGTERM while compiling stops cleanly, --eval_interval needs validation data.

One tiny run saved at step 2 (module fixture) is what every resume reads."""

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from mjax.storage.steps import CheckpointError
from mjax.train.loop import checkpointer
from mjax.config import ConfigError
from mjax.storage import params as params_io
from mjax.train.loop import Setup, build, train
from tests.helpers.train_utils import pattern_batches, tiny_config

# Training runs and compiled steps: the full suite (make test-all) only, not make test.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("compilation_cache")]  # the runs compile the same step again

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A two-step run saved at step 2: (its directory, its final params as numpy)."""
    directory = str(tmp_path_factory.mktemp("resume") / "run")
    cfg = tiny_config(train=dict(train_iters=2), checkpoint=dict(save=directory))
    result = train(cfg, data=(pattern_batches(cfg), None))
    assert sorted(os.listdir(directory)) == ["2"]
    return directory, jax.tree.map(np.asarray, jax.device_get(result.state.params))


@pytest.fixture
def mjax_warnings(caplog, monkeypatch):
    """caplog's warnings of the "mjax" logger, whether or not a script's setup_logging stopped its propagation."""
    monkeypatch.setattr(logging.getLogger("mjax"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="mjax")
    return lambda: [r.getMessage() for r in caplog.records if r.name.startswith("mjax") and
                    r.levelno >= logging.WARNING]


@pytest.fixture
def no_compile(monkeypatch):
    def compile_step(self, *args, **kwargs):
        raise AssertionError("the train step was compiled")

    monkeypatch.setattr(Setup, "compile_step", compile_step)


def test_resuming_at_train_iters_returns_without_compiling(saved, no_compile, mjax_warnings):
    directory, _ = saved
    cfg = tiny_config(train=dict(train_iters=2), checkpoint=dict(save=directory))
    result = train(cfg, data=(pattern_batches(cfg), None))
    assert result.history == [] and result.eval_history == [] and int(result.state.step) == 2
    (warning,) = mjax_warnings()
    assert "--train_iters" in warning and "step 2" in warning
    assert sorted(os.listdir(directory)) == ["2"]  # nothing saved again


def _restore(cfg):
    return checkpointer(build(cfg)).restore_or_init()


def test_resuming_with_other_settings_lists_every_changed_one(saved, mjax_warnings):
    directory, _ = saved
    changed = tiny_config(optimizer=dict(lr=5e-3), data=dict(split="90,10,0", eod_mask_loss=True),
                          train=dict(train_iters=9), checkpoint=dict(load=directory))
    state, _ = _restore(changed)
    assert int(state.step) == 2
    (warning,) = mjax_warnings()
    for field in ("--optimizer.lr", "--data.split", "--data.eod_mask_loss"):
        assert field in warning, warning
    assert "train_iters" not in warning  # continuing a run for longer is what resuming is for


def test_resuming_onto_another_layout_with_the_same_settings_is_silent(saved, mjax_warnings):
    directory, _ = saved
    same = tiny_config(train=dict(train_iters=9), parallel=dict(tp=2), logging=dict(log_interval=5),
                       checkpoint=dict(load=directory))
    _restore(same)
    assert mjax_warnings() == []


def test_load_of_a_converted_checkpoint_needs_load_params_only(saved, tmp_path):
    _, params = saved
    converted = tmp_path / "converted"  # the layout mjax.convert writes: <dir>/params + <dir>/config.json
    converted.mkdir()
    params_io.save_params(converted, params)
    params_io.write_json(converted / params_io.CONFIG, tiny_config().to_dict())
    with pytest.raises(CheckpointError, match="--load_params_only"):
        _restore(tiny_config(checkpoint=dict(load=str(converted))))
    state, consumed = _restore(tiny_config(checkpoint=dict(load=str(converted), load_params_only=True)))
    assert int(state.step) == 0 and consumed == 0
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, jax.device_get(state.params)), params)


def test_sigterm_while_compiling_stops_cleanly_with_nothing_saved(monkeypatch, tmp_path):
    compile_step = Setup.compile_step

    def sigterm_then_compile(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return compile_step(self, *args, **kwargs)

    monkeypatch.setattr(Setup, "compile_step", sigterm_then_compile)
    directory = tmp_path / "run"
    cfg = tiny_config(checkpoint=dict(save=str(directory), save_interval=1))
    result = train(cfg, data=(pattern_batches(cfg), None))  # returns: no exception, the process lives
    assert result.history == [] and result.stopped_at == 0 and int(result.state.step) == 0
    assert not directory.exists() or os.listdir(directory) == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored


def test_eval_interval_without_validation_data_is_an_error(no_compile):
    cfg = tiny_config(train=dict(eval_interval=2))
    with pytest.raises(ConfigError, match="--eval_interval=2"):
        train(cfg, data=(pattern_batches(cfg), None))


def test_train_script_exits_0_on_a_sigterm_during_start_up(tmp_path):
    """SIGTERM once the step is being traced: whether it lands in the compile or in the first steps, the run stops
    on it and exits 0 (with no handler installed yet the process would die of the signal)."""
    metrics = tmp_path / "m.jsonl"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "train.py"), "--mock_data", "--num_layers=1",
                             "--hidden_size=64", "--num_attention_heads=2", "--ffn_hidden_size=128",
                             "--seq_length=32", "--train_iters=100000", "--eval_interval=0", "--log_interval=1",
                             f"--metrics_file={metrics}"], env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if "attention:" in line:  # logged while the train step is traced, before it is compiled
                proc.send_signal(signal.SIGTERM)
                break
        rest = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
    output = "".join(lines) + rest
    assert proc.returncode == 0, output[-3000:]
    assert "received SIGTERM" in output and "on a signal" in output and "Traceback" not in output
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()] if metrics.exists() else []
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < 100000
