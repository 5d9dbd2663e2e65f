"""The guards of ``kvstore serve`` (issue 43, item 5): what a request must pass before any
endpoint sees it, as pure ASGI middleware (:class:`Guard`) and uvicorn's h11 protocol with
a deadline for a request's head (:class:`GuardedH11Protocol`).

- **Host**: the ``Host`` header names the server (its bind address, ``localhost``,
  ``127.0.0.1``, ``[::1]``, or an ``--allowed-host``) with its port: else 403, so that a
  web page cannot reach a local server through DNS rebinding.
- **Origin**: a state-changing request (anything but GET, HEAD, OPTIONS) from a browser
  page of another origin is a 403, unless ``--cors-origin`` names it; CORS headers are
  sent for those origins only (none by default).
- **Key**: with ``--api-key``, every request but ``/health`` carries it
  (``Authorization: Bearer KEY`` or ``x-api-key: KEY``), compared in constant time; else a
  401 in the API's error shape.
- **Body**: at most :data:`~kvstore.serving.chat.MAX_BODY_BYTES`: a larger
  ``Content-Length`` is a 413 before a byte is read, a chunked body is counted as it comes;
  the body must keep coming (:data:`BODY_IDLE` s between two parts, :data:`BODY_TOTAL` s in
  all: else 408).
- **Head**: at most :data:`MAX_HEAD_BYTES` (a 431; h11's own limit, a 400, when it arrives
  in parts), complete within
  :data:`HEAD_TIMEOUT` s of the connection's start or of the previous answer's end (else the
  connection is closed); an idle connection is closed after uvicorn's keep-alive timeout.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvstore.serving import anthropic_messages
from kvstore.serving.chat import MAX_BODY_BYTES, ApiError

__all__ = ["BODY_IDLE", "BODY_TOTAL", "Guard", "GuardedH11Protocol", "HEAD_TIMEOUT",
           "MAX_HEAD_BYTES", "MAX_JSON_DEPTH", "Settings", "error_body", "json_depth",
           "h11_limits"]

logger = logging.getLogger("kvstore.serve")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_HEAD_BYTES = 64 << 10  # request line and headers
HEAD_TIMEOUT = 10.0  # seconds for a request's head to arrive whole
BODY_IDLE = 30.0  # seconds between two parts of a body
BODY_TOTAL = 300.0  # seconds for a whole body
MAX_JSON_DEPTH = 64  # nesting of a request's JSON
_LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}
_SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}


class h11_limits:  # noqa: N801 - a namespace of constants, read by main
    max_head_bytes = MAX_HEAD_BYTES


@dataclass
class Settings:
    """What the guards check against."""

    api_key: str | None = None
    host: str = "127.0.0.1"  # the bind address
    port: int = 0  # the port bound
    allowed_hosts: list[str] = field(default_factory=list)
    cors_origins: list[str] = field(default_factory=list)
    metrics_on_api_port: bool = False
    max_body: int = MAX_BODY_BYTES

    def host_names(self) -> set[str]:
        names = {*_LOOPBACK_NAMES, *(h.lower() for h in self.allowed_hosts)}
        bound = self.host.lower()
        if bound not in ("0.0.0.0", "::", "[::]", ""):
            names |= {bound, f"[{bound}]" if ":" in bound and not bound.startswith("[")
                      else bound}
        return names

    def any_host(self) -> bool:
        """Bound to every address: the Host is whatever the client used to reach it
        (rebinding is then stopped by the key that such a bind requires)."""
        return self.host in ("0.0.0.0", "::", "[::]", "") or "*" in self.allowed_hosts


# --- the error shapes --------------------------------------------------------------------

_OPENAI_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
                 403: "invalid_request_error", 404: "invalid_request_error",
                 408: "invalid_request_error", 411: "invalid_request_error",
                 413: "invalid_request_error", 429: "rate_limit_error",
                 431: "invalid_request_error"}
_ANTHROPIC_KINDS = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 408: "timeout_error",
                    411: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 431: "invalid_request_error",
                    529: "overloaded_error"}


def api_of(path: str) -> str:
    """``anthropic`` for the Messages API's paths, else ``openai``."""
    return "anthropic" if path.rstrip("/").startswith("/v1/messages") else "openai"


def error_body(path: str, status: int, message: str, *, code: str | None = None,
               kind: str | None = None) -> bytes:
    """An error in the shape of the API ``path`` belongs to: Anthropic's
    ``{"type": "error", "error": {"type", "message"}}`` or OpenAI's
    ``{"error": {"message", "type", "param", "code"}}``."""
    if api_of(path) == "anthropic":
        k = kind or _ANTHROPIC_KINDS.get(status, "api_error")
        return anthropic_messages.error_body(ApiError(status, k, message))
    t = _OPENAI_TYPES.get(status, "server_error")
    return msgspec.json.encode({"error": {"message": message, "type": t, "param": None,
                                          "code": code if code is not None else status}})


async def respond(send: Send, status: int, body: bytes, *,
                  headers: list[tuple[bytes, bytes]] | None = None, close: bool = False
                  ) -> None:
    h = [(b"content-type", b"application/json"),
         (b"content-length", str(len(body)).encode()), *(headers or [])]
    if close:
        h.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": h})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def json_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """The nesting depth of decoded JSON, counted up to ``limit + 1`` (no deeper)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            items: Any = v.values()
        elif isinstance(v, list):
            items = v
        else:
            continue
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        stack.extend((x, d + 1) for x in items if isinstance(x, dict | list))
    return deepest


# --- the middleware ----------------------------------------------------------------------


class _TooLarge(Exception):
    pass


