"""The HTTP side of ``kvstore serve`` (issue 43, items 1, 4 and 6): the endpoints listed,
streams with the prefill's keep-alive comments, a client that leaves cancelling its job
(streamed and not, on each API: the log says ``outcome=cancelled`` within a second),
``/metrics`` on the API port and apart, and the options mlx-lm's server had that this one
does not implement. The real command on 127.0.0.1 with a tiny random-weight model; every
request and process bounded in time."""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.serving import free_port, server_process

from kvstore.tiny import make_tiny_model, sample_text


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("http") / "tiny-llama", "llama")


@pytest.fixture(scope="module")
def served(model: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[int, Path, int]]:
    tmp = tmp_path_factory.mktemp("served")
    log = tmp / "serve.log"
    metrics = free_port()
    with server_process("kvstore.serve", [
            "--model", str(model), "--root", str(tmp / "root"), "--min-tokens", "16",
            "--max-tokens", "1000000", "--prefill-step-size", "64", "--metrics-on-api-port",
            "--metrics-port", str(metrics)], log) as (port, _):
        yield port, log, metrics


def _get(port: int, path: str) -> tuple[int, bytes, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
        return r.status, r.read(), r.headers.get("Content-Type", "")


def _outcomes(log: Path) -> list[str]:
    return re.findall(r"kvstore request id=\d+ .* outcome=(\S+)", log.read_text())


def test_models_health_and_metrics_on_both_ports(served: tuple[int, Path, int]) -> None:
    port, _, metrics = served
    status, body, _ = _get(port, "/v1/models")
    listing = json.loads(body)
    assert status == 200 and [m["id"] for m in listing["data"]] == ["tiny-llama"]
    assert listing["object"] == "list" and listing["data"][0]["object"] == "model"
    assert json.loads(_get(port, "/v1/models/tiny-llama")[1])["data"][0]["id"] == "tiny-llama"
    assert json.loads(_get(port, "/health")[1]) == {"status": "ok"}
    for p in (port, metrics):
        status, body, kind = _get(p, "/metrics")
        assert status == 200 and kind.startswith("text/plain")
        assert b"kvstore_" in body


def test_a_path_not_served_is_a_404_in_its_apis_shape(served: tuple[int, Path, int]) -> None:
    port, _, _ = served
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    for method, path, want in (
            ("GET", "/nothing", "Not Found"),
            ("POST", "/v1/messages/batches", {"type": "error", "error": {
                "type": "not_found_error", "message": "Not found: POST /v1/messages/batches"}}),
            ("GET", "/v1/responses/resp_x", {"error": {
                "message": "Not found: GET /v1/responses/resp_x",
                "type": "invalid_request_error", "param": None, "code": "not_found"}})):
        c.request(method, path, body=b"{}" if method == "POST" else None)
        r = c.getresponse()
        raw = r.read()
        assert r.status == 404
        assert (raw.decode() if isinstance(want, str) else json.loads(raw)) == want
    c.close()


def _stream(port: int, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
            ) -> tuple[socket.socket, bytes]:
    """A streamed request on a raw socket, read up to its third data line."""
    data = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall((f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: "
               f"application/json\r\n{extra}Content-Length: {len(data)}\r\n\r\n").encode()
              + data)
    got = b""
    while got.count(b"data: ") < 3:
        chunk = s.recv(65536)
        assert chunk, got
        got += chunk
    return s, got


def _cancelled_within_a_second(log: Path, before: int) -> None:
    deadline = time.monotonic() + 1.0
    while len(_outcomes(log)) <= before:
        assert time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.05)
    assert _outcomes(log)[before] == "cancelled"


LONG = {"max_tokens": 1_000_000, "stream": True}
USER = [{"role": "user", "content": "Tell me a long story."}]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": USER, **LONG}),
    ("/v1/completions", {"prompt": "Once upon a time", **LONG}),
    ("/v1/messages", {"model": "local", "messages": USER, **LONG}),
    ("/v1/responses", {"model": "local", "input": "Tell me a long story.",
                       "max_output_tokens": 1_000_000, "stream": True}),
])
def test_a_streamed_request_whose_client_leaves_is_cancelled_within_a_second(
        served: tuple[int, Path, int], path: str, body: dict[str, Any]) -> None:
    port, log, _ = served
    before = len(_outcomes(log))
    s, got = _stream(port, path, body)
    assert got.startswith(b"HTTP/1.1 200")
    s.close()
    _cancelled_within_a_second(log, before)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 1_000_000}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 1_000_000}),
    ("/v1/messages", {"model": "local", "messages": USER, "max_tokens": 1_000_000}),
    ("/v1/responses", {"model": "local", "input": "Go on.", "max_output_tokens": 1_000_000}),
])
def test_a_request_not_streamed_whose_client_leaves_is_cancelled_within_a_second(
        served: tuple[int, Path, int], path: str, body: dict[str, Any]) -> None:
    port, log, _ = served
    before = len(_outcomes(log))
    progress = log.read_text().count("Prompt processing progress")
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall((f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: "
                   f"application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data)
        deadline = time.monotonic() + 30
        while log.read_text().count("Prompt processing progress") == progress:  # prefill
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)  # decoding
    _cancelled_within_a_second(log, before)
    assert json.loads(_get(port, "/health")[1]) == {"status": "ok"}


def test_a_long_prefill_streams_keepalive_comments(served: tuple[int, Path, int]) -> None:
    """mlx-lm's ``: keepalive n/m`` lines, one per prefill step, before the first token."""
    port, _, _ = served
    prompt = sample_text(400, seed=11)
    s, got = _stream(port, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 3, "stream": True})
    s.close()
    steps = [tuple(map(int, m)) for m in re.findall(rb": keepalive (\d+)/(\d+)\n\n", got)]
    assert len(steps) >= 2, got[:500]
    total = steps[0][1]
    assert all(t == total for _, t in steps) and steps[-1][0] == total
    assert [d for d, _ in steps] == sorted(d for d, _ in steps)
    assert got.index(b": keepalive") < got.index(b"data: ")


