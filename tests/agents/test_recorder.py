"""The recorder times each piece of a streamed answer as it passes, so a bench can tell
when an event came (its first token), not only the answer's first and last byte. In the
default suite: a server on 127.0.0.1 that streams two events a set time apart."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from recorder import Recorder

GAP = 0.5  # seconds between the two events
FIRST, SECOND = b"event: ping\ndata: {}\n\n", b"event: delta\ndata: {\"t\": \"Done.\"}\n\n"


class _Streamer(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i, event in enumerate((FIRST, SECOND)):
            if i:
                time.sleep(GAP)
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture
def upstream() -> Iterator[int]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Streamer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(httpd.server_address[1])
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)


def test_each_piece_of_an_answer_is_timed_as_it_passes(upstream: int) -> None:
    with Recorder(upstream, timeout=30) as rec:
        req = urllib.request.Request(rec.url + "/v1/messages", data=b"{}", method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.read() == FIRST + SECOND
        ex = rec.exchanges[0]
    assert bytes(ex.answer) == FIRST + SECOND
    assert [size for _, size in ex.arrivals] == [len(FIRST), len(FIRST) + len(SECOND)]
    first, second = ex.arrived(0), ex.arrived(len(FIRST))
    assert first is not None and second is not None
    assert first == ex.first_byte
    assert second - first >= GAP * 0.9
    assert ex.arrived(len(FIRST) - 1) == first
    assert ex.arrived(len(FIRST + SECOND)) is None  # past the end
    assert ex.ended is not None and ex.ended >= second
