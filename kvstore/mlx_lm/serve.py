"""``kvstore serve``: mlx-lm's HTTP server with the persistent prompt cache.

mlx-lm's ``server.run`` builds its prompt cache as
``LRUPromptCache(cli_args.prompt_cache_size)`` from the module's global name;
`serve_main` swaps that one name for a factory of `PersistentPromptCache` for
the duration of the call and runs mlx-lm's own ``main`` with the remaining
arguments, so every mlx-lm option keeps its meaning.

Before anything is opened or bound, `serve_main` checks its own options and that
a local ``--model`` (or ``--draft-model``) is a model directory: a mistake is one
``kvstore: error: …`` line on stderr and exit status 2, as in every subcommand.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from kvstore import Store, _human, default_root
from kvstore.mlx_lm import PersistentPromptCache
from kvstore.mlx_lm.prefill import segmenting_tokenize

__all__ = ["serve_main", "parse_size"]

logger = logging.getLogger("kvstore.serve")

# A Hugging Face repo id ("name" or "owner/name"); anything else is a local path
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


class ServeError(Exception):
    """A mistake in serve's arguments: one ``kvstore: error:`` line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ServeError(f"{message} (see 'kvstore serve --help')")


def parse_size(text: str) -> int:
    """``--max-bytes`` and friends: the CLI's size syntax (``10G``, ``500MiB``, plain bytes)."""
    try:
        return _human.parse_size(text)
    except _human.SizeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
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
        "--remote",
        default=None,
        metavar="URL",
        help="share the cache through s3://BUCKET/PREFIX (default: $KVSTORE_REMOTE): "
        "lookups consult it, hits are pulled, saves are pushed in the background",
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
        "--no-verify-reads",
        action="store_true",
        help="do not check each block's digest as a restore reads it (faster restores; "
        "a block damaged on disk is then handed to the model)",
    )
    g.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        metavar="N",
        help="for a model whose cache cannot be trimmed (hybrid, sliding window), save a "
        "checkpoint to the store every N prompt tokens, so a prompt that diverges part-way "
        "restores the deepest one before it (default: per model, at least 1024 and a whole "
        "number of blocks, enough that a checkpoint's own bytes are at most a quarter of its "
        "interval's key/value bytes; 0: off)",
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


def _option(argv: Sequence[str], *names: str) -> str | None:
    """The last value given for one of ``names`` (``--x V`` or ``--x=V``), else None."""
    found = None
    for i, a in enumerate(argv):
        for n in names:
            if a == n and i + 1 < len(argv):
                found = argv[i + 1]
            elif a.startswith(n + "="):
                found = a[len(n) + 1 :]
    return found


def check_model(value: str, option: str = "--model") -> None:
    """Fail now, not at the first request, when a local model path is not a model.

    A value that exists must be a directory with a ``config.json``; one that does
    not exist must look like a Hugging Face repo id (``owner/name``), which
    mlx-lm downloads or finds in its cache.
    """
    path = Path(value).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ServeError(f"{option} {value}: not a model directory")
        if not (path / "config.json").is_file():
            raise ServeError(f"{option} {value}: not a model directory (no config.json)")
        return
    if not _HUB_ID.fullmatch(value) or value.startswith((".", "~")):
        raise ServeError(f"{option} {value}: no such model directory")


def serve_main(argv: list[str]) -> int:
    """Run mlx-lm's server with `PersistentPromptCache`; return the exit code.

    A mistake in the arguments prints one ``kvstore: error: …`` line and returns 2
    before any root is opened or port bound.
    """
    try:
        return _serve(argv)
    except ServeError as e:
        print(f"kvstore: error: {e}", file=sys.stderr)
        return 2


def _serve(argv: list[str]) -> int:
    import mlx_lm.server as server

    ours, rest = _parser().parse_known_args(argv)
    if ours.checkpoint_every is not None and ours.checkpoint_every < 0:
        raise ServeError(f"--checkpoint-every must be >= 0, got {ours.checkpoint_every}")
    if "-h" not in rest and "--help" not in rest:
        for option in ("--model", "--draft-model"):
            value = _option(rest, option)
            if value is not None:
                check_model(value, option)
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
    with Store.open(
        root,
        durable=not ours.no_durable,
        max_bytes=ours.max_bytes,
        verify_reads=not ours.no_verify_reads,
        remote=ours.remote,
    ) as store:

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

        tokenize = segmenting_tokenize(server.ResponseGenerator._tokenize,
                                       ours.checkpoint_every, store.block_tokens)
        try:
            with (
                _swapped(server, "LRUPromptCache", factory),
                _swapped(server.ResponseGenerator, "_tokenize", tokenize),
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
                logger.info("kvstore: %s", cache.persist_stats().summary())
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
