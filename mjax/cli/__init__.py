"""Command-line entry points (`mjax-train`, `python -m mjax.cli.train`, ...): short absl programs."""
