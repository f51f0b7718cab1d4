"""What a run prints: small TFLOP/s and per-step memory on the step line, the FP8/FP4 recipe, a warning when the
compiled step will not fit, log lines never swallowed by the progress bar, and the GPU memory fraction default."""

import io
import logging
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from mjax import logging_setup, xla_flags
from mjax.config import PrecisionConfig
from mjax.logging_setup import setup_logging
from mjax.train import startup
from mjax.train.logger import MetricsLogger, Progress
from tests.helpers.train_utils import tiny_config

ROOT = str(Path(__file__).resolve().parents[2])

GIB = 2**30


@pytest.fixture
def mjax_records(caplog, monkeypatch):
    """caplog's records of the "mjax" logger, whether or not a script's setup_logging stopped its propagation."""
    monkeypatch.setattr(logging.getLogger("mjax"), "propagate", True)
    caplog.set_level(logging.INFO, logger="mjax")
    return lambda level=logging.INFO: [r.getMessage() for r in caplog.records
                                       if r.name.startswith("mjax") and r.levelno >= level]


def test_step_line_shows_small_tflops_and_memory(mjax_records):
    logger = MetricsLogger(tiny_config(), 0)
    logger.log({"step": 3, "loss": 2.5, "tflops_per_device": 0.0079, "peak_memory_bytes": 3 * GIB})
    logger.log({"step": 4, "loss": 2.4, "tflops_per_device": 412.37})
    logger.close()
    small, large = mjax_records()
    assert "tflops_per_device 0.0079" in small  # three significant digits, not "0.0"
    assert re.search(r"\| mem 3\.00 GiB", small)
    assert "tflops_per_device 412" in large and "mem" not in large  # no memory figure: none is printed


def test_precision_summary_names_the_recipe():
    assert "FP8" not in startup.precision_summary(PrecisionConfig())
    fp8 = startup.precision_summary(PrecisionConfig(fp8_recipe="tensorwise", fp8_format="hybrid"))
    assert "FP8 tensorwise (hybrid)" in fp8
    fp4 = startup.precision_summary(PrecisionConfig(fp4_recipe="nvfp4", fp4_hadamard=True, quantize_output_layer=True))
    assert "FP4 nvfp4 (hadamard)" in fp4 and "output layer quantized" in fp4


class _Compiled:
    """A stand-in for a compiled step: XLA's memory analysis of a step needing `args + temp` bytes."""

    def __init__(self, args: int, temp: int):
        self.analysis = types.SimpleNamespace(argument_size_in_bytes=args, output_size_in_bytes=args,
                                              alias_size_in_bytes=args, temp_size_in_bytes=temp)

    def memory_analysis(self):
        return self.analysis


def test_a_compiled_step_over_the_allocator_limit_warns(monkeypatch, mjax_records):
    monkeypatch.setattr(startup, "allocator_limit", lambda: (10 * GIB, "the test's limit"))
    startup.log_compiled_memory(_Compiled(args=6 * GIB, temp=3 * GIB))  # 9 GiB: fits
    assert mjax_records(logging.WARNING) == []
    startup.log_compiled_memory(_Compiled(args=6 * GIB, temp=5 * GIB))  # 11 GiB
    (warning,) = mjax_records(logging.WARNING)
    assert "11.00 GiB" in warning and "10.00 GiB" in warning and "the test's limit" in warning
    assert "--micro_batch_size" in warning


def test_allocator_limit_on_cpu_is_the_hosts_memory_per_device():
    limit, source = startup.allocator_limit()
    assert 0 < limit <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") and "host memory" in source


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_log_line_clears_the_bar_and_the_bar_is_redrawn_after_it(monkeypatch):
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setattr(logging_setup, "_status", None)  # restored even if the test fails with the bar shown
    logger = logging.getLogger("mjax")
    for name in ("handlers", "level", "propagate"):  # a console handler of its own, on the fake terminal
        monkeypatch.setattr(logger, name, [] if name == "handlers" else getattr(logger, name))
    setup_logging()
    progress = Progress(total=10, start=0, enabled=True)
    progress.update(3)
    logger.info("a log line")
    progress.close()
    logger.info("after the bar")
    out = term.getvalue()
    clear, bar = "\r\x1b[2K", r"\[#+\.+\] 3/10 eta +\d+s"
    # bar drawn; cleared; the line on a clean row; the bar drawn again below it; cleared at close
    assert re.fullmatch(rf"{re.escape(clear)}{bar}{re.escape(clear)}\d\d:\d\d:\d\d a log line\n"
                        rf"{re.escape(clear)}{bar}{re.escape(clear)}\d\d:\d\d:\d\d after the bar\n", out), repr(out)


def test_gpu_memory_fraction_default_never_overrides(monkeypatch):
    monkeypatch.delenv("MJAX_XLA_DEFAULTS", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    xla_flags.apply_defaults()
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.95"
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    xla_flags.apply_defaults()
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
    monkeypatch.setenv("MJAX_XLA_DEFAULTS", "0")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    xla_flags.apply_defaults()
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ


def test_the_train_entry_point_creates_no_backend_on_import():
    """mjax.cli.train applies the defaults in main(), after its imports: they must not have started a backend,
    which reads XLA_FLAGS and the memory fraction once."""
    code = "import mjax.cli.train; from jax._src import xla_bridge; print(len(xla_bridge._backends))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0 and out.stdout.strip() == "0", out.stderr[-2000:]
