"""Train a model; the same program as `mjax-train` (see mjax/cli/train.py for its flags and exit codes)."""

from mjax.cli.train import entry

if __name__ == "__main__":
    entry()
