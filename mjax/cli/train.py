"""Train a model: `mjax-train --config=<preset or file> [--section.field=value ...]` (or scripts/train.py).

With no data flags it trains the tiny preset on the sample corpus bundled with mjax. Megatron's flag names work
(`--tensor-model-parallel-size 2`, `--num-layers 4`, `--recompute-activations`, ...) as well as mjax's short ones
(`--train_iters --lr --global_batch_size --micro_batch_size --seq_length --tp --fsdp --mock_data --fp16 ...`);
`--helpfull` lists every flag.

Checkpoints: `--save DIR --save_interval N [--keep N]`, `--load DIR [--ckpt_step N] [--load_params_only]`. A rerun
with the same `--save` resumes from its latest step. SIGTERM/SIGINT save a checkpoint at the next step boundary and
exit 0. Exit codes: mjax/cli/common.py (2 bad input, 3 NaN/Inf loss, 4 unusable checkpoint, 5 distributed start-up).
"""

import json
import logging

from absl import flags

from mjax.storage.steps import CheckpointError
from mjax.cli.common import BAD_INPUT, CHECKPOINT, NONFINITE, fail, no_positional, run
from mjax.config import ConfigError
from mjax.config.flags import config_from_flags, define_config_flags
from mjax.data import DataError
from mjax.logging_setup import setup_logging
from mjax.parallel.distributed import initialize
from mjax.train.loop import NonFiniteError, train
from mjax.xla_flags import apply_defaults

define_config_flags()
flags.DEFINE_boolean("print_config", False, "Print the resolved config as JSON and exit.")
FLAGS = flags.FLAGS
log = logging.getLogger("mjax")


def main(argv) -> int:
    setup_logging()
    try:
        no_positional(argv)
        cfg = config_from_flags()
        if FLAGS.print_config:
            print(json.dumps(cfg.to_dict(), indent=2))
            return 0
        apply_defaults()  # XLA flags and the GPU memory fraction, before JAX creates a backend
        initialize(cfg.parallel)
        train(cfg)  # validates the config against the devices before anything is compiled
    except (ConfigError, DataError, FileNotFoundError) as e:
        return fail("configuration error" if isinstance(e, ConfigError) else "data error", e, BAD_INPUT)
    except NonFiniteError as e:
        return fail("stopped", e, NONFINITE)
    except CheckpointError as e:
        return fail("checkpoint error", e, CHECKPOINT)
    return 0


def entry() -> None:
    run(main)


if __name__ == "__main__":
    entry()
