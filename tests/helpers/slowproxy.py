"""A TCP proxy on 127.0.0.1 between an S3 client and the real gateway, to make the gateway
slow or failing without touching it: ``delay`` seconds before each request is passed on
(the first bytes a client sends after the gateway last answered it), or, with ``fail``,
every request answered ``403 Forbidden`` (an error botocore does not retry) at once.

Bounded: at most ``MAX_CONNECTIONS`` connections at a time (more are closed at once), a
delay of at most ``MAX_DELAY`` seconds; :meth:`SlowProxy.close` stops every thread."""

from __future__ import annotations

import select
import socket
import threading
import time
from types import TracebackType
from urllib.parse import urlsplit

MAX_CONNECTIONS = 128
MAX_DELAY = 10.0
_FORBIDDEN = (b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\n"
              b"Content-Length: 0\r\nConnection: close\r\n\r\n")


class SlowProxy:
    """Forwards 127.0.0.1:``port`` to the gateway at ``upstream`` (a URL)."""

    def __init__(self, upstream: str, *, delay: float = 0.0) -> None:
        u = urlsplit(upstream)
        assert u.hostname is not None and u.port is not None, upstream
        self._to = (u.hostname, u.port)
        self.delay = delay
        self.fail = False
        self.requests = 0  # requests passed on or failed
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._ls = socket.create_server(("127.0.0.1", 0))
        self._ls.settimeout(0.1)
        self.port = int(self._ls.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._spawn(self._accept)

    def _spawn(self, fn: object, *args: object) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)  # type: ignore[arg-type]
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()]
            self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self._ls.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                full = len(self._conns) >= 2 * MAX_CONNECTIONS
            if full:
                c.close()
                continue
            self._spawn(self._pipe, c)

    def _pipe(self, c: socket.socket) -> None:
        try:
            s = socket.create_connection(self._to, timeout=10)
        except OSError:
            c.close()
            return
        with self._lock:
            self._conns |= {c, s}
        turn = "gateway"
        try:
            while not self._stop.is_set():
                ready, _, _ = select.select([c, s], [], [], 0.1)
                for r in ready:
                    data = r.recv(1 << 16)
                    if not data:
                        return
                    if r is c:
                        if turn == "gateway":  # a new request
                            with self._lock:
                                self.requests += 1
                            if self.fail:
                                c.sendall(_FORBIDDEN)
                                return
                            if self._stop.wait(min(self.delay, MAX_DELAY)):
                                return
                        turn = "client"
                        s.sendall(data)
                    else:
                        turn = "gateway"
                        c.sendall(data)
        except OSError:
            return
        finally:
            with self._lock:
                self._conns -= {c, s}
            c.close()
            s.close()

    def close(self) -> None:
        self._stop.set()
        self._ls.close()
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(MAX_DELAY + 5)

    def __enter__(self) -> SlowProxy:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def wait_until(cond: object, timeout: float, what: str) -> None:
    """Poll ``cond()`` every 50 ms until it is true; fail the test after ``timeout`` s."""
    end = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < end, f"not within {timeout} s: {what}"
        time.sleep(0.05)
