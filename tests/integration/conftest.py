"""A two-step training checkpoint shared by the conversion tests of this folder."""

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
