"""The protocol adapters of ``kvstore.serving`` without a server: a tool call as mlx-lm's
chat path streams it (made by mlx-lm's own tool-call formatter and JSON tool parser) comes
back as an Anthropic ``tool_use`` block and a Responses ``function_call`` item, parsed and
accumulated by the official SDKs' own types and stream state; ``cache_control`` rides on
the chat request as the breakpoints' consumer expects, and the seam strips it before the
template sees it."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from mlx_lm.server import ToolCallFormatter
from mlx_lm.tool_parsers.json_tools import parse_tool_call

from kvstore.mlx_lm.cache_control import take_breakpoints
from kvstore.server.app import carry_cache_control
from kvstore.serving import anthropic_messages, responses
from kvstore.serving.chat import (
    ApiError,
    CacheUsage,
    Chunk,
    Finish,
    Progress,
    TextPart,
    decode_chunk,
)

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

USAGE = CacheUsage(prompt_tokens=100, reused_tokens=60, created_tokens=30, output_tokens=9)
CALL = '{"name": "read_file", "arguments": {"path": "kvstore/index/lmdb_index.py"}}'
TOOLS = [{"name": "read_file", "input_schema": {"type": "object", "properties": {
    "path": {"type": "string"}}}}]


def _chunks() -> list[Chunk]:
    """The chunks mlx-lm's chat path streams for "Let me look." and then one tool call."""
    calls = ToolCallFormatter(parse_tool_call, TOOLS, streaming=True)([CALL])
    raw = [{"choices": [{"index": 0, "finish_reason": None,
                         "delta": {"role": "assistant", "content": "Let me look."}}]},
           {"choices": [{"index": 0, "finish_reason": None,
                         "delta": {"role": "assistant", "tool_calls": calls}}]},
           {"choices": [{"index": 0, "finish_reason": "tool_calls",
                         "delta": {"role": "assistant"}}]}]
    return [decode_chunk(json.dumps(c).encode()) for c in raw]


def _events(data: bytes) -> list[tuple[str | None, Any]]:
    out = []
    for block in data.decode().split("\n\n"):
        if not block.strip():
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines.get("event"), json.loads(lines["data"])))
    return out


def _messages_exchange(stream: bool) -> anthropic_messages.MessagesExchange:
    return anthropic_messages.parse(json.dumps({
        "model": "local", "max_tokens": 64, "stream": stream, "tools": TOOLS,
        "messages": [{"role": "user", "content": "Where is the index?"}]}).encode())


def test_a_tool_call_streams_as_a_tool_use_block_the_sdk_accumulates() -> None:
    from anthropic.lib.streaming._messages import accumulate_event
    from anthropic.types import RawMessageStreamEvent
    from pydantic import TypeAdapter

    ex = _messages_exchange(stream=True)
    data = ex.start(USAGE) + b"".join(ex.event(c) for c in _chunks()) + \
        ex.finish(Finish("tool_calls", USAGE))
    adapter: Any = TypeAdapter(RawMessageStreamEvent)
    snapshot = None
    bufs: dict[int, bytes] = {}
    kinds = []
    for name, payload in _events(data):
        assert name == payload["type"]
        kinds.append(name)
        if name == "ping":
            continue
        snapshot = accumulate_event(event=adapter.validate_python(payload),
                                    current_snapshot=snapshot, json_bufs=bufs)
    assert kinds == ["message_start", "ping", "content_block_start", "content_block_delta",
                     "content_block_stop", "content_block_start", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]
    assert snapshot is not None and snapshot.stop_reason == "tool_use"
    text, call = snapshot.content
    assert text.type == "text" and text.text == "Let me look."
    assert call.type == "tool_use" and call.name == "read_file"
    assert call.input == {"path": "kvstore/index/lmdb_index.py"}
    assert call.id.startswith("toolu_")
    u = snapshot.usage
    assert (u.input_tokens, u.cache_read_input_tokens, u.cache_creation_input_tokens,
            u.output_tokens) == (10, 60, 30, 9)


def test_a_tool_call_is_a_tool_use_block_of_the_message() -> None:
    ex = _messages_exchange(stream=False)
    assert ex.start(USAGE) == b""
    assert all(ex.event(c) == b"" for c in _chunks())
    msg = anthropic.types.Message.model_validate_json(ex.finish(Finish("tool_calls", USAGE)))
    assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["text",
                                                                            "tool_use"]
    assert msg.content[1].input == {"path": "kvstore/index/lmdb_index.py"}
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens \
        + msg.usage.cache_creation_input_tokens == USAGE.prompt_tokens


