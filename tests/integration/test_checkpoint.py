"""Checkpoints: exact resume through the real data loader, a stop signal, restore onto other layouts, errors."""

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import jax
import numpy as np
import pytest

from mjax.storage import params as params_io
from mjax.storage.steps import CheckpointError
from mjax.train.checkpoint import Checkpointer
from mjax.train.loop import build, checkpointer, train
from tests.helpers.train_utils import tiny_config

# Training runs and compiled steps: the full suite (make test-all) only, not make test.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SAVED_LAYOUT = dict(tp=2, fsdp=2)  # x dp=2 on the 8 CPU devices


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
    """The runs of this module compile the same step several times: a persistent cache makes repeats cheap. The
    subprocess tests share it through the environment."""
    from jax._src import compilation_cache as cc  # noqa: PLC0415

    path = str(tmp_path_factory.mktemp("jax_cache"))
    saved = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    cc.reset_cache()
    yield path
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])
    cc.reset_cache()


def corpus_config(**sections):
    """The tiny test model on the bundled sample corpus (read through build_data_iterators)."""
    base = tiny_config(model=dict(vocab_size=1024), train=dict(train_iters=6), parallel=SAVED_LAYOUT,
                       optimizer=dict(lr_decay_style="cosine", lr_warmup_iters=2))
    return base.replace(**sections)


def _losses(result):
    return [r["loss"] for r in result.history]


def _numpy(tree):
    def one(x):
        return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    return jax.tree.map(lambda x: np.asarray(jax.device_get(one(x))), tree)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """Six uninterrupted steps; and the same run stopped by SIGINT after step 3 (checkpoint in `dir`)."""
    directory = str(tmp_path_factory.mktemp("ckpt") / "run")
    full = train(corpus_config())
    after_step = Checkpointer.after_step

    def interrupt_at_3(self, step, state, consumed):
        if step == 3:
            signal.raise_signal(signal.SIGINT)
        return after_step(self, step, state, consumed)

    handler = signal.getsignal(signal.SIGINT)  # SIG_IGN where the suite runs in a background job
    with pytest.MonkeyPatch.context() as m:
        m.setattr(Checkpointer, "after_step", interrupt_at_3)
        stopped = train(corpus_config(checkpoint=dict(save=directory)))
    return dict(dir=directory, full=_losses(full), stopped=stopped, state=_numpy(stopped.state), handler=handler)


def test_sigint_saves_and_stops_at_the_step_boundary(interrupted):
    stopped = interrupted["stopped"]
    assert stopped.stopped_at == 3 and len(stopped.history) == 3
    assert sorted(os.listdir(interrupted["dir"])) == ["3"]
    assert signal.getsignal(signal.SIGINT) is interrupted["handler"]  # handlers restored


def test_resume_is_bitwise_exact_with_the_real_data_loader(interrupted, tmp_path):
    run_dir = shutil.copytree(interrupted["dir"], tmp_path / "run")
    # The same command again: --save holds step 3, so the run resumes there (data position included).
    resumed = train(corpus_config(checkpoint=dict(save=str(run_dir))))
    assert [r["step"] for r in resumed.history] == [4, 5, 6]
    assert _losses(interrupted["stopped"]) + _losses(resumed) == interrupted["full"]  # bitwise
    assert sorted(os.listdir(run_dir)) == ["3", "6"]


@pytest.mark.parametrize("layout", [dict(tp=1, fsdp=1), dict(tp=2, fsdp=4), dict(tp=1, fsdp=8),
                                    dict(tp=1, fsdp=1, use_distributed_optimizer=True), "one device"])
def test_restore_reshards_onto_another_layout(interrupted, layout):
    devices = jax.devices()[:1] if layout == "one device" else None
    parallel = dict(tp=1, fsdp=1) if layout == "one device" else layout
    cfg = corpus_config(parallel=parallel, checkpoint=dict(load=interrupted["dir"], ckpt_step=3))
    setup = build(cfg, devices)
    state, consumed = checkpointer(setup).restore_or_init()
    assert consumed == 3 * cfg.train.global_batch_size
    for got, want, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(interrupted["state"]),
                                   jax.tree.leaves(setup.state_sharding)):
        assert got.sharding == sharding
        np.testing.assert_array_equal(_numpy(got), want)


