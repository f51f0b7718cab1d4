"""mjax's GPU XLA defaults: added when absent, never overriding a flag the user set, all off on request."""

import os

import pytest

from mjax import xla_flags
from mjax.config.execution import ExecutionConfig


def _flags(value: str) -> dict:
    return dict(f.split("=", 1) for f in value.split())


def test_defaults_fill_in_without_overriding(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/x")
    monkeypatch.delenv("MJAX_XLA_DEFAULTS", raising=False)
    xla_flags.apply_defaults()
    flags = _flags(os.environ["XLA_FLAGS"])
    assert flags["--xla_gpu_enable_triton_gemm"] == "true"  # the user's value wins
    assert flags["--xla_dump_to"] == "/tmp/x"
    assert flags["--xla_gpu_enable_latency_hiding_scheduler"] == "true"
    assert len(flags) == len(xla_flags.GPU_DEFAULTS) + 1  # each flag once


def test_defaults_set_triton_gemm_off(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("MJAX_XLA_DEFAULTS", raising=False)
    xla_flags.apply_defaults()
    assert _flags(os.environ["XLA_FLAGS"])["--xla_gpu_enable_triton_gemm"] == "false"


def test_defaults_off(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    monkeypatch.setenv("MJAX_XLA_DEFAULTS", "0")
    xla_flags.apply_defaults()
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"


@pytest.mark.parametrize("mode, xla_flags_value, want", [
    (True, "", True),
    (False, "", False),
    (False, "--xla_gpu_deterministic_ops=true", True),
    (False, "--xla_dump_to=/tmp/x --xla_gpu_exclude_nondeterministic_ops", True),  # a bare bool flag is true
    (False, "--xla_gpu_exclude_nondeterministic_ops=1", True),
    (False, "--xla_gpu_deterministic_ops=false", False),
    (False, "--xla_gpu_deterministic_ops_other=true", False),
])
def test_a_run_is_deterministic_by_the_flag_or_by_xla_flags(monkeypatch, mode, xla_flags_value, want):
    monkeypatch.setenv("XLA_FLAGS", xla_flags_value)
    assert xla_flags.deterministic_run(ExecutionConfig(deterministic_mode=mode)) is want