def test_a_tool_call_streams_as_a_function_call_item_the_sdk_completes() -> None:
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    ex = responses.parse(json.dumps({
        "model": "local", "input": "Where is the index?", "stream": True,
        "tools": [{"type": "function", "name": "read_file",
                   "parameters": TOOLS[0]["input_schema"]}]}).encode(),
        responses.ResponseStore())
    data = ex.start(USAGE) + b"".join(ex.event(c) for c in _chunks()) + \
        ex.finish(Finish("tool_calls", USAGE))
    state: Any = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    adapter: Any = TypeAdapter(ResponseStreamEvent)
    seqs = []
    for name, payload in _events(data):
        assert name == payload["type"]
        seqs.append(payload["sequence_number"])
        state.handle_event(adapter.validate_python(payload))
    assert seqs == list(range(len(seqs)))
    done = state._completed_response
    assert done is not None and done.status == "completed"
    message, call = done.output
    assert message.type == "message" and done.output_text == "Let me look."
    assert call.type == "function_call" and call.name == "read_file"
    assert json.loads(call.arguments) == {"path": "kvstore/index/lmdb_index.py"}
    assert done.usage.input_tokens == 100 and done.usage.input_tokens_details.cached_tokens == 60
    # kept for previous_response_id: the call, in the conversation's next request
    nxt = responses.parse(json.dumps({
        "model": "local", "previous_response_id": ex.id, "input": [
            {"type": "function_call_output", "call_id": call.call_id, "output": "ok"}]}
    ).encode(), ex.store)
    roles = [(m.role, m.tool_calls[0].id if m.tool_calls else m.tool_call_id)
             for m in nxt.chat.messages]
    assert roles == [("user", None), ("assistant", call.call_id), ("tool", call.call_id)]


def test_cache_control_rides_on_parts_and_body_and_is_stripped_before_templating() -> None:
    ex = anthropic_messages.parse(json.dumps({
        "model": "local", "max_tokens": 8, "cache_control": {"type": "ephemeral"},
        "system": [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral",
                                                                    "ttl": "1h"}}],
        "tools": [{**TOOLS[0], "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b", "cache_control": {
                                             "type": "ephemeral", "ttl": "5m"}}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name":
                                               "read_file", "input": {}, "cache_control": {
                                                   "type": "ephemeral"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": "x", "cache_control": {
                                              "type": "ephemeral"}}]}]}).encode())
    body = ex.chat.body()
    assert body["cache_control"] == {"type": "ephemeral"}
    sys_msg, user, assistant, tool = body["messages"]
    assert sys_msg["content"] == [{"type": "text", "text": "sys",
                                   "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    assert user["content"] == [{"type": "text", "text": "a"},
                               {"type": "text", "text": "b",
                                "cache_control": {"type": "ephemeral", "ttl": "5m"}}]
    assert assistant["tool_calls"][0]["cache_control"] == {"type": "ephemeral"}
    assert tool["content"] == [{"type": "text", "text": "x",
                                "cache_control": {"type": "ephemeral"}}]
    assert body["tools"][0]["cache_control"] == {"type": "ephemeral"}
    carried = carry_cache_control(body)
    assert "cache_control" not in assistant["tool_calls"][0]
    assert assistant["cache_control"] == {"type": "ephemeral"}  # the call ends the message
    with pytest.raises(ValueError, match="A maximum of 4 blocks with cache_control"):
        take_breakpoints(json.loads(json.dumps(carried)))  # six marks: Anthropic allows 4
    del carried["cache_control"], carried["tools"][0]["cache_control"]
    marks = take_breakpoints(carried)  # what the breakpoint hook reads, and takes out
    assert [(b.ttl, b.message, b.part) for b in marks] == [
        (3600.0, 0, 0), (300.0, 1, 1), (300.0, 2, None), (300.0, 3, 0)]
    assert "cache_control" not in json.dumps(carried)


@pytest.mark.parametrize(("body", "message"), [
    ({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {}}]}]},
     "document content is not supported: the model served has no vision tower "
     "(messages[0].content[0])"),
    ({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "n", "input": {}}]}]},
     "messages[0].content[0]: a tool_use block belongs to an assistant message"),
    ({"model": "m", "max_tokens": 1, "tool_choice": {"type": "tool"},
      "messages": [{"role": "user", "content": "x"}]},
     "tool_choice.name: required when tool_choice.type is 'tool'"),
    ({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}] * 100_001},
     "Expected `array` of length <= 100000 - at `$.messages`"),
])
def test_bad_messages_requests_are_400s_that_say_why(body: dict[str, Any], message: str
                                                     ) -> None:
    with pytest.raises(ApiError) as e:
        anthropic_messages.parse(msgspec.json.encode(body))
    assert (e.value.status, e.value.kind, e.value.message) == (400, "invalid_request_error",
                                                               message)