class Guard:
    """The guards in front of ``app`` (see the module's docstring)."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self._names = settings.host_names()
        self._key = settings.api_key.encode() if settings.api_key else None

    # --- the checks ---------------------------------------------------------------------

    def _host_ok(self, host: str | None) -> bool:
        if host is None:
            return False  # HTTP/1.1 requires it; h11 refuses its absence already
        if self.settings.any_host():
            return True
        split = urlsplit(f"//{host}")
        try:
            name, port = (split.hostname or "").lower(), split.port
        except ValueError:
            return False
        if port is not None and self.settings.port and port != self.settings.port:
            return False
        bracketed = f"[{name}]" if ":" in name else name
        return name in self._names or bracketed in self._names

    def _same_origin(self, origin: str, host: str | None) -> bool:
        """The page is one of the server's own (its origin names the server)."""
        split = urlsplit(origin)
        if split.scheme not in ("http", "https") or not split.netloc:
            return False
        if self.settings.any_host():
            return host is not None and split.netloc.lower() == host.lower()
        return self._host_ok(split.netloc)

    def _cors(self, origin: str | None) -> list[tuple[bytes, bytes]]:
        allowed = self.settings.cors_origins
        if origin is None or not allowed:
            return []
        if "*" in allowed:
            return [(b"access-control-allow-origin", b"*")]
        if origin in allowed:
            return [(b"access-control-allow-origin", origin.encode()), (b"vary", b"Origin")]
        return []

    def _key_ok(self, headers: dict[bytes, bytes]) -> bool:
        assert self._key is not None
        given = headers.get(b"x-api-key")
        auth = headers.get(b"authorization")
        if auth is not None and auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        if given is None:
            return False
        return hmac.compare_digest(given, self._key)

    # --- the middleware -----------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        method: str = scope["method"]
        headers: dict[bytes, bytes] = {}
        for k, v in scope["headers"]:
            headers.setdefault(k.lower(), v)
        head = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + sum(
            len(k) + len(v) + 4 for k, v in scope["headers"])
        if head > MAX_HEAD_BYTES:  # h11 bounds only a head that arrives in several parts
            await respond(send, 431, error_body(
                path, 431, f"the request's headers are over the limit of {MAX_HEAD_BYTES} "
                "bytes"), close=True)
            return
        host = headers[b"host"].decode("latin-1") if b"host" in headers else None
        origin = headers[b"origin"].decode("latin-1") if b"origin" in headers else None

        if not self._host_ok(host):
            logger.warning("kvstore: refused a request for Host %r", host)
            await respond(send, 403, error_body(
                path, 403, f"this server does not answer for Host {host!r} (its own "
                "addresses, localhost, or an --allowed-host)"), close=True)
            return
        cors = self._cors(origin)
        if origin is not None and not cors and method not in _SAFE_METHODS \
                and not self._same_origin(origin, host):
            logger.warning("kvstore: refused a %s from a page of %r", method, origin)
            await respond(send, 403, error_body(
                path, 403, f"requests from pages of {origin!r} are not allowed (see "
                "--cors-origin)"), close=True)
            return
        if method == "OPTIONS":  # a preflight: answered here, with CORS headers if allowed
            extra = [(b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                     (b"access-control-allow-headers",
                      headers.get(b"access-control-request-headers", b"*")),
                     (b"access-control-max-age", b"600")] if cors else []
            await send({"type": "http.response.start", "status": 204,
                        "headers": [*cors, *extra]})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if self._key is not None and path != "/health" and not self._key_ok(headers):
            await respond(send, 401, error_body(
                path, 401, "a valid API key is required (Authorization: Bearer KEY or "
                "x-api-key: KEY)", code="invalid_api_key"),
                headers=[(b"www-authenticate", b"Bearer"), *cors])
            return

        limit = self.settings.max_body
        raw = headers.get(b"content-length")
        if raw is not None:
            if not raw.strip().isdigit():
                await respond(send, 400, error_body(path, 400, "the Content-Length header "
                                                    "is not a number"), close=True)
                return
            n = int(raw)
            if n > limit:
                await respond(send, 413, error_body(
                    path, 413, f"the request body is {n} bytes, over the limit of {limit} "
                    "bytes"), headers=cors, close=True)
                return
        try:
            body = await self._read(receive, limit)
        except _TooLarge:
            await respond(send, 413, error_body(
                path, 413, f"the request body is over the limit of {limit} bytes"),
                headers=cors, close=True)
            return
        except TimeoutError:
            await respond(send, 408, error_body(path, 408, "the request body did not "
                                                "arrive in time"), headers=cors, close=True)
            return
        except _Gone:
            return

        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        async def send_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                extra = list(cors)
                if message["status"] >= 400:  # a refused request: the client starts afresh
                    extra.append((b"connection", b"close"))
                if extra:
                    message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        await self.app(scope, replay, send_cors)

    @staticmethod
    async def _read(receive: Receive, limit: int) -> bytes:
        parts: list[bytes] = []
        size = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + BODY_TOTAL
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError
            message = await asyncio.wait_for(receive(), min(BODY_IDLE, left))
            if message["type"] == "http.disconnect":
                raise _Gone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _TooLarge
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)


class _Gone(Exception):
    """The client left before its body was read."""


# --- the HTTP protocol ---------------------------------------------------------------------


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head does not arrive
    whole within :data:`HEAD_TIMEOUT` seconds (of the connection's start or of the end of
    its previous answer): a client that never finishes its request holds nothing for
    long. uvicorn bounds the rest: the head's size (h11), an idle connection (its
    keep-alive timeout)."""

    _head_timer: asyncio.TimerHandle | None = None
    _heads = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT, self._expired, self._heads)

    def _expired(self, heads: int) -> None:
        self._head_timer = None
        idle = self.cycle is None or self.cycle.response_complete
        if heads == self._heads and idle and not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:
            self._heads += 1

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)
