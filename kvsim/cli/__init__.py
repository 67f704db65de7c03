"""The `kvsim` command line; building and running live elsewhere, this writes what they return.

Exports: main (app.py: run, memory); cost.py: cost, calibrate; args.py: argument parsers both use.
"""
from kvsim.cli.app import main

__all__ = ["main"]