def _reasoning_chunks() -> list[Chunk]:
    """Reasoning, then the reply's text, as the chat path streams a thinking model's turn."""
    raw = [{"choices": [{"index": 0, "finish_reason": None,
                         "delta": {"role": "assistant", "reasoning": "The index is LMDB."}}]},
           {"choices": [{"index": 0, "finish_reason": None,
                         "delta": {"role": "assistant", "reasoning": " Say so.",
                                   "content": "In LMDB."}}]},
           {"choices": [{"index": 0, "finish_reason": "stop", "delta": {"role": "assistant"}}]}]
    return [decode_chunk(json.dumps(c).encode()) for c in raw]


def test_reasoning_streams_as_a_thinking_block_then_text() -> None:
    from anthropic.lib.streaming._messages import accumulate_event
    from anthropic.types import RawMessageStreamEvent
    from pydantic import TypeAdapter

    ex = _messages_exchange(stream=True)
    data = ex.start(USAGE) + b"".join(ex.event(c) for c in _reasoning_chunks()) + \
        ex.finish(Finish("stop", USAGE))
    adapter: Any = TypeAdapter(RawMessageStreamEvent)
    snapshot = None
    bufs: dict[int, bytes] = {}
    deltas = []
    for name, payload in _events(data):
        if name == "ping":
            continue
        if name == "content_block_delta":
            deltas.append(payload["delta"]["type"])
        snapshot = accumulate_event(event=adapter.validate_python(payload),
                                    current_snapshot=snapshot, json_bufs=bufs)
    assert deltas == ["thinking_delta", "thinking_delta", "text_delta"]
    assert snapshot is not None and snapshot.stop_reason == "end_turn"
    thinking, text = snapshot.content
    assert thinking.type == "thinking" and thinking.thinking == "The index is LMDB. Say so."
    assert text.type == "text" and text.text == "In LMDB."
    # sent back in the next request's history, it is the reasoning the template renders
    nxt = anthropic_messages.parse(json.dumps({
        "model": "local", "max_tokens": 8, "messages": [
            {"role": "user", "content": "Where is the index?"},
            {"role": "assistant", "content": [b.model_dump() for b in snapshot.content]},
            {"role": "user", "content": "Thanks."}]}).encode())
    assistant = nxt.chat.messages[1]
    assert assistant.reasoning_content == "The index is LMDB. Say so."
    assert assistant.content == [TextPart("In LMDB.")]  # a block is a part