def test_left_out_mlx_lm_options_are_one_line_each(model: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_API_KEY"}
    for args, want in (
            (["--draft-model", str(model)], "--draft-model: speculative decoding is not "
             "implemented by kvstore serve (docs/CLI.md)"),
            (["--num-draft-tokens", "2"], "--num-draft-tokens: speculative decoding is not "
             "implemented by kvstore serve (docs/CLI.md)"),
            (["--kv-bits", "4"], "--kv-bits: a quantized KV cache is not implemented by "
             "kvstore serve (docs/CLI.md)")):
        p = subprocess.run([sys.executable, "-P", "-m", "kvstore", "serve", "--model",
                            str(model), "--root", str(tmp_path / "root"), *args],
                           capture_output=True, text=True, env=env, timeout=60)
        assert (p.returncode, p.stdout, p.stderr) == (2, "", f"kvstore: error: {want}\n")
    assert not (tmp_path / "root").exists()


# --- one request's failure, in process: a 500 in its API's shape, and the server goes on ----


class _Failing:
    """An engine whose jobs fail as ``how`` says: ``submit`` (it raises), ``events`` (the
    events raise after one token), else they answer one token and end."""

    def __init__(self) -> None:
        self.how = ""

    def healthy(self) -> bool:
        return True

    def submit(self, job: Any) -> Any:
        from kvstore.server.engine import Done, Token

        if self.how == "submit":
            raise RuntimeError("boom in submit")
        how = self.how

        class Handle:
            def cancel(self, reason: str = "cancelled") -> None:
                pass

            async def batches(self, idle: float | None) -> Any:
                yield [Token(id=5, text="hi")]
                if how == "events":
                    raise RuntimeError("boom in events")
                yield [Done(finish="length", prompt_tokens=len(job.prompt), cached_tokens=0,
                            generated=1)]

        return Handle()


@pytest.fixture(scope="module")
def in_process(model: Path) -> Iterator[tuple[Any, _Failing]]:
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from starlette.testclient import TestClient

    from kvstore.server.app import App, Settings
    from kvstore.server.openai import Served
    from kvstore.serving.templates import Abilities

    tok = load_tokenizer(model)
    served = Served(model_id="tiny-llama", aliases={"tiny-llama"}, tokenizer=tok,
                    vocab_size=len(tok.vocab), context_length=4096,
                    abilities=Abilities(tools=False, mid_system=True),
                    defaults={"temp": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                              "max_tokens": 8, "chat_template_args": {}})
    engine = _Failing()
    app = App(engine, served, None, Settings(port=80))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        yield client, engine


@pytest.mark.parametrize("how", ["submit", "events"])
def test_a_failure_inside_one_request_is_a_500_in_its_apis_shape_and_the_next_is_answered(
        in_process: tuple[Any, _Failing], how: str) -> None:
    client, engine = in_process
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    message = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    engine.how = how
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    assert f"RuntimeError: boom in {how}" in r.json()["error"]["message"]
    r = client.post("/v1/messages", json=message)
    assert r.status_code == 500 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "api_error"
    assert f"RuntimeError: boom in {how}" in r.json()["error"]["message"]
    if how == "events":  # after the stream began: its last event says so
        lines = client.post("/v1/chat/completions", json={**chat, "stream": True}).text
        last = json.loads(lines.strip().splitlines()[-1][len("data: "):])
        assert last["error"]["message"] == "RuntimeError: boom in events"
        text = client.post("/v1/messages", json={**message, "stream": True}).text
        assert "event: error" in text and "boom in events" in text
    engine.how = ""
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hi"


def test_another_tenants_short_request_is_answered_while_a_long_one_streams(
        served: tuple[int, Path, int]) -> None:
    """Issue 43: salts do not serialize the batch; a tenant's long generation holds up
    another tenant's short request by at most a step or two."""
    port, log, _ = served
    s, _ = _stream(port, "/v1/chat/completions", {
        "messages": USER, "cache_salt": "tenant-a", **LONG})
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        t0 = time.monotonic()
        c.request("POST", "/v1/chat/completions", body=json.dumps({
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "cache_salt": "tenant-b"}), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        body = json.loads(r.read())
        assert r.status == 200 and body["usage"]["completion_tokens"] == 2
        assert time.monotonic() - t0 < 2.0
        c.close()
        assert s.recv(65536)  # the long one still streams
    finally:
        s.close()
