"""``python -m kvstore``: the same command line as ``kvstore``."""

from kvstore.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
