"""The command line (``kvstore``, the console script ``kvstore.cli:main``)."""

from .main import cli, main

__all__ = ["cli", "main"]
