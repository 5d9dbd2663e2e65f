"""What the real coding agents send, served: their captured requests (tests/data/agents/,
recorded from the pinned clients by tests/agents/capture.py) and the server's limits, names
and templates, against ``kvstore serve`` on 127.0.0.1 with a tiny random-weight model.

- A breakpoint never changes the prompt: Claude Code's request with its ``cache_control``
  marks and without them counts the same tokens, and the prefix rules fire on both.
- A marked, streamed ``/v1/messages`` request sends its first event as soon as an
  unmarked one (it waited 30 s), with the usage of the cache it wrote.
- ``--max-tokens`` binds every API; any model name is served; a template that renders no
  tools refuses requests with tools on every API (or drops them, when told); a template
  that cannot render a system message in the conversation's midst gets its fallback.
"""

from __future__ import annotations

import copy
import http.client
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.serving import server_process

from kvstore.tiny import CHAT_TEMPLATE, make_tiny_model

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

AGENTS = Path(__file__).resolve().parent / "data" / "agents"
CLAUDE = "claude-code-2.1.332"

#: Renders tools, tool calls and results, and a system message anywhere (ChatML).
TOOLS_TEMPLATE = (
    "{% if messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}"
    "{% if tools %}\n# Tools{% for t in tools %}\n{{ t | tojson }}{% endfor %}{% endif %}"
    "<|im_end|>\n{% elif tools %}<|im_start|>system\n# Tools{% for t in tools %}\n"
    "{{ t | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}]{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: The tiny model's ChatML, which renders no tools, refusing a system message after the
#: first one (as Gemma's and Mistral's templates do).
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
    "{% endfor %}" + CHAT_TEMPLATE
)


def _model(d: Path, template: str) -> Path:
    model = make_tiny_model(d, "llama", hidden_size=32, num_layers=1)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """A model that renders tools, on a server whose replies are at most 16 tokens."""
    tmp = tmp_path_factory.mktemp("agent-requests")
    model = _model(tmp / "model", TOOLS_TEMPLATE)
    log = tmp / "serve.log"
    with server_process("kvstore.serve", ["--root", str(tmp / "root"), "--min-tokens", "16",
                                          "--model", str(model), "--log-level", "INFO",
                                          "--max-tokens", "16"], log) as (port, _):
        yield port, log


