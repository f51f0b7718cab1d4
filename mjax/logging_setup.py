"""Console logging for mjax scripts: one plain timestamped line per message on stderr."""

import logging
import sys


def setup_logging(level=logging.INFO) -> None:
    from absl import logging as absl_logging  # noqa: PLC0415

    absl_logging.set_verbosity(absl_logging.WARNING)  # JAX's backend probing is noise on the console
    logger = logging.getLogger("mjax")
    if not any(getattr(h, "_mjax", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        handler._mjax = True
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
