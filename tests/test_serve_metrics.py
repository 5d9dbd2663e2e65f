"""``kvstore serve`` as a service (issue 28), driven by the official ``openai`` client on a
tiny random-weight model: ``GET /metrics`` parsed with ``prometheus_client.parser`` against
the requests made, one log line per request, and ``stats --json`` against the server's own
``cached_tokens``, across a restart."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers.serving import free_port, server_process
from prometheus_client.parser import text_string_to_metric_families

from kvstore.tiny import make_tiny_model, sample_text

openai = pytest.importorskip("openai")

@dataclass
class Server:
    port: int
    client: Any
    log: Path
    metrics_port: int = 0

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of ``GET /metrics``, parsed by prometheus_client's own parser."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                    timeout=30) as r:
            assert r.headers["Content-Type"].startswith("text/plain")
            text = r.read().decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out


@contextmanager
def _server(model: Path, root: Path, log: Path, *more: str) -> Iterator[Server]:
    mport = free_port()
    with server_process("kvstore.serve", ["--root", str(root), "--min-tokens", "16",
                                          "--model", str(model), "--log-level", "INFO",
                                          "--metrics-port", str(mport), *more],
                        log) as (port, client):
        yield Server(port, client, log, mport)


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.slow
def test_metrics_are_not_on_the_api_port_unless_asked(tmp_path: Path) -> None:
    """Issue 36, item 5: ``/metrics`` tells whoever reads it what the root holds and
    writes (a tenant learns what others stored); the API's clients do not get it unless
    the operator asks (``--metrics-on-api-port``). ``--metrics-port`` serves it apart,
    on 127.0.0.1 unless told otherwise."""
    model = make_tiny_model(tmp_path / "model", "llama")
    with _server(model, tmp_path / "root", tmp_path / "apart.log") as s:
        assert _get(s.port, "/metrics")[0] == 404
        assert _get(s.port, "/health")[0] == 200  # the API itself answers
        code, body = _get(s.metrics_port, "/metrics")
        assert code == 200 and b"\nkvstore_written_bytes_total " in body
        assert _get(s.metrics_port, "/v1/models")[0] == 404  # the metrics port: metrics only
    with server_process("kvstore.serve", ["--root", str(tmp_path / "root"), "--model",
                                          str(model), "--metrics-on-api-port"],
                        tmp_path / "api.log") as (port, _):
        code, body = _get(port, "/metrics")
        assert code == 200 and b"\nkvstore_written_bytes_total " in body


def _ask(server: Server, history: list[dict[str, str]], user: str) -> tuple[int, int]:
    """One chat turn (the whole history, as chat clients send it); its prompt and cached
    token counts as the server reported them."""
    history.append({"role": "user", "content": user})
    r = server.client.chat.completions.create(model="default_model", messages=history,
                                              temperature=0.0, max_tokens=6)
    history.append({"role": "assistant", "content": r.choices[0].message.content})
    details = r.usage.prompt_tokens_details
    return r.usage.prompt_tokens, (details.cached_tokens or 0) if details else 0


def _lines(log: Path) -> list[dict[str, str]]:
    out = []
    for line in log.read_text().splitlines():
        if m := re.search(r"kvstore request (.*)$", line):
            out.append(dict(kv.split("=", 1) for kv in m.group(1).split(" ")))
    return out


def _stats(root: Path) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "kvstore", "--root", str(root), "stats",
                           "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def _settled(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The metrics once no snapshot is queued or being written (deferred ones may wait)."""
    deadline = time.monotonic() + 60
    while True:
        m = server.metrics()
        if m[("kvstore_save_queue_snapshots", (("state", "queued"),))] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.2)


