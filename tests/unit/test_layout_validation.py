"""Config and layout validation (no JAX): flags that used to be ignored are errors or one notice, --vpp alone picks
the interleaved 1F1B schedule, and --pp with an unset micro-batch picks one that gives every stage work."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mjax.config import ConfigError, load_config
from mjax.config.validate import pipeline_schedule
from mjax.parallel.layout import describe_batching, resolve_batch, validate_layout

ROOT = Path(__file__).resolve().parents[2]
TINY = load_config("tiny")  # 4 layers: pp x vpp up to 4


@pytest.fixture
def mjax_warnings(caplog, monkeypatch):
    """caplog's records of the "mjax" logger, whether or not a script's setup_logging stopped its propagation."""
    monkeypatch.setattr(logging.getLogger("mjax"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="mjax")
    return lambda: [r for r in caplog.records if r.name.startswith("mjax") and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("keep", [0, -1])
def test_keep_below_one_is_an_error_naming_keep(keep):
    with pytest.raises(ConfigError, match=f"--keep={keep}"):
        validate_layout(TINY.replace(checkpoint=dict(save="/nonexistent/run", keep=keep)), 1)


def test_keep_of_one_and_unset_are_valid():
    for keep in (1, None):
        validate_layout(TINY.replace(checkpoint=dict(save="/nonexistent/run", keep=keep)), 1)


def test_save_interval_without_save_is_an_error():
    with pytest.raises(ConfigError, match=r"--save_interval=5 needs --save"):
        validate_layout(TINY.replace(checkpoint=dict(save_interval=5)), 1)
    validate_layout(TINY.replace(checkpoint=dict(save_interval=5, save="/nonexistent/run")), 1)


def test_context_parallelism_takes_devices_from_data_parallelism():
    batching = validate_layout(TINY.replace(parallel=dict(cp=2)), 8)
    assert batching.shards == 4
    with pytest.raises(ConfigError, match=r"cannot be split"):
        validate_layout(TINY.replace(parallel=dict(cp=3), train=dict(seq_length=96)), 8)


def test_sequence_parallel_without_tp_logs_one_warning(mjax_warnings):
    validate_layout(TINY.replace(parallel=dict(sequence_parallel=True)), 1)
    warnings = mjax_warnings()
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "--sequence_parallel" in warnings[0].getMessage() and "--tp=1" in warnings[0].getMessage()


def test_sequence_parallel_with_tp_gives_no_warning(mjax_warnings):
    validate_layout(TINY.replace(parallel=dict(tp=2, sequence_parallel=True)), 2)
    assert mjax_warnings() == []


def test_vpp_alone_selects_the_interleaved_1f1b_schedule():
    cfg = TINY.replace(parallel=dict(pp=2, vpp=2))
    assert cfg.parallel.pipeline_schedule is None
    validate_layout(cfg, 2)
    assert pipeline_schedule(cfg.parallel) == "interleaved_1f1b"  # Megatron's interleaved schedule
    assert pipeline_schedule(TINY.replace(parallel=dict(pp=2)).parallel) == "1f1b"  # Megatron's default without vpp
    with pytest.raises(ConfigError, match="--vpp=2 needs an interleaved schedule"):
        validate_layout(TINY.replace(parallel=dict(pp=2, vpp=2, pipeline_schedule="gpipe")), 2)


# (devices, --pp, --global_batch_size) -> the micro-batch a person picks by hand: the largest divisor m of the
# per-shard batch B with B / m >= pp (every stage gets a micro-batch); B itself has none smaller than pp.
PICKED = [
    (4, 4, 16, 4),  # B=16: 16/4 = 4 micro-batches
    (4, 4, 24, 6),  # B=24: 6 -> 4; 8 would give 3
    (4, 4, 12, 3),
    (4, 4, 40, 10),
    (4, 4, 18, 3),  # B=18: divisors 1 2 3 6 9 18; 6 gives 3 < 4, so 3 (6 micro-batches)
    (4, 4, 7, 1),  # a prime batch: micro-batches of 1
    (8, 4, 16, 2),  # dp=2: B=8 per shard -> 2 (4 micro-batches)
    (2, 2, 16, 8),
]


@pytest.mark.parametrize("devices, pp, batch, micro", PICKED)
def test_pipeline_picks_the_largest_micro_batch_that_feeds_every_stage(devices, pp, batch, micro):
    cfg = TINY.replace(parallel=dict(pp=pp), train=dict(global_batch_size=batch))
    batching = validate_layout(cfg, devices)  # an unset micro-batch with --pp is valid, not "stages would idle"
    assert batching == resolve_batch(cfg, devices)
    per_shard = batch // (devices // pp)
    assert (batching.micro_batch_size, batching.micro_batches, batching.chosen) == (micro, per_shard // micro, True)
    line = describe_batching(cfg, batching)
    assert "--micro_batch_size unset" in line and f"--pp={pp}" in line
    assert f"{per_shard // micro} micro-batches" in line and f"micro-batch {micro}" in line


def test_an_explicit_micro_batch_or_no_pipeline_is_not_replaced():
    explicit = resolve_batch(TINY.replace(parallel=dict(pp=2), train=dict(global_batch_size=16, micro_batch_size=2)), 2)
    assert (explicit.micro_batch_size, explicit.micro_batches, explicit.chosen) == (2, 8, False)
    plain = resolve_batch(TINY.replace(train=dict(global_batch_size=16)), 4)  # no pipeline: no accumulation
    assert (plain.micro_batch_size, plain.micro_batches, plain.chosen) == (4, 1, False)
    assert "unset" not in describe_batching(TINY, plain)


def test_validation_imports_no_jax():
    code = ("import sys; from mjax.parallel.layout import validate_layout; from mjax.config import load_config; "
            "validate_layout(load_config('llama3.2-1b'), 8); print(sorted(m for m in sys.modules if m == 'jax'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
