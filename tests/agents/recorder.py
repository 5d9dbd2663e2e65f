"""A recording HTTP proxy on 127.0.0.1 between a coding agent and ``kvstore serve``: every
request is passed on as it came (method, path with its query, headers, body) and its answer
streamed back as it arrives, and each exchange is kept: the request, the status, when the
first byte of the answer came, when each piece of it did and when the last did, and the
answer's bytes.

Given to the client as its ``HTTPS_PROXY``/``HTTP_PROXY`` too, it is a tripwire: a request
for any other host (telemetry, an update check, a model list) is refused and kept in
``escapes``, so a test can say that nothing left 127.0.0.1.

It knows nothing of the server but HTTP, so the tests that use it hold for any server that
answers the same requests. Bounded: bodies of at most ``MAX_BODY`` bytes, ``MAX_EXCHANGES``
kept, ``MAX_ARRIVALS`` pieces of an answer timed, each connection's socket with a timeout.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

MAX_BODY = 64 << 20
MAX_EXCHANGES = 2000
MAX_ARRIVALS = 100_000  # pieces of one answer timed
#: Headers not passed on: hop by hop, or set again by the connection to the server.
_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "te",
        "trailer", "host", "content-length"}


@dataclass
class Exchange:
    """One request the client sent and what it was answered."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    started: float
    status: int = 0
    first_byte: float | None = None  # seconds from the request to the answer's first byte
    ended: float | None = None  # seconds from the request to the answer's end
    answer: bytearray = field(default_factory=bytearray)
    #: ``(seconds from the request, bytes of the answer so far)`` as each piece came
    arrivals: list[tuple[float, int]] = field(default_factory=list)

    def arrived(self, offset: int) -> float | None:
        """Seconds from the request until the answer's byte at ``offset`` had come."""
        for when, size in self.arrivals:
            if size > offset:
                return when
        return None

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None

    def events(self) -> list[tuple[str | None, Any]]:
        """The answer's server-sent events: ``(event name or None, data as JSON)``."""
        out: list[tuple[str | None, Any]] = []
        for block in bytes(self.answer).replace(b"\r\n", b"\n").split(b"\n\n"):
            name, data = None, []
            for line in block.split(b"\n"):
                if line.startswith(b"event:"):
                    name = line[6:].strip().decode()
                elif line.startswith(b"data:"):
                    data.append(line[5:].strip())
            if data and data != [b"[DONE]"]:
                try:
                    out.append((name, json.loads(b"\n".join(data))))
                except ValueError:
                    out.append((name, b"\n".join(data).decode("utf-8", "replace")))
        return out


def _chunked(h: BaseHTTPRequestHandler) -> bytes:
    """A request body sent in chunks (at most ``MAX_BODY`` bytes)."""
    out = bytearray()
    while len(out) <= MAX_BODY:
        size = int(h.rfile.readline(1024).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while h.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                pass
            break
        out += h.rfile.read(size)
        h.rfile.readline(1024)
    return bytes(out)


class Recorder:
    """Listens on 127.0.0.1 (``url``) and forwards to ``upstream`` (``host:port``)."""

    def __init__(self, upstream_port: int, *, timeout: float = 600.0) -> None:
        self.upstream_port = upstream_port
        self.exchanges: list[Exchange] = []
        self.escapes: list[str] = []  # requests for other hosts, refused
        self._lock = threading.Lock()
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

            def _any(self) -> None:
                if self.command == "CONNECT" or not self.path.startswith("/"):
                    recorder._refuse(self)  # a client reaching past the server
                else:
                    recorder._forward(self, timeout)

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_OPTIONS = _any  # noqa: N815
            do_PATCH = do_CONNECT = _any  # noqa: N815

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.port = int(self._httpd.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def _refuse(self, h: BaseHTTPRequestHandler) -> None:
        """A request for another host (``CONNECT host:443``, or ``GET http://host/…``), which
        a client sends here when it is given this proxy as ``HTTPS_PROXY``/``HTTP_PROXY``:
        kept in :attr:`escapes` and refused."""
        with self._lock:
            if len(self.escapes) < MAX_EXCHANGES:
                self.escapes.append(f"{h.command} {h.path}")
        h.send_response(403)
        h.send_header("Content-Length", "0")
        h.send_header("Connection", "close")
        h.end_headers()
        h.close_connection = True

    def retarget(self, upstream_port: int) -> None:
        """Send what comes next to another server (a restarted one)."""
        self.upstream_port = upstream_port

    def _forward(self, h: BaseHTTPRequestHandler, timeout: float) -> None:
        n = int(h.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            h.send_error(413)
            return
        if "chunked" in (h.headers.get("Transfer-Encoding") or "").lower():
            body = _chunked(h)
            n = len(body)
        else:
            body = h.rfile.read(n) if n else b""
        headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP}
        ex = Exchange(h.command, h.path, dict(h.headers.items()), body, time.monotonic())
        with self._lock:
            if len(self.exchanges) < MAX_EXCHANGES:
                self.exchanges.append(ex)
        conn = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=timeout)
        try:
            try:
                conn.request(h.command, h.path, body=body if body or n else None,
                             headers={**headers, "Content-Length": str(len(body))})
                r = conn.getresponse()
            except OSError as e:  # the server is down: the client sees a 502
                ex.status = 502
                msg = f"recorder: the server did not answer: {e}".encode()
                ex.first_byte = ex.ended = time.monotonic() - ex.started
                h.send_response(502)
                h.send_header("Content-Length", str(len(msg)))
                h.send_header("Connection", "close")
                h.end_headers()
                h.wfile.write(msg)
                h.close_connection = True
                return
            ex.status = r.status
            h.send_response(r.status, r.reason)
            for k, v in r.getheaders():
                if k.lower() not in _HOP:
                    h.send_header(k, v)
            # the answer is passed on as it comes, delimited by the connection's close
            h.send_header("Connection", "close")
            h.end_headers()
            h.close_connection = True
            while True:
                chunk = r.read1(1 << 16)
                if not chunk:
                    break
                now = time.monotonic() - ex.started
                if ex.first_byte is None:
                    ex.first_byte = now
                if len(ex.answer) < MAX_BODY:
                    ex.answer += chunk
                    if len(ex.arrivals) < MAX_ARRIVALS:
                        ex.arrivals.append((now, len(ex.answer)))
                try:
                    h.wfile.write(chunk)
                    h.wfile.flush()
                except OSError:  # the client left
                    break
            if ex.first_byte is None:
                ex.first_byte = time.monotonic() - ex.started
        except (TimeoutError, OSError):
            pass
        finally:
            ex.ended = time.monotonic() - ex.started
            conn.close()

    def since(self, mark: int) -> list[Exchange]:
        """The exchanges recorded after the first ``mark``."""
        with self._lock:
            return list(self.exchanges[mark:])

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(10)

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
