"""Optimizer benchmark: a tiny byte-level GPT trained on the Python stdlib's source.

Run ``python -m opttx.bench --help``, or call :func:`main` with a list of flags.
"""

from .cli import main

__all__ = ["main"]
