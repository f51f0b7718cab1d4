"""Convert checkpoints; the same program as `mjax-convert` (see mjax/cli/convert.py for its flags and exit codes)."""

from mjax.cli.convert import entry

if __name__ == "__main__":
    entry()
