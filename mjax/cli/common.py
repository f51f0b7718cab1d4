"""What every mjax command shares: Megatron spellings accepted, one-line errors, and one table of exit codes.

| code | meaning                                                                                  |
|------|------------------------------------------------------------------------------------------|
| 0    | done (also: stopped cleanly on SIGTERM/SIGINT, or nothing left to train)                 |
| 1    | an unexpected error inside mjax (a bug: the traceback is printed)                        |
| 2    | bad input: an unknown flag or value, a config error, a missing or unusable data,         |
|      | tokenizer or input file                                                                  |
| 3    | training stopped on a NaN/Inf loss or gradient norm (--on_nonfinite=stop)                |
| 4    | an unusable checkpoint or conversion source (missing, unreadable, another model)         |
| 5    | multi-process start-up failed: not every process connected in --distributed_timeout_s    |
| 130  | interrupted twice (SIGINT during the clean stop)                                         |
"""

import difflib
import logging
import sys

from absl import app, flags

from mjax.config.base import ConfigError
from mjax.config.megatron import IMPLIED, translate

FLAGS = flags.FLAGS
log = logging.getLogger("mjax")
BAD_INPUT, NONFINITE, CHECKPOINT = 2, 3, 4


def _is_bool(name: str) -> bool:
    return name in FLAGS and isinstance(FLAGS[name], flags.BooleanFlag)


def parse_flags(argv: list[str]) -> list[str]:
    """absl parsing of argv after the Megatron translation; a bad flag is one line and exit code 2."""
    argv, implied = translate(argv, lambda n: n in FLAGS, _is_bool)
    try:
        rest = FLAGS(argv)
    except flags.Error as e:
        name = str(e).split("'")[1] if "'" in str(e) else ""
        close = difflib.get_close_matches(name.replace("-", "_"), list(FLAGS), n=3, cutoff=0.6)
        hint = f" (did you mean {', '.join('--' + c for c in close)}?)" if close and "Did you mean" not in str(e) else ""
        sys.stderr.write(f"{argv[0]}: {e}{hint}; --helpfull lists every flag\n")
        sys.exit(BAD_INPUT)
    for switch in implied:  # e.g. Megatron's --group-query-attention, which --num_query_groups implies here
        if not any(FLAGS[name].present for name in IMPLIED[switch]):
            sys.stderr.write(f"{argv[0]}: --{switch.replace('_', '-')} needs --{IMPLIED[switch][0]} (mjax infers the "
                             "former from the latter)\n")
            sys.exit(BAD_INPUT)
    return rest


def run(main) -> None:
    """app.run with mjax's flag parsing; `main(argv) -> exit code`."""
    as_main(main.__module__)
    app.run(main, flags_parser=parse_flags)


def as_main(program: str) -> None:
    """`--help` of scripts/<name>.py or a console script shows `program`'s docstring and flags, as `python -m
    program` does: absl prints __main__'s docstring and the flags that sys.argv[0] defines."""
    if program == "__main__":
        return
    sys.modules["__main__"].__doc__ = sys.modules[program].__doc__
    for flag in FLAGS.get_key_flags_for_module(program):
        FLAGS.register_key_flag_for_module(sys.argv[0], flag)


def fail(kind: str, error: BaseException, code: int) -> int:
    """Logs `error` as one line and returns `code` (for `return fail(...)` in a main)."""
    log.error("%s: %s", kind, error)
    return code


def no_positional(argv: list[str]) -> None:
    if len(argv) > 1:
        raise ConfigError(f"unexpected arguments: {' '.join(argv[1:])} (flags are written --name=value)")
