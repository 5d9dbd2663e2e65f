"""Issue 29, item 6: ``kvstore serve`` answers within its remote deadline while the gateway
is 3 s slow (a proxy on 127.0.0.1 in front of the real gateway), driven by the real
``openai`` client on a tiny random-weight model; the entry it could not pull in time is
pulled in the background and the next server restores it from its own root."""

from __future__ import annotations

import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers.serving import server_process
from helpers.slowproxy import SlowProxy, wait_until
from prometheus_client.parser import text_string_to_metric_families

from kvstore.remote import Remote
from kvstore.tiny import make_tiny_model, sample_text

openai = pytest.importorskip("openai")

DEADLINE = 1.0
SLOW = 3.0


@dataclass
class Server:
    port: int
    client: Any

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as r:
            text = r.read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and not s.labels:
                    return float(s.value)
        raise AssertionError(f"no {name} in /metrics")

    def ask(self, system: str, user: str) -> tuple[str, int, float]:
        """One chat request: its answer, its cached tokens and its wall time."""
        t0 = time.monotonic()
        r = self.client.chat.completions.create(
            model="default_model", temperature=0.0, max_tokens=8,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": user}])
        took = time.monotonic() - t0
        details = r.usage.prompt_tokens_details
        return r.choices[0].message.content, (details.cached_tokens or 0) if details else 0, took


@contextmanager
def _server(args: list[str], log: Path, endpoint: str) -> Iterator[Server]:
    with server_process("kvstore.serve", [*args, "--log-level", "INFO",
                                          "--metrics-on-api-port"], log,
                        env={**os.environ, "AWS_ENDPOINT_URL": endpoint},
                        stop_timeout=90) as (port, client):
        yield Server(port, client)


@pytest.mark.slow
def test_serve_answers_within_its_deadline_while_the_gateway_is_slow(
        tmp_path: Path, url: str, endpoint: str) -> None:
    model = make_tiny_model(tmp_path / "model", "llama")
    system = sample_text(500, seed=11)
    q1, q2 = "Which planet is closest to the sun?", "What is the capital of France?"
    common = ["--model", str(model), "--remote", url, "--remote-deadline", str(DEADLINE)]
    with _server([*common, "--root", str(tmp_path / "a"), "--min-tokens", "16"],
                 tmp_path / "a.log", endpoint) as a:
        a1, _, computed = a.ask(system, q1)  # the first request: the slowest one of a
        a2, _, _ = a.ask(system, q2)
    r = Remote(url)
    try:
        assert list(r.client.list(r.prefix + "exact/")), "a pushed nothing"
    finally:
        r.close()
    margin = computed + 1.0  # the model's own work, HTTP, a loaded machine
    # b saves nothing itself (--min-tokens): what its root holds is what it pulled
    b_args = [*common, "--root", str(tmp_path / "b"), "--min-tokens", "100000"]
    with SlowProxy(endpoint, delay=SLOW) as proxy:
        with _server(b_args, tmp_path / "b.log", proxy.url) as b:
            got, cached, took = b.ask(system, q1)
            assert (got, cached) == (a1, 0)
            assert took < DEADLINE + margin, (took, margin)
            assert b.metric("kvstore_remote_deadline_misses_total") >= 1
            wait_until(lambda: b.metric("kvstore_remote_pulls_total") == 1, 180,
                       "the background pull")
            assert b.metric("kvstore_remote_errors_total") == 0
        assert proxy.requests > 0
        with _server(b_args, tmp_path / "b.log", proxy.url) as b:  # a new process
            got, cached, took = b.ask(system, q2)
            assert got == a2 and cached > 500, (got, cached)
            assert took < DEADLINE + margin, (took, margin)
    log = (tmp_path / "b.log").read_text()
    lines = re.findall(r"kvstore request .* source=(\S+) .* miss=(\S+)", log)
    # the remote not heard within the deadline, then restored from b's own root
    assert lines == [("none", "remote_timeout"), ("local", "-")], lines
    assert "past the 1 s remote deadline" in log
