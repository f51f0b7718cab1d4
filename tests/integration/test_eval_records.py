"""Evaluations of a blend: valid, each dataset's valid every --eval_interval, the test split at the end; each in the
metrics file and in TensorBoard. --eval_interval=0 evaluates nothing."""

import json

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mjax.data import IndexedDatasetWriter
from mjax.train.loop import train
from tests.helpers.train_utils import tiny_config

# Training runs and compiled steps: the full suite (make test-all) only, not make test.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("compilation_cache")]  # the runs compile the same step again

SPLITS = ["valid", "valid/a", "valid/b", "test", "test/a", "test/b"]


def _blend(directory):
    """Datasets a and b (ids within the sample tokenizer's 1024), blended half and half; 80/10/10 split."""
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        with IndexedDatasetWriter(directory / name, np.uint16) as w:
            for _ in range(40):
                w.add_document(rng.integers(1, 1024, 100))
    return dict(data_path=("0.5", str(directory / "a"), "0.5", str(directory / "b")), split="80,10,10")


def _run(tmp_path, eval_interval):
    cfg = tiny_config(model=dict(vocab_size=1024), data=_blend(tmp_path),
                      train=dict(train_iters=4, eval_interval=eval_interval, eval_iters=1),
                      logging=dict(metrics_file=str(tmp_path / "metrics.jsonl"), tensorboard_dir=str(tmp_path / "tb")))
    result = train(cfg)  # the real data path: build_data_iterators from --data_path
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    return result, records, events


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("eval"), eval_interval=2)


def test_each_split_is_evaluated_when_megatron_does(evaluated):
    result, records, _ = evaluated
    evals = [(r["step"], r["split"]) for r in records if "split" in r]
    assert evals == [(2, s) for s in SPLITS[:3]] + [(4, s) for s in SPLITS[:3]] + [(4, s) for s in SPLITS[3:]]
    assert [(r["step"], r["split"]) for r in result.eval_history] == evals
    assert [r["step"] for r in records if "split" not in r] == [1, 2, 3, 4]  # the training steps, each once


def test_eval_records_hold_loss_and_perplexity(evaluated):
    _, records, _ = evaluated
    for r in (r for r in records if "split" in r):
        assert 0 < r["eval_loss"] < 2 * np.log(1024), r  # near ln(vocab) for an untrained model, finite
        np.testing.assert_allclose(r["eval_ppl"], np.exp(r["eval_loss"]), rtol=1e-12)
    valid = {r["step"]: r["eval_loss"] for r in records if r.get("split") == "valid"}
    assert valid[2] != valid[4]  # the same batches, scored by the weights of each step


def test_tensorboard_holds_each_splits_loss_and_perplexity(evaluated):
    _, records, events = evaluated
    tags = set(events.Tags()["scalars"])
    for split in SPLITS:
        assert {f"{split}/lm_loss", f"{split}/lm_ppl"} <= tags, sorted(tags)
    by_step = {(r["step"], r["split"]): r["eval_loss"] for r in records if "split" in r}
    for split in SPLITS:
        for e in events.Scalars(f"{split}/lm_loss"):
            np.testing.assert_allclose(e.value, by_step[(e.step, split)], rtol=1e-6)  # float32 in the event file


def test_eval_interval_zero_evaluates_nothing(tmp_path):
    result, records, events = _run(tmp_path, eval_interval=0)
    assert result.eval_history == [] and not any("split" in r for r in records)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert not any(t.endswith(("lm_loss", "lm_ppl")) for t in events.Tags()["scalars"])
