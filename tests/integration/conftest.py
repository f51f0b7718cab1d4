"""Fixtures of this folder: a two-step training checkpoint shared by the conversion tests, and a persistent
compilation cache for modules that compile the same programs again."""

import jax
import numpy as np
import pytest

from tests.helpers.train_utils import pattern_batches, tiny_config


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """(save directory, Config, trained params as numpy) of the tiny model trained 2 steps with the default data
    config (sample tokenizer, vocab 1024), saved at steps 1 and 2."""
    from mjax.train.loop import train

    save = tmp_path_factory.mktemp("run") / "save"
    cfg = tiny_config(model=dict(vocab_size=1024), train=dict(train_iters=2),
                      checkpoint=dict(save=str(save), save_interval=1, async_save=False))
    assert cfg.data.tokenizer_type == "sample" and cfg.data.tokenizer_model is None  # what a default run saves
    result = train(cfg, data=(pattern_batches(cfg), None), devices=jax.devices()[:1])
    return save, cfg, jax.tree.map(np.asarray, result.state.params)


@pytest.fixture(scope="module")
def compilation_cache(tmp_path_factory):
    """A module-wide persistent compilation cache, for runs that compile the same init and train step again (new
    closures). Only for programs XLA:CPU reloads fine (the reference cross-entropy; see tests/conftest.py)."""
    from jax._src import compilation_cache as cc  # noqa: PLC0415

    saved = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    cc.reset_cache()
    yield
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])
    cc.reset_cache()
