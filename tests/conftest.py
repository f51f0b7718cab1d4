import os

# 8 fake CPU devices for every test process, set before JAX initialises its backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
# On CPU the tests' programs are tiny and run a few times each, so XLA's LLVM optimisation costs more than it saves
# (most of the suite is compile time). Not on a GPU, whose kernels the gpu tests time. A flag the
# caller sets in XLA_FLAGS comes later and wins.
fast_compile = ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                "--xla_cpu_opt_preset=FAST_COMPILE", "--xla_cpu_emitter_verification_level=0"]
# Collectives of 8 fake devices on 2 loaded cores can wait long for a starved device thread: XLA aborts the process
# after 40 s in a rendezvous by default; wait ten minutes (a real deadlock still fails the test run).
collective_timeouts = ["--xla_cpu_collective_call_terminate_timeout_seconds=600",
                       "--xla_cpu_collective_timeout_seconds=600"]
os.environ["XLA_FLAGS"] = " ".join([*(fast_compile if os.environ["JAX_PLATFORMS"] == "cpu" else []),
                                    os.environ.get("XLA_FLAGS", ""), *collective_timeouts]).strip()
# GPU tests in several pytest-xdist processes (`-n N`: the GPU checks compile in parallel) share one GPU: each
# process takes its share of the memory instead of JAX's default 75%.
if os.environ["JAX_PLATFORMS"] != "cpu" and "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION",
                          f"{0.9 / int(os.environ['PYTEST_XDIST_WORKER_COUNT']):.3f}")
# No suite-wide persistent compilation cache: on XLA:CPU (jax 0.12) an executable of the fused cross-entropy step
# reloaded from the cache aborts the process (compiled fresh it runs), so a shared cache makes runs flaky.

from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

GPU_TIER = Path(__file__).resolve().parent / "gpu"


def _misplaced(item) -> bool:
    """A gpu-marked test outside tests/gpu: the GPU tier is one folder, so that `-m gpu tests/gpu` finds them all."""
    return item.get_closest_marker("gpu") is not None and GPU_TIER not in Path(item.path).resolve().parents


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if item.get_closest_marker("gpu") and not _misplaced(item):
            item.add_marker(skip)


def pytest_runtest_setup(item):
    if _misplaced(item):  # fails on every machine, not skipped on CPU
        pytest.fail(f"{item.nodeid} is marked gpu: move it to tests/gpu", pytrace=False)


@pytest.fixture(autouse=True)
def _single_device_traces():
    """Tests trace models directly, on one device, on purpose (library code raises for a trace without rules:
    mjax.sharding.constrain); tests of sharded layouts set their own rules inside, which take precedence."""
    from mjax.sharding import single_device  # noqa: PLC0415

    with single_device():
        yield