def test_metrics_log_lines_and_stats_match_the_requests_made(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", "llama")
    root = tmp_path / "root"
    system = sample_text(400, seed=5)
    a: list[dict[str, str]] = [{"role": "system", "content": system}]
    b: list[dict[str, str]] = [{"role": "system", "content": system}]
    made: list[tuple[int, int]] = []
    with _server(model, root, tmp_path / "first.log") as srv:
        for user in ("Which planet is closest to the sun?", "And the farthest?", "Thanks."):
            made.append(_ask(srv, a, user))
        made.append(_ask(srv, b, "What colour is the sky?"))  # another user: the system prompt
        m = _settled(srv)
    prompts = sum(p for p, _ in made)
    cached = sum(c for _, c in made)
    assert made[0][1] == 0 and all(c > 0 for _, c in made[1:]), made

    def val(name: str, **labels: str) -> float:
        return m[(name, tuple(sorted(labels.items())))]

    # every request is counted once, by the tier that gave its tokens: here all from memory
    assert val("kvstore_requests_total", source="none") == 1
    assert val("kvstore_requests_total", source="memory") == 3
    assert val("kvstore_requests_total", source="local") == 0
    assert val("kvstore_requests_total", source="remote") == 0
    assert val("kvstore_prompt_tokens_total", source="memory") == cached
    assert val("kvstore_prompt_tokens_total", source="computed") == prompts - cached
    assert val("kvstore_prompt_tokens_total", source="local") == 0
    assert val("kvstore_miss_reasons_total", reason="no_entry") == 1
    assert sum(v for (n, _), v in m.items() if n == "kvstore_miss_reasons_total") == 1
    assert val("kvstore_restore_seconds_count", source="none") == 1
    assert val("kvstore_restore_seconds_count", source="memory") == 3
    assert val("kvstore_saves_total", outcome="failed") == 0
    assert val("kvstore_saves_total", outcome="dropped") == 0
    saved = val("kvstore_saves_total", outcome="saved")
    assert saved >= 1 and val("kvstore_save_seconds_count") == saved
    # a fresh root: what the saves wrote is what the root holds, and what it adds up to
    written = val("kvstore_written_bytes_total")
    assert written == val("kvstore_root_bytes", kind="physical") > 0
    assert val("kvstore_write_amplification_ratio") == pytest.approx(
        written / val("kvstore_kv_added_bytes_total"))
    assert val("kvstore_root_entries") == saved
    assert val("kvstore_quarantined_blocks") == 0 and val("kvstore_evictions_total") == 0
    assert val("kvstore_remote_errors_total") == 0
    assert val("kvstore_remote_refused_total") == 0

    # one log line per request, in order, with the server's own counts
    lines = _lines(tmp_path / "first.log")
    assert [(int(x["prompt"]), int(x["reused"])) for x in lines] == made
    assert [x["source"] for x in lines] == ["none", "memory", "memory", "memory"]
    assert lines[0]["miss"] == "no_entry" and {x["miss"] for x in lines[1:]} == {"-"}
    for x in lines:
        assert int(x["computed"]) == int(x["prompt"]) - int(x["reused"])
        assert int(x["memory"]) == (int(x["reused"]) if x["source"] == "memory" else 0)
        assert x["reply"] in ("queued", "deferred") and float(x["restore_ms"]) >= 0

    # a restarted server: the conversation continues from the root (the first one wrote
    # its deferred snapshots at exit)
    with _server(model, root, tmp_path / "second.log") as srv:
        again = _ask(srv, a, "One more question?")
        m2 = srv.metrics()
    assert again[1] >= made[2][0], (again, made)  # all of the third turn's prompt, at least
    assert m2[("kvstore_requests_total", (("source", "local"),))] == 1
    assert m2[("kvstore_prompt_tokens_total", (("source", "local"),))] == again[1]
    (line,) = _lines(tmp_path / "second.log")
    assert (line["source"], int(line["local"]), line["miss"]) == ("local", again[1], "-")

    # the root's counts: the sums of the server's own cached_tokens, per tier
    life = _stats(root)["requests"]["lifetime"]
    assert life["requests"] == 5 and life["prompt_tokens"] == prompts + again[0]
    assert life["tiers"]["memory"] == {"requests": 3, "tokens": cached}
    assert life["tiers"]["local"] == {"requests": 1, "tokens": again[1]}
    assert life["tiers"]["remote"] == {"requests": 0, "tokens": 0}
    assert life["reused_tokens"] == cached + again[1]
    assert life["misses"] == 1 and life["miss_reasons"]["no_entry"] == 1