def test_reasoning_is_a_reasoning_item_of_the_response() -> None:
    ex = responses.parse(json.dumps({"model": "local", "input": "Where is the index?"}).encode(),
                         responses.ResponseStore())
    for c in _reasoning_chunks():
        assert ex.event(c) == b""
    resp = openai.types.responses.Response.model_validate_json(
        ex.finish(Finish("stop", USAGE)))
    assert [o.type for o in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == "The index is LMDB. Say so."
    assert resp.output_text == "In LMDB." and resp.status == "completed"


def test_the_response_store_is_bounded_and_keyed_by_salt() -> None:
    from kvstore.serving.chat import ChatMessage

    store = responses.ResponseStore(max_items=3, max_bytes=10_000)
    conv = [ChatMessage("user", "x" * 100)]
    for i in range(5):
        store.put(f"r{i}", None, conv)
    assert len(store) == 3
    with pytest.raises(ApiError) as e:
        store.get("r1", None)
    assert (e.value.status, e.value.message) == (404, "Previous response with id 'r1' not "
                                                 "found.")
    assert store.get("r4", None) == conv
    with pytest.raises(ApiError):
        store.get("r4", "another tenant")
    store.put("big", None, [ChatMessage("user", "y" * 4000)])
    store.put("big2", None, [ChatMessage("user", "y" * 4000)])
    store.put("big3", None, [ChatMessage("user", "y" * 4000)])
    assert len(store) == 2  # 10,000 bytes hold two of them
    store.put("huge", None, [ChatMessage("user", "z" * 20_000)])  # over the whole budget
    with pytest.raises(ApiError):
        store.get("huge", None)


def test_a_long_prefill_keeps_both_streams_alive() -> None:
    m = _messages_exchange(stream=True)
    assert m.event(Progress(512, 4096)) == b'event: ping\ndata: {"type":"ping"}\n\n'
    assert m.event(Progress(1024, 4096)) == b""  # at most one a second
    r = responses.parse(json.dumps({"model": "local", "input": "x", "stream": True}).encode(),
                        responses.ResponseStore())
    assert r.event(Progress(512, 4096)) == b": keepalive 512/4096\n\n"
    assert r.event(Progress(1024, 4096)) == b""


# --- the real clients' captured requests (tests/data/agents/, tests/agents/capture.py) ---

AGENTS = __import__("pathlib").Path(__file__).resolve().parent / "data" / "agents"


def _captured(prefix: str) -> list[tuple[str, bytes]]:
    files = sorted(AGENTS.glob(f"{prefix}-*.json"))
    return [(f.name, f.read_bytes()) for f in files if not f.name.endswith("-usage.json")]


def test_every_claude_code_request_is_accepted_as_sent() -> None:
    """Claude Code 2.1.332: its environment as a system message after the first user
    message, thinking adaptive and omitted, context_management, output_config.effort,
    metadata.user_id as a JSON string, twelve tools of which one is deferred."""
    captured = _captured("claude-code-2.1.332")
    assert len(captured) >= 5
    for name, raw in captured:
        body = json.loads(raw)
        assert body["thinking"] == {"type": "adaptive", "display": "omitted"}, name
        assert isinstance(body["metadata"]["user_id"], str) and "context_management" in body
        ex = anthropic_messages.parse(raw)
        chat = ex.chat
        roles = [m.role for m in chat.messages]
        sent = ["system"] + [m["role"] for m in body["messages"]]
        # the system message stays where it was sent, and says what it said
        i = sent.index("system", 1)
        assert roles[i] == "system", (name, roles)
        text = body["messages"][i - 1]["content"]
        text = text if isinstance(text, str) else "".join(b["text"] for b in text)
        content = chat.messages[i].content
        assert (content if isinstance(content, str) else "".join(p.text for p in content)) \
            == text
        # the deferred placeholder is left out of the prompt; every other tool is in it
        deferred = [t["name"] for t in body["tools"] if t.get("defer_loading")]
        assert deferred == ["DeferredToolPlaceholder"]
        assert [t.function.name for t in chat.tools or []] == [
            t["name"] for t in body["tools"] if not t.get("defer_loading")]
        assert chat.chat_template_kwargs == {"enable_thinking": True}
        assert chat.max_tokens == body["max_tokens"]


def test_every_codex_request_is_accepted_as_sent() -> None:
    """Codex 0.171.0: developer messages, a namespace tool and web_search (left out of the
    prompt), include, prompt_cache_key, client_metadata, store false, no
    max_output_tokens (the server's --max-tokens applies)."""
    captured = _captured("codex-0.171.0")
    assert len(captured) >= 5
    for name, raw in captured:
        body = json.loads(raw)
        assert body["include"] == ["reasoning.encrypted_content"] and body["prompt_cache_key"]
        ex = responses.parse(raw, responses.ResponseStore())
        chat = ex.chat
        assert chat.max_tokens is None, name
        assert chat.messages[0].role == "system"  # the developer messages, one system
        assert all(m.role != "system" for m in chat.messages[1:])
        kinds = {t["type"] for t in body["tools"]}
        assert {"function", "namespace", "web_search"} <= kinds
        assert [t.function.name for t in chat.tools or []] == [
            t["name"] for t in body["tools"] if t["type"] == "function"]


def test_the_claude_code_request_is_the_same_chat_request_with_and_without_its_marks() -> None:
    """The adapter makes one chat request of the blocks whether or not they are marked:
    only the marks differ (they are read and taken out before the template)."""
    raw = (AGENTS / "claude-code-2.1.332-a1-2.json").read_text()

    def unmarked(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: unmarked(x) for k, x in v.items() if k != "cache_control"}
        return [unmarked(x) for x in v] if isinstance(v, list) else v

    marked = carry_cache_control(anthropic_messages.parse(raw.encode()).chat.body())
    plain = carry_cache_control(anthropic_messages.parse(
        json.dumps(unmarked(json.loads(raw))).encode()).chat.body())
    marks = take_breakpoints(marked)  # the two system blocks after the billing line, the
    assert [(b.message, b.part) for b in marks] == [(0, 1), (0, 2), (4, 0)]  # last result
    assert marked == plain
