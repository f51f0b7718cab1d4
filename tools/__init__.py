"""Makers of mjax's test fixtures, bundled assets and corpora: tooling the library never imports.

Run from the repository root: `python -m tools.<name>`.
"""