def _restore(directory, checkpoint=(), **sections):
    cfg = corpus_config(checkpoint=dict(load=directory, **dict(checkpoint)), **sections)
    return checkpointer(build(cfg)).restore_or_init()


def test_another_model_shape_names_the_parameter_and_both_shapes(interrupted):
    with pytest.raises(CheckpointError, match=r"params/embed/embedding has shape \(1024, 64\) in the checkpoint "
                                              r"but \(1024, 96\) in this model.*--hidden_size=64 \(this run: 96\)"):
        _restore(interrupted["dir"], model=dict(hidden_size=96))


# Orbax's other pending reads are abandoned when one fails; their coroutines are then collected unawaited.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_or_missing_files_are_named(interrupted, tmp_path):
    corrupt = tmp_path / "corrupt"
    shutil.copytree(interrupted["dir"], corrupt)
    largest = max((p for p in (corrupt / "3" / "train_state").rglob("*") if p.is_file()), key=os.path.getsize)
    largest.write_bytes(largest.read_bytes()[:1000])  # the array data, cut short
    with pytest.raises(CheckpointError, match=rf"cannot read checkpoint step 3 in {corrupt}: .*Error reading "
                                              rf".*{corrupt}/3/train_state/.*not valid for value of size 1000"):
        _restore(str(corrupt))
    (corrupt / "3" / "params" / "_METADATA").unlink()
    with pytest.raises(CheckpointError, match=rf"{corrupt}/3/params/_METADATA is missing"):
        _restore(str(corrupt))


def test_load_of_a_directory_without_checkpoints_says_so(interrupted, tmp_path):
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        _restore(str(tmp_path))
    with pytest.raises(CheckpointError, match="does not exist"):
        _restore(str(tmp_path / "missing"))
    with pytest.raises(CheckpointError, match=r"--ckpt_step=7: .* holds steps \[3"):
        _restore(interrupted["dir"], checkpoint=dict(ckpt_step=7))


def test_a_runs_own_steps_win_over_load_and_ckpt_step(interrupted, tmp_path):
    """A requeued job with --save=B --load=A --ckpt_step=k resumes from B's latest step, not from A again; only
    with --load equal to --save does --ckpt_step pick among the run's own steps."""
    own = tmp_path / "own"
    shutil.copytree(interrupted["dir"], own)
    state, _ = _restore(str(tmp_path / "elsewhere"), checkpoint=dict(save=str(own), ckpt_step=7))
    assert int(state.step) == 3
    with pytest.raises(CheckpointError, match=r"--ckpt_step=7: .* holds steps \[3"):
        _restore(str(own), checkpoint=dict(save=str(own), ckpt_step=7))


@pytest.mark.parametrize("source", ["training checkpoint", "converted checkpoint"])
def test_load_params_only_takes_weights_with_a_fresh_optimizer(interrupted, tmp_path, source):
    directory = interrupted["dir"]
    if source == "converted checkpoint":  # the layout of mjax.convert: <dir>/params + <dir>/config.json
        directory = str(tmp_path / "converted")
        os.makedirs(directory)
        params_io.save_params(directory, interrupted["state"].params)
        params_io.write_json(os.path.join(directory, params_io.CONFIG), corpus_config().to_dict())
    state, consumed = _restore(directory, parallel=dict(tp=1, fsdp=4),
                               checkpoint=dict(load_params_only=True))
    assert consumed == 0 and int(state.step) == 0
    jax.tree.map(np.testing.assert_array_equal, _numpy(state.params), interrupted["state"].params)
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(state.opt_state[0].mu))


# corpus_config() as train.py flags (mock data): the same compiled step, so the subprocesses hit the compile cache
CLI = ["--config=tiny", "--model.num_layers=2", "--hidden_size=64", "--num_attention_heads=4", "--num_query_groups=2",
       "--ffn_hidden_size=128", "--vocab_size=1024", "--train_iters=6", "--global_batch_size=16", "--seq_length=32",
       "--lr=0.01", "--min_lr=0", "--lr_warmup_iters=2", "--lr_decay_style=cosine", "--log_interval=1",
       "--noprogress", "--tp=2", "--fsdp=2", "--mock_data"]


