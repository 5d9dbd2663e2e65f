"""The guards of ``kvstore serve`` (issue 43, item 5), each against the real command on
127.0.0.1 with a tiny random-weight model: the API key, the Host and Origin checks, CORS,
the body and header limits, clients that never finish their request, JSON nested too
deep, a full queue, and a bind beyond loopback without a key. Every request is bounded in
time; every server is stopped with SIGTERM and must exit cleanly."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.serving import server_process

from kvstore.serving.chat import MAX_BODY_BYTES
from kvstore.tiny import make_tiny_model

KEY = "sk-test-0123456789"
ORIGIN = "http://app.example:3000"
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
MESSAGE = {"model": "local", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("guards") / "tiny-llama", "llama")


@pytest.fixture(scope="module")
def guarded(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """A server with a key, one slot and no queue, a CORS origin and an allowed host."""
    tmp = tmp_path_factory.mktemp("guarded")
    log = tmp / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_API_KEY"}
    env["KVSTORE_API_KEY"] = KEY  # the key from the environment
    with server_process("kvstore.serve", [
            "--model", str(model), "--root", str(tmp / "root"), "--max-concurrency", "1",
            "--max-queue", "0", "--max-tokens", "100000", "--cors-origin", ORIGIN,
            "--allowed-host", "kv.example"], log, env=env) as (port, _):
        yield port, log


def _req(port: int, method: str, path: str, body: Any = None, *,
         headers: dict[str, str] | None = None, key: str | None = KEY, timeout: float = 30,
         ) -> tuple[int, dict[str, str], Any]:
    """One request on its own connection: the status, the headers (lower-case names) and
    the JSON answer (its text when it is not JSON)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    h = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        h.setdefault("Authorization", f"Bearer {key}")
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    try:
        c.request(method, path, body=data, headers=h)
        r = c.getresponse()
        raw = r.read()
        got = {k.lower(): v for k, v in r.getheaders()}
    finally:
        c.close()
    try:
        return r.status, got, json.loads(raw)
    except ValueError:
        return r.status, got, raw.decode("utf-8", "replace")


def _ok(port: int) -> None:
    """The server still answers a normal request normally."""
    status, _, body = _req(port, "POST", "/v1/chat/completions", CHAT)
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body


# --- the key ----------------------------------------------------------------------------


def test_a_missing_or_wrong_key_is_a_401_in_each_apis_shape(guarded: tuple[int, Path]) -> None:
    port, _ = guarded
    openai_401 = {"error": {
        "message": "a valid API key is required (Authorization: Bearer KEY or x-api-key: KEY)",
        "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    for key in (None, "sk-wrong", KEY[:-1], KEY + "0"):
        status, headers, body = _req(port, "POST", "/v1/chat/completions", CHAT, key=key)
        assert (status, body) == (401, openai_401)
        assert headers["www-authenticate"] == "Bearer"
        status, _, body = _req(port, "POST", "/v1/responses", {"input": "x"}, key=key)
        assert (status, body) == (401, openai_401)
        status, _, body = _req(port, "POST", "/v1/messages", MESSAGE, key=key)
        assert (status, body) == (401, {"type": "error", "error": {
            "type": "authentication_error", "message": openai_401["error"]["message"]}})
        status, _, body = _req(port, "GET", "/v1/models", key=key)
        assert status == 401
    # the key, as a Bearer token or as Anthropic's header; /health needs none
    _ok(port)
    status, _, body = _req(port, "POST", "/v1/messages", MESSAGE, key=None,
                           headers={"x-api-key": KEY})
    assert status == 200 and body["usage"]["output_tokens"] == 2
    assert _req(port, "GET", "/health", key=None)[::2] == (200, {"status": "ok"})


# --- Host, Origin, CORS -------------------------------------------------------------------


def test_a_foreign_host_is_refused_and_the_servers_own_names_are_not(
        guarded: tuple[int, Path]) -> None:
    port, _ = guarded
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.nip.io",
                 f"localhost:{port + 1 if port < 65535 else port - 1}"):
        status, _, body = _req(port, "POST", "/v1/chat/completions", CHAT,
                               headers={"Host": host})
        assert status == 403, (host, body)
        assert body["error"]["message"].startswith(
            f"this server does not answer for Host {host!r}")
    status, _, body = _req(port, "POST", "/v1/messages", MESSAGE, headers={"Host": "evil.example"})
    assert status == 403 and body["error"]["type"] == "permission_error"
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"kv.example:{port}"):
        status, _, body = _req(port, "POST", "/v1/chat/completions", CHAT,
                               headers={"Host": host})
        assert status == 200, (host, body)


