"""``kvstore.serve``: kept as an import path; the server lives in :mod:`kvstore.mlx_lm.serve`."""

import sys

from .mlx_lm.serve import exit_now, parse_size, serve_main

__all__ = ["serve_main", "parse_size"]

if __name__ == "__main__":
    exit_now(serve_main(sys.argv[1:]))
