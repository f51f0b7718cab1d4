"""The notice of a resumed run compares the saved config under today's names: a checkpoint saved before a field
moved (model.sliding_window -> model.window_size, model.remat_policy -> execution.remat_policy) still reports a
changed value, and one saved with the same values reports nothing."""

import json
import logging

import pytest

from mjax.config import load_config
from mjax.train import checkpoint


@pytest.fixture
def warnings(caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("mjax"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="mjax")
    return lambda: [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _saved_under_earlier_names(cfg) -> dict:
    saved = json.loads(json.dumps(cfg.to_dict()))
    saved["model"]["sliding_window"] = saved["model"].pop("window_size")
    saved["model"]["remat_policy"] = saved["execution"].pop("remat_policy")
    return saved


def test_changed_fields_saved_under_earlier_names_are_reported(warnings):
    cfg = load_config("tiny").replace(model=dict(window_size=64), execution=dict(remat_policy="full"))
    saved = _saved_under_earlier_names(cfg)
    checkpoint._log_changed_settings(saved, cfg, "run")
    assert warnings() == []
    now = cfg.replace(model=dict(window_size=32), execution=dict(remat_policy="none"))
    checkpoint._log_changed_settings(saved, now, "run")
    (notice,) = warnings()
    assert "--model.window_size: 64 -> 32" in notice and "--execution.remat_policy: 'full' -> 'none'" in notice
    assert "window_size=64 (this run: 32)" in checkpoint._model_diff(saved, now)