def test_no_cors_headers_but_for_the_origin_allowed_and_a_foreign_page_cannot_post(
        guarded: tuple[int, Path]) -> None:
    port, _ = guarded
    status, headers, _ = _req(port, "GET", "/v1/models")
    assert status == 200 and "access-control-allow-origin" not in headers
    status, headers, _ = _req(port, "GET", "/v1/models", headers={"Origin": "http://evil.example"})
    assert status == 200 and "access-control-allow-origin" not in headers
    status, _, body = _req(port, "POST", "/v1/chat/completions", CHAT,
                           headers={"Origin": "http://evil.example"})
    assert status == 403
    assert body["error"]["message"] == ("requests from pages of 'http://evil.example' are not "
                                        "allowed (see --cors-origin)")
    status, headers, body = _req(port, "POST", "/v1/chat/completions", CHAT,
                                 headers={"Origin": ORIGIN})
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    status, headers, _ = _req(port, "OPTIONS", "/v1/chat/completions", key=None, headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert status == 204 and headers["access-control-allow-origin"] == ORIGIN
    assert headers["access-control-allow-headers"] == "authorization, content-type"
    # the server's own origin (a page it served, a same-origin tool) is not foreign
    status, _, _ = _req(port, "POST", "/v1/chat/completions", CHAT,
                        headers={"Origin": f"http://127.0.0.1:{port}"})
    assert status == 200


# --- sizes, slow clients, deep JSON ---------------------------------------------------------


def _raw(port: int, head: bytes, body: bytes = b"", timeout: float = 30) -> tuple[int, bytes]:
    """Send ``head`` and ``body`` while reading the answer (a server that refuses a body
    answers before it has all of it, and then closes: the rest of the send may fail)."""
    import threading

    def send() -> None:
        try:
            s.sendall(head + body)
        except OSError:  # refused part-way: the answer says why
            pass

    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        sender = threading.Thread(target=send)
        sender.start()
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except ConnectionResetError:  # the unread rest of the body: the answer came first
            assert data
        sender.join(timeout)
    first, _, rest = data.partition(b"\r\n\r\n")
    return int(first.split()[1]), rest


def test_a_body_over_the_limit_is_a_413_before_it_is_read_chunked_or_not(
        guarded: tuple[int, Path]) -> None:
    port, _ = guarded
    t0 = time.monotonic()
    status, body = _raw(port, (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}"
                               f"\r\nAuthorization: Bearer {KEY}\r\nContent-Length: "
                               "100000000000\r\n\r\n").encode())
    assert status == 413 and time.monotonic() - t0 < 5
    assert json.loads(body)["error"]["message"] == (
        f"the request body is 100000000000 bytes, over the limit of {MAX_BODY_BYTES} bytes")
    chunk = b"x" * (1 << 20)
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk)
                      for _ in range(MAX_BODY_BYTES // len(chunk) + 1)) + b"0\r\n\r\n"
    status, body = _raw(port, (f"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                               f"x-api-key: {KEY}\r\nTransfer-Encoding: chunked\r\n\r\n"
                               ).encode(), chunks)
    assert status == 413
    assert json.loads(body) == {"type": "error", "error": {
        "type": "request_too_large",
        "message": f"the request body is over the limit of {MAX_BODY_BYTES} bytes"}}
    _ok(port)


def test_headers_over_the_limit_are_a_431(guarded: tuple[int, Path]) -> None:
    port, _ = guarded
    status, _ = _raw(port, (f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-Big: "
                            + "a" * (70 << 10) + "\r\n\r\n").encode())
    assert status in (400, 431)  # h11's own limit (400) when the head arrives in parts
    _ok(port)


def test_clients_that_never_finish_their_request_hold_up_no_one_and_are_closed(
        guarded: tuple[int, Path]) -> None:
    port, _ = guarded
    slow = []
    try:
        for i in range(100):
            s = socket.create_connection(("127.0.0.1", port), timeout=20)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      if i % 2 else b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1"
                      b"\r\nContent-Length: 100\r\n\r\n{")  # head unfinished, body unfinished
            slow.append(s)
        t0 = time.monotonic()
        _ok(port)
        assert time.monotonic() - t0 < 2.0
        # an unfinished head is closed after 10 s; a body that stops coming, after 30 s
        deadline = time.monotonic() + 15
        heads = [s for i, s in enumerate(slow) if i % 2]
        for s in heads:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            assert s.recv(100) == b""
    finally:
        for s in slow:
            s.close()


