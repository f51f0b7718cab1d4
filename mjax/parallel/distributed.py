"""Multi-process start-up: `jax.distributed.initialize` from explicit flags or a detected cluster, before any JAX op.

Each process then feeds only its share of the global batch (mjax.data gives it `process_index/process_count`).
"""

import logging
import os

import jax

from mjax.config import ConfigError

log = logging.getLogger("mjax")

CLUSTER_ENV = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "JAX_COORDINATOR_ADDRESS")


def initialize(parallel_cfg) -> None:
    """Explicit --coordinator_address/--num_processes/--process_id win; else a multi-task SLURM/Open MPI job (or
    JAX_COORDINATOR_ADDRESS) is auto-detected by JAX; else this is a single-process run."""
    p = parallel_cfg
    explicit = (p.coordinator_address, p.num_processes, p.process_id)
    if any(x is not None for x in explicit):
        if any(x is None for x in explicit):
            raise ConfigError("multi-process runs need all of --coordinator_address, --num_processes and "
                              "--process_id (or none of them, to auto-detect SLURM/Open MPI)")
        if not 0 <= p.process_id < p.num_processes:
            raise ConfigError(f"--process_id={p.process_id} must be in 0..{p.num_processes - 1}")
        jax.distributed.initialize(p.coordinator_address, num_processes=p.num_processes, process_id=p.process_id)
    elif _multi_task_job():
        jax.distributed.initialize()
    else:
        return
    log.info("process %d of %d; %d local / %d global devices", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())


def _multi_task_job() -> bool:
    for name in CLUSTER_ENV:
        value = os.environ.get(name)
        if value and (name == "JAX_COORDINATOR_ADDRESS" or int(value) > 1):
            return True
    return False
