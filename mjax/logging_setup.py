"""Console logging for mjax scripts: one plain timestamped line per message on stderr.

In a multi-process run only process 0 logs informational lines (as Megatron and MaxText); the others log their own
warnings and errors, prefixed with their process index. A status line (the progress bar) stays at the bottom: it is
cleared before each log line and redrawn after it.
"""

import logging
import sys

_status = None  # an object with clear() and draw(), or None


def set_status_line(status) -> None:
    global _status
    _status = status


class _ConsoleHandler(logging.StreamHandler):
    def emit(self, record):
        if _status is not None:
            _status.clear()
        super().emit(record)
        if _status is not None:
            _status.draw()


def setup_logging(level=logging.INFO) -> None:
    from absl import logging as absl_logging  # noqa: PLC0415

    absl_logging.set_verbosity(absl_logging.WARNING)  # JAX's backend probing is noise on the console
    logger = logging.getLogger("mjax")
    if not any(isinstance(h, _ConsoleHandler) for h in logger.handlers):
        handler = _ConsoleHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


def set_process(index: int, count: int) -> None:
    """After multi-process start-up: processes other than 0 keep only warnings and errors, marked with their index."""
    if count <= 1:
        return
    logger = logging.getLogger("mjax")
    for handler in logger.handlers:
        if isinstance(handler, _ConsoleHandler):
            handler.setFormatter(logging.Formatter(f"%(asctime)s [process {index}/{count}] %(message)s", "%H:%M:%S"))
    if index != 0:
        logger.setLevel(max(logger.level, logging.WARNING))