class _Run:
    """tests/helpers/checkpoint_train.py in a subprocess; its output is read by a thread so waits can time out."""

    def __init__(self, flags, cache, **env):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "8", "PYTHONPATH": str(ROOT),
               "JAX_COMPILATION_CACHE_DIR": cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", **env}
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "helpers" / "checkpoint_train.py"), *CLI, *flags],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines, self._queue = [], queue.Queue()
        threading.Thread(target=lambda: [self._queue.put(x) for x in self.proc.stdout] + [self._queue.put(None)],
                         daemon=True).start()

    def wait_for(self, marker: str, timeout: float = 240) -> None:
        while True:
            try:
                line = self._queue.get(timeout=timeout)
            except queue.Empty:
                self.proc.kill()
                raise AssertionError(f"no {marker!r} within {timeout}s:\n{self.output[-3000:]}") from None
            if line is None:
                raise AssertionError(f"exited ({self.proc.wait()}) before {marker!r}:\n{self.output[-3000:]}")
            self.lines.append(line)
            if marker in line:
                return

    def finish(self, timeout: float = 120) -> int:
        rc = self.proc.wait(timeout=timeout)
        self.wait_for_end()
        return rc

    def wait_for_end(self) -> None:
        while (line := self._queue.get(timeout=30)) is not None:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)


def test_kill_9_mid_save_keeps_the_last_complete_step_and_sigterm_saves_then_exits_0(tmp_path, compilation_cache):
    run_dir, metrics = tmp_path / "run", tmp_path / "metrics.jsonl"
    flags = [f"--save={run_dir}", "--save_interval=1", "--keep=2", f"--metrics_file={metrics}"]
    crashed = _Run(flags, compilation_cache, MJAX_TEST_HANG_STEP="4")
    crashed.wait_for("HANGING_SAVE")  # step 4's data is written, its commit (the rename) has not happened
    crashed.proc.kill()
    crashed.finish()
    left = sorted(os.listdir(run_dir))
    assert left[:2] == ["2", "3"] and len(left) == 3 and left[2].startswith("4.orbax-checkpoint-tmp"), left

    resumed = _Run(flags, compilation_cache, MJAX_TEST_PAUSE_STEP="5")  # the same command, as a requeued job
    resumed.wait_for("PAUSED")
    resumed.proc.send_signal(signal.SIGTERM)
    assert resumed.finish() == 0, resumed.output[-3000:]
    assert "restored checkpoint step 3" in resumed.output and "stopping at step 5 on a signal" in resumed.output
    assert sorted(os.listdir(run_dir)) == ["4", "5"]  # the partial step 4 was removed; --keep=2
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    restart = next(i for i in range(1, len(records)) if records[i]["step"] <= records[i - 1]["step"])
    before, after = records[:restart], records[restart:]  # (the killed run may have logged step 5 too)
    assert [r["step"] for r in before][:4] == [1, 2, 3, 4] and [r["step"] for r in after] == [4, 5]
    assert all(r["loss"] == before[r["step"] - 1]["loss"] for r in after if r["step"] <= len(before))  # bitwise


def test_two_processes_save_restore_onto_another_layout_and_stop_together(tmp_path):
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "helpers" / "multiprocess_checkpoint.py"), str(i), str(port),
                               str(tmp_path), str(tmp_path / f"{i}.json")], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = [p.communicate(timeout=400)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)[-4000:]
    results = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(2)]
    assert results[0] == results[1]
    r = results[0]
    assert sorted(os.listdir(tmp_path / "a")) == ["2", "4"]
    np.testing.assert_allclose(r["resume"][:2], r["save"][2:], rtol=1e-5)  # steps 3-4, resharded
    assert 4 < r["stopped_at"] < 100, r  # both stopped at the step JAX's preemption sync chose
    assert sorted(os.listdir(tmp_path / "b")) == [str(r["stopped_at"])]
