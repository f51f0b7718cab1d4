"""Generate text; the same program as `mjax-generate` (see mjax/cli/generate.py for its flags and exit codes)."""

from mjax.cli.generate import entry

if __name__ == "__main__":
    entry()
