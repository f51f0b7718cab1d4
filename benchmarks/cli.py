"""How a benchmark starts and fails on bad input: absl flags, no positional arguments, and a mistake in a flag as one
line on stderr with exit code 2 (the README's "Exit codes", as the mjax programs), never a usage dump."""

import sys
from pathlib import Path

from absl import app

from mjax.config import ConfigError

BAD_INPUT = 2


class BadInput(ValueError):
    """A flag value or argument the benchmark cannot take; the message names it."""


def run_main(main) -> None:
    """app.run for `main() -> exit code (or None)`."""
    def wrapped(argv):
        try:
            if len(argv) > 1:
                raise BadInput(f"unexpected arguments: {' '.join(argv[1:])} (flags are written --name=value)")
            return main()
        except (BadInput, ConfigError) as e:
            sys.stderr.write(f"{Path(argv[0]).stem}: {e}\n")
            return BAD_INPUT

    app.run(wrapped)
