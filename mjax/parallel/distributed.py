"""Multi-process start-up: `jax.distributed.initialize` from explicit flags, environment variables or a detected
cluster, before any JAX op. Each process then feeds only its share of the global batch.

Where the coordinates come from, first match wins:
  --coordinator_address --num_processes --process_id          explicit flags
  JAX_COORDINATOR_ADDRESS JAX_NUM_PROCESSES JAX_PROCESS_ID     environment (all three)
  a multi-task SLURM or Open MPI job                          detected by JAX
A peer that does not connect within --distributed_timeout_s ends the run with one line (DistributedStartupError)
instead of the runtime's abort (exit code 5).
"""

import logging
import os
import sys
import threading

import jax

from mjax.config import ConfigError
from mjax.logging_setup import set_process

log = logging.getLogger("mjax")

CLUSTER_ENV = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
EXIT_CODE = 5  # mjax-train's exit code when the processes cannot all connect


def coordinates(p) -> tuple[str, int, int] | None:
    """(coordinator address, number of processes, this process's id) from the flags or the environment, or None
    (single process, or a SLURM / Open MPI job that JAX detects itself)."""
    explicit = (p.coordinator_address, p.num_processes, p.process_id)
    if any(x is not None for x in explicit):
        if any(x is None for x in explicit):
            raise ConfigError("multi-process runs need all of --coordinator_address, --num_processes and "
                              "--process_id (or none of them, to auto-detect SLURM/Open MPI)")
        address, count, index = explicit
    elif os.environ.get(ENV[0]):
        missing = [name for name in ENV if not os.environ.get(name)]
        if missing:
            raise ConfigError(f"{ENV[0]} is set, so this is a multi-process run: also set {' and '.join(missing)} "
                              "(or pass --coordinator_address, --num_processes and --process_id)")
        try:
            address, count, index = os.environ[ENV[0]], int(os.environ[ENV[1]]), int(os.environ[ENV[2]])
        except ValueError:
            raise ConfigError(f"{ENV[1]}={os.environ[ENV[1]]!r} and {ENV[2]}={os.environ[ENV[2]]!r} must be "
                              "integers") from None
    else:
        return None
    if not 0 <= index < count:
        raise ConfigError(f"the process id {index} must be in 0..{count - 1} (--process_id / {ENV[2]})")
    return address, count, index


def initialize(parallel_cfg) -> None:
    """Connects this process to the others (no-op for a single-process run)."""
    p = parallel_cfg
    found = coordinates(p)
    if found is not None:
        address, count, index = found
        log.info("process %d: waiting for %d processes at %s (up to --distributed_timeout_s=%d)", index, count,
                 address, p.distributed_timeout_s)
        with _deadline(p.distributed_timeout_s, f"{count} processes did not all connect to {address} within "
                                                f"--distributed_timeout_s={p.distributed_timeout_s}"):
            jax.distributed.initialize(address, num_processes=count, process_id=index,
                                       initialization_timeout=p.distributed_timeout_s + 60,
                                       cluster_detection_method="deactivate")
    elif _multi_task_job():
        with _deadline(p.distributed_timeout_s, "the cluster's processes did not all connect within "
                                                f"--distributed_timeout_s={p.distributed_timeout_s}"):
            jax.distributed.initialize(initialization_timeout=p.distributed_timeout_s + 60)
    else:
        return
    set_process(jax.process_index(), jax.process_count())
    log.info("process %d of %d; %d local / %d global devices", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())


class _deadline:
    """Ends the process with one line and EXIT_CODE if the block has not finished after `seconds`: the runtime's own
    timeout aborts the process (a C++ check failure, exit 134) after a screen of stack trace."""

    def __init__(self, seconds: float, message: str):
        self.seconds, self.message, self.done = seconds, message, threading.Event()

    def _watch(self):
        if not self.done.wait(self.seconds):
            log.error("distributed start-up failed: %s; check that every process was started with the same "
                      "coordinator address and process count", self.message)
            sys.stderr.flush()
            os._exit(EXIT_CODE)

    def __enter__(self):
        threading.Thread(target=self._watch, name="mjax-distributed-deadline", daemon=True).start()

    def __exit__(self, *exc):
        self.done.set()


def _multi_task_job() -> bool:
    for name in CLUSTER_ENV:
        value = os.environ.get(name)
        if value and int(value) > 1:
            return True
    return False