def _claude(name: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads((AGENTS / f"{CLAUDE}-{name}.json").read_text())
    return body


def _unmarked(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _unmarked(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_unmarked(v) for v in value]
    return value


def _post(port: int, path: str, body: dict[str, Any], *, headers: dict[str, str] | None = None,
          timeout: float = 60.0) -> tuple[int, bytes, float | None]:
    """POST as Claude Code does (``?beta=true``, its beta headers); the status, the whole
    answer, and the seconds to its first event (streamed) or None."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.monotonic()
    conn.request("POST", path, body=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
                          "context-management-2025-06-27,effort-2025-11-24",
        **(headers or {})})
    r = conn.getresponse()
    first = None
    data = b""
    while chunk := r.read1(65536):
        if first is None and b"\n\n" in data + chunk:
            first = time.monotonic() - t0
        data += chunk
    conn.close()
    return r.status, data, first


def _events(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in data.decode().splitlines()
            if line.startswith("data: ")]


def _log_records(log: Path) -> list[dict[str, str]]:
    return [dict(re.findall(r"(\w+)=(\S+)", line.split("kvstore request ", 1)[1]))
            for line in log.read_text().splitlines() if "kvstore request " in line]


def _count(port: int, body: dict[str, Any]) -> int:
    status, data, _ = _post(port, "/v1/messages/count_tokens?beta=true", body)
    assert status == 200, data
    return int(json.loads(data)["input_tokens"])


# --- a breakpoint never changes the prompt ---------------------------------------------


def test_claude_codes_request_counts_the_same_with_and_without_its_breakpoints(
        served: tuple[int, Path]) -> None:
    port, log = served
    marked = _claude("a1-2")  # a tool call and its result, five marks, a system message
    assert "cache_control" in json.dumps(marked)
    plain = _unmarked(marked)
    n = _count(port, marked)
    assert n == _count(port, plain) > 20_000
    # served, both render that prompt, and the rules fire on both
    for body in (marked, plain):
        status, data, _ = _post(port, "/v1/messages?beta=true",
                                {**body, "stream": False, "max_tokens": 1})
        assert status == 200, data
        u = json.loads(data)["usage"]
        assert u["input_tokens"] + u["cache_read_input_tokens"] \
            + u["cache_creation_input_tokens"] == n
    a, b = _log_records(log)[-2:]
    assert a["prompt"] == b["prompt"] == str(n)
    assert "claude-billing-header:1" in a["rewrites"]
    assert "claude-billing-header:1" in b["rewrites"]


def test_a_marked_stream_starts_as_soon_as_an_unmarked_one_and_says_what_it_wrote(
        served: tuple[int, Path]) -> None:
    """Claude Code marks every request; each waited 30 s for a record it could not find."""
    port, log = served
    marked = {**_claude("b1-1"), "max_tokens": 4}
    plain = _unmarked(marked)
    n = _count(port, marked)
    status, data, first_plain = _post(port, "/v1/messages?beta=true", plain)
    assert status == 200 and first_plain is not None, data
    # the same conversation from another session's opening (a new prompt: nothing stored)
    fresh = copy.deepcopy(marked)
    fresh["messages"][0]["content"][-1]["text"] += " (again, marked)"
    status, data, first_marked = _post(port, "/v1/messages?beta=true", fresh, timeout=25)
    assert status == 200 and first_marked is not None, data
    assert first_marked < first_plain + 5.0, (first_marked, first_plain)
    events = _events(data)
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    usage = next(e["usage"] for e in events if e["type"] == "message_delta")
    rec = _log_records(log)[-1]
    assert rec["reply"] in ("queued", "deferred")  # its snapshot went to the store
    assert usage["cache_creation_input_tokens"] == int(rec["computed"]) > 0
    assert usage["cache_read_input_tokens"] == int(rec["reused"])
    assert sum(usage[k] for k in ("input_tokens", "cache_read_input_tokens",
                                  "cache_creation_input_tokens")) >= n


# --- the server's limits bind every API --------------------------------------------------


def test_max_tokens_is_every_apis_default_and_ceiling(served: tuple[int, Path]) -> None:
    port, log = served
    oai = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0,
                        timeout=60)
    claude = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="x",
                                 max_retries=0, timeout=60)
    r = oai.responses.create(model="local", input="Tell me a long story.", store=False)
    assert r.usage.output_tokens <= 16  # no max_output_tokens: the server's, not 32,768
    if r.usage.output_tokens == 16:
        assert r.status == "incomplete"
    c = oai.chat.completions.create(model="local", max_tokens=100, messages=[
        {"role": "user", "content": "Tell me a long story."}])
    assert c.usage.completion_tokens <= 16
    m = claude.messages.create(model="local", max_tokens=100, messages=[
        {"role": "user", "content": "Tell me a long story."}])
    assert m.usage.output_tokens <= 16
    if m.usage.output_tokens == 16:
        assert m.stop_reason == "max_tokens"
    said = log.read_text().count("a request asked for up to 100 tokens: it gets at most 16 "
                                 "(--max-tokens)")
    assert said == 2  # not silently


# --- any model name ------------------------------------------------------------------------


def test_any_model_name_is_served_on_every_api(served: tuple[int, Path]) -> None:
    port, _ = served
    oai = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0,
                        timeout=60)
    claude = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="x",
                                 max_retries=0, timeout=60)
    chat = oai.chat.completions.create(model="gpt-4o", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    assert chat.model == "gpt-4o" and chat.usage.completion_tokens >= 1
    text = oai.completions.create(model="gpt-3.5-turbo-instruct", prompt="Once upon",
                                  max_tokens=2)
    assert text.model == "gpt-3.5-turbo-instruct" and text.usage.completion_tokens >= 1
    msg = claude.messages.create(model="claude-sonnet-4-5", max_tokens=2,
                                 messages=[{"role": "user", "content": "hi"}])
    assert msg.model == "claude-sonnet-4-5"
    assert claude.messages.count_tokens(model="claude-opus-4-1", messages=[
        {"role": "user", "content": "hi"}]).input_tokens > 0
    resp = oai.responses.create(model="gpt-5-codex", input="hi", max_output_tokens=2,
                                store=False)
    assert resp.model == "gpt-5-codex"
    # the same prompt under two names is one prompt: the second reads it from the cache
    again = oai.chat.completions.create(model="another-name", max_tokens=2,
                                        messages=[{"role": "user", "content": "hi"}])
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


# --- templates that render no tools, or no system message in the midst ------------------


@pytest.fixture(scope="module")
def strict_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model(tmp_path_factory.mktemp("strict") / "model", STRICT_TEMPLATE)


TOOL = {"name": "read_file", "description": "Read a file.",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}


def test_a_template_without_tools_is_said_at_start_and_refuses_tools_on_every_api(
        strict_model: Path, tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with server_process("kvstore.serve", ["--root", str(tmp_path / "root"), "--model",
                                          str(strict_model)], log) as (port, oai):
        claude = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="x",
                                     max_retries=0, timeout=60)
        why = (f"the chat template of {strict_model.name} renders no tools: the request's "
               "tools would be dropped, and an agent that calls tools cannot work with this "
               "model. Serve a model whose template renders tools, or start the server with "
               "--drop-tools to accept such requests and drop their tools")
        tools = [{"type": "function", "function": {"name": "read_file",
                                                   "parameters": TOOL["input_schema"]}}]
        with pytest.raises(openai.BadRequestError) as chat:
            oai.chat.completions.create(model="local", max_tokens=2, tools=tools,
                                        messages=[{"role": "user", "content": "hi"}])
        assert chat.value.body == why or chat.value.body == {"error": why}
        with pytest.raises(anthropic.BadRequestError) as msg:
            claude.messages.create(model="local", max_tokens=2, tools=[TOOL],
                                   messages=[{"role": "user", "content": "hi"}])
        assert msg.value.body == {"type": "error", "error": {
            "type": "invalid_request_error", "message": why}}
        with pytest.raises(anthropic.BadRequestError) as count:
            claude.messages.count_tokens(model="local", tools=[TOOL],
                                         messages=[{"role": "user", "content": "hi"}])
        assert count.value.body["error"]["message"] == why
        with pytest.raises(openai.BadRequestError) as resp:
            oai.responses.create(model="local", input="hi", max_output_tokens=2, tools=[
                {"type": "function", "name": "read_file",
                 "parameters": TOOL["input_schema"]}])
        assert resp.value.body == {"message": why, "type": "invalid_request_error",
                                   "param": None, "code": None}
        # without tools the model answers as ever
        assert claude.messages.create(model="local", max_tokens=2, messages=[
            {"role": "user", "content": "hi"}]).usage.output_tokens >= 1
    assert ("kvstore: this model's template renders no tools: agents that call tools will "
            "not work with it (requests with tools get a 400; --drop-tools accepts them and "
            "drops the tools)") in log.read_text()


def test_drop_tools_accepts_them_and_a_system_message_in_the_midst_goes_into_a_user_message(
        strict_model: Path, tmp_path: Path) -> None:
    """The strict template refuses Claude Code's mid-conversation system message; the
    server puts its text at the end of the user message before it (``system-into-user``),
    the same on every turn, and its breakpoint keeps its place."""
    log = tmp_path / "serve.log"
    with server_process("kvstore.serve", ["--root", str(tmp_path / "root"), "--model",
                                          str(strict_model), "--drop-tools", "--log-level",
                                          "INFO", "--min-tokens", "16"], log) as (port, _):
        body = _claude("a1-1")  # [user, system]: the environment after the first message
        assert [m["role"] for m in body["messages"]] == ["user", "system"]
        n = _count(port, body)
        assert n == _count(port, {**body, "tools": []})  # dropped: the same prompt
        # what the fallback makes of it, sent as such, is the same prompt
        merged = copy.deepcopy(body)
        user, system = merged["messages"]
        user["content"] += [{"type": "text", "text": "\n\n"}, *system["content"]]
        merged["messages"] = [user]
        assert _count(port, merged) == n
        status, data, _ = _post(port, "/v1/messages?beta=true",
                                {**body, "stream": False, "max_tokens": 2})
        assert status == 200, data
        # the next turn's request reuses the first one's prompt to its end
        nxt = _claude("a2-1")
        status, data, _ = _post(port, "/v1/messages?beta=true",
                                {**nxt, "stream": False, "max_tokens": 2})
        assert status == 200, data
        u = json.loads(data)["usage"]
        assert u["cache_read_input_tokens"] >= n - 1
    first, second = _log_records(log)[-2:]
    assert "system-into-user:1" in first["rewrites"] and "system-into-user:1" in \
        second["rewrites"]
    assert "kvstore: this model's template cannot render a system message after the first " \
        "user message: its text goes into a user message (system-into-user)" in log.read_text()
