"""``kvstore.serve``: kept as an import path (``python -m kvstore.serve``); the server lives in
:mod:`kvstore.server.main`."""

import sys

from .server.main import exit_now, parse_size, serve_main

__all__ = ["serve_main", "parse_size"]

if __name__ == "__main__":
    exit_now(serve_main(sys.argv[1:]))
