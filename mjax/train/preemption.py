"""Stop requests: SIGTERM / SIGINT set a flag that the training loop reads at the next step boundary.

Single process: Python handlers. Several processes must stop at the *same* step, so SIGTERM is left to JAX's
preemption service (installed by `jax.distributed.initialize`; it agrees on a step across processes) and SIGINT is
forwarded to it as a SIGTERM. A second SIGINT raises KeyboardInterrupt at once.
"""

import logging
import os
import signal
import threading

import jax

log = logging.getLogger("mjax")


def _sync_manager():
    from jax._src import distributed  # noqa: PLC0415  (the preemption service has no public handle)

    return distributed.global_state.preemption_sync_manager


class StopSignals:
    """Context manager; `requested(step)` is True at the step where the loop should save and stop."""

    def __init__(self):
        self.signum = None
        self._previous = {}
        self._multi = jax.process_count() > 1

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is not threading.main_thread():
            log.warning("training outside the main thread: SIGTERM/SIGINT will not save a checkpoint")
            return self
        if self._multi and _sync_manager() is None:
            log.warning("multi-process run without JAX's preemption service (jax_enable_preemption_service): "
                        "SIGTERM/SIGINT will not save a checkpoint")
            return self
        for s in (signal.SIGINT,) if self._multi else (signal.SIGTERM, signal.SIGINT):
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        log.warning("received %s: saving a checkpoint and stopping after the current step (SIGINT again to abort)",
                    signal.Signals(signum).name)
        if self._multi:
            os.kill(os.getpid(), signal.SIGTERM)  # to JAX's preemption notifier, which tells every process

    def requested(self, step: int) -> bool:
        if self._multi:
            from jax.experimental import multihost_utils  # noqa: PLC0415

            return _sync_manager() is not None and multihost_utils.reached_preemption_sync_point(step)
        return self.signum is not None
