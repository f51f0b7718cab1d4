"""Train a model: `python scripts/train.py --config=<preset or file> [--section.field=value ...]`.

With no data flags it trains the tiny preset on the sample corpus bundled with mjax. Megatron-style aliases work
(`--train_iters --lr --global_batch_size --micro_batch_size --seq_length --tp --fsdp --mock_data --fp16 ...`);
`--helpfull` lists every flag.

Checkpoints: `--save DIR --save_interval N [--keep N]`, `--load DIR [--ckpt_step N] [--load_params_only]`. A rerun
with the same `--save` resumes from its latest step. SIGTERM/SIGINT save a checkpoint at the next step boundary and
exit 0. Exit codes: 2 configuration error, 3 NaN/Inf loss, 4 unusable checkpoint.
"""

import json
import logging
import sys

from absl import app, flags

from mjax.config import ConfigError
from mjax.config_flags import config_from_flags, define_config_flags
from mjax.logging_setup import setup_logging
from mjax.xla_flags import apply_defaults

apply_defaults()  # before JAX initialises a backend

define_config_flags()
flags.DEFINE_boolean("print_config", False, "Print the resolved config as JSON and exit.")
FLAGS = flags.FLAGS
log = logging.getLogger("mjax")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    setup_logging()
    try:
        cfg = config_from_flags()
        if FLAGS.print_config:
            print(json.dumps(cfg.to_dict(), indent=2))
            return 0
        from mjax.checkpoint import CheckpointError  # noqa: PLC0415
        from mjax.train.loop import NonFiniteError, train  # noqa: PLC0415  (imports jax after flag parsing)

        import jax  # noqa: PLC0415

        from mjax.parallel.distributed import initialize  # noqa: PLC0415

        initialize(cfg.parallel)
        cfg.validate(jax.device_count())
        train(cfg)
    except ConfigError as e:
        log.error("configuration error: %s", e)
        return 2
    except NonFiniteError as e:
        log.error("stopped: %s", e)
        return 3
    except CheckpointError as e:
        log.error("checkpoint error: %s", e)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(app.run(main))