def test_json_nested_too_deep_is_a_400_in_each_apis_shape(guarded: tuple[int, Path]) -> None:
    port, _ = guarded
    for depth in (100, 100_000):
        deep = b'{"messages": [{"role": "user", "content": "x"}], "x": ' + b"[" * depth \
            + b"]" * depth + b"}"
        status, _, body = _req(port, "POST", "/v1/chat/completions", deep)
        assert (status, body) == (400, {"error": "the JSON body nests deeper than 64 levels"})
        status, _, body = _req(port, "POST", "/v1/messages", deep)
        assert (status, body) == (400, {"type": "error", "error": {
            "type": "invalid_request_error",
            "message": "the JSON body nests deeper than 64 levels"}})
    _ok(port)


# --- a full queue -----------------------------------------------------------------------------


def test_a_full_queue_is_a_429_or_a_529_with_retry_after(guarded: tuple[int, Path]) -> None:
    """One slot, no queue: while a long answer streams, the next request is refused at
    once; when its client leaves, the slot is free again."""
    port, log = guarded
    with socket.create_connection(("127.0.0.1", port), timeout=30) as long:
        body = json.dumps({**CHAT, "max_tokens": 100_000, "stream": True}).encode()
        long.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                      f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n"
                      ).encode() + body)
        got = b""
        while got.count(b"data: ") < 3:  # it is decoding
            got += long.recv(65536)
        t0 = time.monotonic()
        status, headers, err = _req(port, "POST", "/v1/chat/completions", CHAT)
        assert status == 429 and headers["retry-after"] == "1"
        assert err["error"]["type"] == "rate_limit_error"
        assert err["error"]["message"].startswith("the server is busy")
        status, headers, err = _req(port, "POST", "/v1/messages", MESSAGE)
        assert status == 529 and headers["retry-after"] == "1"
        assert err["type"] == "error" and err["error"]["type"] == "overloaded_error"
        assert time.monotonic() - t0 < 2
    deadline = time.monotonic() + 10
    while True:  # the stream's client left: its job is cancelled, the slot freed
        status, _, body = _req(port, "POST", "/v1/chat/completions", CHAT)
        if status == 200:
            break
        assert status == 429 and time.monotonic() < deadline
        time.sleep(0.2)
    assert "outcome=cancelled" in log.read_text()


# --- a bind beyond loopback ---------------------------------------------------------------------


def test_a_bind_beyond_loopback_without_a_key_is_refused_with_one_line(
        model: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_API_KEY"}
    p = subprocess.run([sys.executable, "-P", "-m", "kvstore", "serve", "--model", str(model),
                        "--root", str(tmp_path / "root"), "--host", "0.0.0.0", "--port", "0"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert (p.returncode, p.stdout) == (2, "")
    assert p.stderr == ("kvstore: error: --host 0.0.0.0: serving beyond this machine needs "
                        "--api-key KEY (or $KVSTORE_API_KEY); --allow-unauthenticated-remote "
                        "serves without one\n")
    assert not (tmp_path / "root").exists()


@pytest.mark.parametrize("bad", [{"stop": [1]}, {"logit_bias": {"99999999": 5}},
                                 {"logit_bias": {"1": "x"}}, {"max_tokens": -1},
                                 {"top_p": 7}, {"messages": "hi"}])
def test_a_request_that_could_hurt_the_engine_is_a_400_and_the_next_is_answered(
        guarded: tuple[int, Path], bad: dict[str, Any]) -> None:
    """Issue 43's attacks on mlx_lm.server: a ``"stop": [1]`` stopped its generation thread,
    a ``logit_bias`` id past the vocabulary ended the process."""
    port, _ = guarded
    status, _, body = _req(port, "POST", "/v1/chat/completions", {**CHAT, **bad})
    assert status == 400 and isinstance(body["error"], str), body
    _ok(port)
    assert _req(port, "GET", "/health", key=None)[::2] == (200, {"status": "ok"})
