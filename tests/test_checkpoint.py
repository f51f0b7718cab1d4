"""Checkpoints: exact resume through the real data loader, a stop signal, restore onto other layouts, errors."""

import json
import os
import shutil
import signal

import jax
import numpy as np
import pytest

from mjax.checkpoint import Checkpointer, CheckpointError
from mjax.convert import orbax_io
from mjax.train.loop import build, train
from tests.train_utils import tiny_config

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
    os.environ["MJAX_TEST_JAX_CACHE"] = path
    yield path
    os.environ.pop("MJAX_TEST_JAX_CACHE", None)
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

    with pytest.MonkeyPatch.context() as m:
        m.setattr(Checkpointer, "after_step", interrupt_at_3)
        stopped = train(corpus_config(checkpoint=dict(save=directory)))
    return dict(dir=directory, full=_losses(full), stopped=stopped, state=_numpy(stopped.state))


def test_sigint_saves_and_stops_at_the_step_boundary(interrupted):
    stopped = interrupted["stopped"]
    assert stopped.stopped_at == 3 and len(stopped.history) == 3
    assert sorted(os.listdir(interrupted["dir"])) == ["3"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored


def test_resume_is_bitwise_exact_with_the_real_data_loader(interrupted):
    # The same command again: --save holds step 3, so the run resumes there (data position included).
    resumed = train(corpus_config(checkpoint=dict(save=interrupted["dir"])))
    assert [r["step"] for r in resumed.history] == [4, 5, 6]
    assert _losses(interrupted["stopped"]) + _losses(resumed) == interrupted["full"]  # bitwise
    assert sorted(os.listdir(interrupted["dir"])) == ["3", "6"]


@pytest.mark.parametrize("layout", [dict(tp=1, fsdp=1), dict(tp=2, fsdp=4), dict(tp=1, fsdp=8),
                                    dict(tp=1, fsdp=1, use_distributed_optimizer=True), "one device"])
def test_restore_reshards_onto_another_layout(interrupted, layout):
    devices = jax.devices()[:1] if layout == "one device" else None
    parallel = dict(tp=1, fsdp=1) if layout == "one device" else layout
    cfg = corpus_config(parallel=parallel, checkpoint=dict(load=interrupted["dir"], load_step=3))
    setup = build(cfg, devices)
    state, consumed = Checkpointer(cfg, setup).restore_or_init()
    assert consumed == 3 * cfg.train.global_batch_size
    for got, want, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(interrupted["state"]),
                                   jax.tree.leaves(setup.state_sharding)):
        assert got.sharding == sharding
        np.testing.assert_array_equal(_numpy(got), want)


def _restore(directory, checkpoint=(), **sections):
    cfg = corpus_config(checkpoint=dict(load=directory, **dict(checkpoint)), **sections)
    return Checkpointer(cfg, build(cfg)).restore_or_init()


def test_another_model_shape_names_the_parameter_and_both_shapes(interrupted):
    with pytest.raises(CheckpointError, match=r"params/embed/embedding has shape \(1024, 64\) in the checkpoint "
                                              r"but \(1024, 96\) in this model.*--hidden_size=64 \(this run: 96\)"):
        _restore(interrupted["dir"], model=dict(hidden_size=96))


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
        _restore(interrupted["dir"], checkpoint=dict(load_step=7))


@pytest.mark.parametrize("source", ["training checkpoint", "converted checkpoint"])
def test_load_params_only_takes_weights_with_a_fresh_optimizer(interrupted, tmp_path, source):
    directory = interrupted["dir"]
    if source == "converted checkpoint":  # the layout of mjax.convert: <dir>/params + <dir>/config.json
        directory = str(tmp_path / "converted")
        os.makedirs(directory)
        orbax_io.save_params(directory, interrupted["state"].params)
        orbax_io.write_json(os.path.join(directory, orbax_io.CONFIG), corpus_config().to_dict())
    state, consumed = _restore(directory, parallel=dict(tp=1, fsdp=4),
                               checkpoint=dict(load_params_only=True))
    assert consumed == 0 and int(state.step) == 0
    jax.tree.map(np.testing.assert_array_equal, _numpy(state.params), interrupted["state"].params)
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(state.opt_state[0].mu))
