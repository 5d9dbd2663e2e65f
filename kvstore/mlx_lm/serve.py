"""``kvstore serve``: mlx-lm's HTTP server with the persistent prompt cache.

mlx-lm's ``server.run`` builds its prompt cache as
``LRUPromptCache(cli_args.prompt_cache_size)`` from the module's global name;
`serve_main` swaps that one name for a factory of `PersistentPromptCache` for
the duration of the call and runs mlx-lm's own ``main`` with the remaining
arguments, so every mlx-lm option keeps its meaning.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from kvstore import Store, default_root
from kvstore.mlx_lm import PersistentPromptCache

__all__ = ["serve_main", "parse_size"]

logger = logging.getLogger("kvstore.serve")

def parse_size(text: str) -> int:
    """``--max-bytes`` and friends: the CLI's size syntax (``10G``, ``500MiB``, plain bytes)."""
    from ..cli.render import SizeError
    from ..cli.render import parse_size as parse

    try:
        return parse(text)
    except SizeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvstore serve",
        add_help=False,
        description="mlx-lm's HTTP server with a persistent, shared prompt cache. "
        "Options not listed here are mlx_lm.server's (see below).",
    )
    g = p.add_argument_group("kvstore options")
    g.add_argument(
        "--root",
        type=Path,
        default=None,
        help="cache root (default: $KVSTORE_ROOT or the user cache dir)",
    )
    g.add_argument(
        "--max-bytes",
        type=parse_size,
        default=None,
        help="disk budget of the root; least recently used entries are evicted "
        "above it after each save",
    )
    g.add_argument(
        "--min-tokens",
        type=int,
        default=256,
        help="do not persist prompts shorter than this (default: 256)",
    )
    g.add_argument(
        "--queue-bytes",
        type=parse_size,
        default=1 << 30,
        help="cap on snapshots waiting to be written (default: 1G)",
    )
    g.add_argument("--namespace", default="default", help="store namespace (default: default)")
    g.add_argument(
        "--no-durable", action="store_true", help="skip fsync on writes (faster, not crash-safe)"
    )
    g.add_argument(
        "--no-reuse-prefix",
        action="store_true",
        help="hash every block of every save instead of referencing the blocks a stored "
        "entry holds for the same leading tokens",
    )
    return p


@contextlib.contextmanager
def _swapped(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt so mlx-lm shuts down and the queue drains."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def serve_main(argv: list[str]) -> int:
    """Run mlx-lm's server with `PersistentPromptCache`; return the exit code."""
    import mlx_lm.server as server

    ours, rest = _parser().parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        _parser().print_help()
        print()
        try:
            with _swapped(sys, "argv", ["kvstore serve", *rest]):
                server.main()  # type: ignore[no-untyped-call]
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 0
        return 0
    root = ours.root if ours.root is not None else default_root()
    made: list[PersistentPromptCache] = []
    code: int = 0
    with Store.open(root, durable=not ours.no_durable, max_bytes=ours.max_bytes) as store:

        def factory(max_size: int = 10, max_bytes: int = 1 << 63) -> PersistentPromptCache:
            cache = PersistentPromptCache(
                store,
                max_size=max_size,
                max_bytes=max_bytes,
                min_tokens=ours.min_tokens,
                queue_bytes=ours.queue_bytes,
                ns=ours.namespace,
                reuse_prefix=not ours.no_reuse_prefix,
            )
            made.append(cache)
            return cache

        try:
            with (
                _swapped(server, "LRUPromptCache", factory),
                _swapped(sys, "argv", ["kvstore serve", *rest]),
                _sigterm_interrupts(),
            ):
                server.main()  # type: ignore[no-untyped-call]
        except SystemExit as e:  # argparse's --help and usage errors
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
        except KeyboardInterrupt:
            pass
        finally:
            for cache in made:
                if not cache.close(timeout=None):
                    logger.warning("kvstore: %d snapshots were not written", cache.pending)
                logger.info("kvstore: %s", cache.persist_stats())
    return code


def exit_now(code: int) -> None:
    """Exit without interpreter teardown, once everything is written and closed.

    mlx-lm's server (also run on its own) can abort in teardown after a clean
    shutdown ("terminate called without an active exception", SIGABRT); our
    queue is drained and the store closed before this point, so skip teardown.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(serve_main(sys.argv[1:]))
