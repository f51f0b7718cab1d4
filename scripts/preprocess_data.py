"""Tokenize JSONL into .bin/.idx; the same program as `mjax-preprocess` (see mjax/cli/preprocess.py for its flags)."""

from mjax.cli.preprocess import entry

if __name__ == "__main__":
    entry()
