"""``tools/bench_agents.py`` reads its figures right: the time to first token is the event
that carries the model's output in each API's stream, not a ping, a keepalive comment or a
role-only chunk sent during the prefill; the request log's fields are read as written. In
the default suite: recorded streams, no server."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from recorder import Exchange

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_agents.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_agents", TOOL)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_agents"] = mod
    spec.loader.exec_module(mod)
    return mod


def _sse(name: str | None, data: Any) -> bytes:
    head = f"event: {name}\n" if name else ""
    body = data if isinstance(data, str) else json.dumps(data)
    return f"{head}data: {body}\n\n".encode()


def _exchange(path: str, pieces: list[tuple[float, bytes]], ended: float) -> Exchange:
    """An answer that came in ``pieces``, each at its time (seconds from the request)."""
    ex = Exchange("POST", path, {}, b"{}", 0.0, status=200, ended=ended)
    for when, piece in pieces:
        ex.answer += piece
        ex.arrivals.append((when, len(ex.answer)))
    ex.first_byte = pieces[0][0] if pieces else None
    return ex


def test_anthropic_first_token_is_the_first_content_block_not_a_ping(bench: ModuleType) -> None:
    ex = _exchange("/v1/messages?beta=true", [
        (0.1, _sse("message_start", {"type": "message_start", "message": {}})
         + _sse("ping", {"type": "ping"})),
        (30.0, _sse("ping", {"type": "ping"})),
        (45.5, _sse("content_block_start", {"type": "content_block_start", "index": 0,
                                            "content_block": {"type": "text", "text": ""}})
         + _sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                        "delta": {"type": "text_delta", "text": "Done."}})),
        (45.6, _sse("message_delta", {"type": "message_delta", "usage": {}})
         + _sse("message_stop", {"type": "message_stop"})),
    ], ended=45.7)
    assert bench.first_token(ex) == 45.5


def test_responses_first_token_is_the_first_output_item_not_a_keepalive(
        bench: ModuleType) -> None:
    ex = _exchange("/v1/responses", [
        (0.05, _sse("response.created", {"type": "response.created"})),
        (0.06, _sse("response.in_progress", {"type": "response.in_progress"})),
        (15.0, b": keepalive\n\n"),
        (20.0, b": keepalive\n\n"),
        (21.25, _sse("response.output_item.added", {"type": "response.output_item.added"})),
        (21.3, _sse("response.completed", {"type": "response.completed"})),
    ], ended=21.3)
    assert bench.first_token(ex) == 21.25


def test_chat_first_token_is_the_first_delta_with_content_not_the_role(
        bench: ModuleType) -> None:
    chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}}]}
    role = json.loads(json.dumps(chunk))
    role["choices"][0]["delta"] = {"role": "assistant", "content": ""}
    text = json.loads(json.dumps(chunk))
    text["choices"][0]["delta"] = {"content": "Done."}
    ex = _exchange("/v1/chat/completions", [
        (0.2, _sse(None, role)),
        (5.0, b": keepalive\r\n\r\n"),
        (12.5, _sse(None, text)),
        (12.6, _sse(None, "[DONE]")),
    ], ended=12.6)
    assert bench.first_token(ex) == 12.5


def test_an_answer_not_streamed_has_its_first_token_at_its_end(bench: ModuleType) -> None:
    ex = _exchange("/v1/messages", [(3.0, b'{"type": "message", "content": []}')], ended=3.5)
    assert bench.first_token(ex) == 3.5


def test_request_lines(bench: ModuleType) -> None:
    log = ("2026-01-01 00:00:00,000 - INFO - Prompt Cache: 0 sequences\n"
           "2026-01-01 00:00:01,000 - INFO - kvstore request id=3 model=m prompt=29772 "
           "reused=29743 source=memory computed=29 part_ours=\"a b\" part=-\n"
           "2026-01-01 00:00:02,000 - INFO - kvstore request id=1 prompt=16 reused=0 "
           "source=none\n")
    assert bench.request_lines(log) == [
        {"id": "3", "model": "m", "prompt": "29772", "reused": "29743", "source": "memory",
         "computed": "29", "part_ours": "a b", "part": "-"},
        {"id": "1", "prompt": "16", "reused": "0", "source": "none"}]


def test_the_tables_of_a_run_are_printed_again_from_its_json(bench: ModuleType) -> None:
    Turn, Request = bench.Turn, bench.Request
    store = [Turn("1", 46.88, True, [Request(29702, 0, "none", 45.8, 45.84, 200),
                                     Request(29770, 29706, "memory", 0.34, 0.36, 200)]),
             Turn("3", 0.97, True, [Request(29819, 29795, "local", 0.31, 0.34, 200)])]
    none = [Turn("1", 92.09, True, [Request(29703, 0, "none", 45.85, 45.9, 200),
                                    Request(29771, 0, "none", 45.56, 45.58, 200)]),
            Turn("3", 45.64, False, [Request(29820, 0, "-", 44.92, 44.94, 200)])]
    report = {"shape": {"layers": 2, "hidden": 64, "heads": 2, "kv_heads": 1,
                        "intermediate": 128},
              "baseline": "X=1 --prompt-cache-size 0", "load_start": [1.96, 2.0, 2.0],
              "load_end": [2.35, 2.0, 2.0],
              "clients": {"claude": {"store": [bench.asdict(t) for t in store],
                                     "none": [bench.asdict(t) for t in none]}}}
    text = bench.tables(json.loads(json.dumps(report)))
    assert text.splitlines()[0] == (
        "Model: 2 layers, hidden 64, 2 heads of 32, 1 KV head, MLP 128. Baseline: "
        "`X=1 --prompt-cache-size 0`. Load average 1.96 at the start, 2.35 at the end.")
    rows = [line for line in text.splitlines() if line.startswith("| ")][1:]
    assert rows == [
        "| 1, calls a tool | 1 | 29,702/29,703 | 0 (0.0%) | 0 (0.0%) | 45.80 s | 45.85 s"
        " |  |  |",
        "|  | 2 | 29,770/29,771 | 29,706 (99.8%, memory) | 0 (0.0%) | 0.34 s | 45.56 s | "
        "46.88 s | 92.09 s |",
        "| 3, restarted, resumes (the client failed: none) | 1 | 29,819/29,820 | "
        "29,795 (99.9%, local) | 0 (0.0%) | 0.31 s | 44.92 s | 0.97 s | 45.64 s |",
        "| all turns | | | | | | | 47.85 s | 137.73 s |"]
