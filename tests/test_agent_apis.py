"""The agent APIs of ``kvstore serve`` (issue 34): the Anthropic Messages API and the OpenAI
Responses API, driven by the official ``anthropic`` and ``openai`` SDKs against a server on
127.0.0.1 with a tiny random-weight model (greedy decoding: the server's default).

The model's chat template renders tools, tool calls, tool results and reasoning (with
markers mlx-lm's tool and reasoning detection do not know, so a random model never starts
either), so a history's rendering is checked token for token: the server's count equals
the tokenizer's rendering of the chat messages the history must become.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.serving import server_process

from kvstore.tiny import make_tiny_model

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

TEMPLATE = (
    "{%- if messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}"
    "{%- if tools %}\n# Tools{% for t in tools %}\n{{ t | tojson }}{% endfor %}{% endif %}"
    "<|im_end|>\n{%- elif tools %}<|im_start|>system\n# Tools{% for t in tools %}\n"
    "{{ t | tojson }}{% endfor %}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'tool' %}<|im_start|>tool\n[result {{ m.tool_call_id }}] "
    "{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n"
    "{%- if m.reasoning_content %}[reasoning] {{ m.reasoning_content }} [/reasoning]"
    "{%- endif %}{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}[call {{ c.id }}] {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SYSTEM = "You are a careful coding agent. Read before you write. " * 6
TOOLS = [{"name": "read_file", "description": "Read a file of the repository.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}},
                           "required": ["path"]}},
         {"name": "run", "description": "Run a shell command.",
          "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = make_tiny_model(tmp_path_factory.mktemp("agents") / "model", "llama")
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(scope="module")
def served(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    tmp = tmp_path_factory.mktemp("served")
    log = tmp / "serve.log"
    with server_process("kvstore.serve", ["--root", str(tmp / "root"), "--min-tokens", "16",
                                          "--model", str(model), "--log-level", "INFO"],
                        log) as (port, _):
        yield port, log


@pytest.fixture
def claude(served: tuple[int, Path]) -> Any:
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{served[0]}", api_key="unused",
                               max_retries=0, timeout=120)


@pytest.fixture
def oai(served: tuple[int, Path]) -> Any:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{served[0]}/v1", api_key="unused",
                         max_retries=0, timeout=120)


def _rendered(model: Path, messages: list[dict[str, Any]],
              tools: list[dict[str, Any]] | None = None) -> int:
    """The token count of ``messages`` (OpenAI chat messages) as the model's template
    renders them, with the generation prompt."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(model)
    return len(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                       tokenize=True))


def _chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"],
                                              "description": t["description"]}}
            for t in tools]


def _sums(usage: Any) -> int:
    return int(usage.input_tokens + usage.cache_read_input_tokens
               + usage.cache_creation_input_tokens)


def _log_records(log: Path) -> list[dict[str, str]]:
    return [dict(re.findall(r"(\w+)=(\S+)", line.split("kvstore request ", 1)[1]))
            for line in log.read_text().splitlines() if "kvstore request " in line]


# --- Anthropic Messages ------------------------------------------------------------------


def test_messages_usage_adds_up_to_the_prompt_and_matches_the_request_log(
        claude: Any, served: tuple[int, Path]) -> None:
    turn = [{"role": "user", "content": "Which file holds the cache's index?"}]
    n = claude.messages.count_tokens(model="local", system=SYSTEM, messages=turn).input_tokens
    first = claude.messages.create(model="local", max_tokens=6, system=SYSTEM, messages=turn)
    assert first.type == "message" and first.role == "assistant" and first.model == "local"
    assert first.stop_reason == "max_tokens" and first.usage.output_tokens == 6
    u = first.usage
    assert _sums(u) == n
    # the same prompt again: all but the last token read from the cache (mlx-lm recomputes
    # one to sample from)
    again = claude.messages.create(model="local", max_tokens=6, system=SYSTEM, messages=turn)
    v = again.usage
    assert _sums(v) == n and v.cache_read_input_tokens == n - 1
    assert again.content[0].text == first.content[0].text  # greedy: the same reply
    # the figures are the request log's
    rec = _log_records(served[1])[-1]
    assert (int(rec["prompt"]), int(rec["reused"])) == (n, v.cache_read_input_tokens)
    assert v.cache_creation_input_tokens == (int(rec["computed"]) if rec["reply"] in
                                             ("queued", "deferred") else 0)


def test_messages_stream_events_parse_in_the_sdk_and_usage_adds_up(claude: Any) -> None:
    turn = [{"role": "user", "content": "List the store's tiers."}]
    n = claude.messages.count_tokens(model="local", system=SYSTEM, messages=turn).input_tokens
    raw = claude.messages.create(model="local", max_tokens=5, system=SYSTEM, messages=turn,
                                 stream=True)
    kinds = [ev.type for ev in raw]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    with claude.messages.stream(model="local", max_tokens=5, system=SYSTEM,
                                messages=turn) as s:
        texts = [ev.text for ev in s if ev.type == "text"]
        final = s.get_final_message()
    assert "".join(texts) == final.content[0].text and final.stop_reason == "max_tokens"
    assert _sums(final.usage) == n and final.usage.output_tokens == 5
    assert final.usage.cache_read_input_tokens == n - 1  # the raw stream's prompt, reused


def test_a_stop_sequence_ends_the_reply_and_is_named(claude: Any) -> None:
    turn = [{"role": "user", "content": "Say something about the river."}]
    free = claude.messages.create(model="local", max_tokens=12, messages=turn).content[0].text
    words = [w for w in free.split() if w.isalpha() and len(w) > 2]
    assert words, free
    stop = words[0]
    got = claude.messages.create(model="local", max_tokens=12, messages=turn,
                                 stop_sequences=["zzzz-never", stop])
    assert got.stop_reason == "stop_sequence" and got.stop_sequence == stop
    text = got.content[0].text if got.content else ""
    assert stop not in text and free.startswith(text)


def test_tool_use_tool_result_and_thinking_history_is_rendered(
        claude: Any, model: Path) -> None:
    args = {"path": "kvstore/index/lmdb_index.py"}
    history = [
        {"role": "user", "content": [{"type": "text", "text": "Where is the index?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should read the index module.",
             "signature": "sig"},
            {"type": "text", "text": "Reading it."},
            {"type": "tool_use", "id": "toolu_01", "name": "read_file", "input": args}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01",
             "content": [{"type": "text", "text": "class Index: ..."}]},
            {"type": "text", "text": "Now summarise it."}]},
    ]
    system = [{"type": "text", "text": SYSTEM},
              {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    expected = [
        {"role": "system", "content": SYSTEM + "Be brief."},
        {"role": "user", "content": "Where is the index?"},
        {"role": "assistant", "content": "Reading it.",
         "reasoning_content": "I should read the index module.",
         "tool_calls": [{"id": "toolu_01", "type": "function",
                         "function": {"name": "read_file", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "toolu_01", "content": "class Index: ..."},
        {"role": "user", "content": "Now summarise it."},
    ]
    want = _rendered(model, expected, _chat_tools(TOOLS))
    n = claude.messages.count_tokens(model="local", system=system, messages=history,
                                     tools=TOOLS).input_tokens
    assert n == want
    # the thinking block counts: without it the prompt is shorter
    bare = [history[0], {**history[1], "content": history[1]["content"][1:]}, history[2]]
    assert claude.messages.count_tokens(model="local", system=system, messages=bare,
                                        tools=TOOLS).input_tokens < want
    got = claude.messages.create(model="local", max_tokens=4, system=system, messages=history,
                                 tools=TOOLS, tool_choice={"type": "auto"},
                                 cache_control={"type": "ephemeral"})
    assert _sums(got.usage) == want


def _raw_post(port: int, path: str, body: bytes, length: int | None = None) -> tuple[int, Any]:
    """POST ``body`` with a Content-Length of ``length`` (default: its size); the status and
    the JSON answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        n = len(body) if length is None else length
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                  "Content-Type: application/json\r\n"
                  f"Content-Length: {n}\r\n\r\n".encode() + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(rest)


def test_messages_errors_have_anthropics_shape(claude: Any, served: tuple[int, Path]) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="local", max_tokens=4, messages=[{
            "role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    assert e.value.status_code == 400
    assert e.value.body == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "image content is not supported: the model served has no vision tower "
                   "(messages[0].content[0])"}}
    port = served[0]
    status, body = _raw_post(port, "/v1/messages", json.dumps(
        {"model": "local", "messages": [{"role": "user", "content": "hi"}]}).encode())
    assert (status, body) == (400, {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "Object missing required field `max_tokens`"}})
    status, body = _raw_post(port, "/v1/messages", b"{not json")
    assert status == 400 and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("the body is not valid JSON")
    status, body = _raw_post(port, "/v1/messages?beta=true", b"", length=64 << 20)
    assert (status, body) == (413, {"type": "error", "error": {
        "type": "request_too_large",
        "message": f"the request body is {64 << 20} bytes, over the limit of {32 << 20} bytes"}})
    status, body = _raw_post(port, "/v1/messages", json.dumps(
        {"model": "local", "max_tokens": 0, "messages": []}).encode())
    assert status == 400 and "max_tokens" in body["error"]["message"]
    status, body = _raw_post(port, "/v1/messages/batches", b"{}")
    assert (status, body) == (404, {"type": "error", "error": {
        "type": "not_found_error", "message": "Not found: POST /v1/messages/batches"}})
    # the sampling parameters older clients send (anthropic 2.17 no longer has them)
    ok = claude.messages.create(model="local", max_tokens=2, messages=[
        {"role": "user", "content": "x"}], extra_body={"temperature": 0.5, "top_p": 0.9,
                                                       "top_k": 20})
    assert ok.usage.output_tokens == 2
    with pytest.raises(anthropic.APIStatusError) as e:
        claude.messages.create(model="local", max_tokens=4, messages=[
            {"role": "user", "content": "x"}], extra_body={"temperature": 1.5})
    assert e.value.status_code == 400
    assert e.value.body["error"]["message"] == "Expected `float` <= 1.0 - at `$.temperature`"


# --- OpenAI Responses --------------------------------------------------------------------


def test_responses_usage_stream_and_previous_response_id(oai: Any, model: Path) -> None:
    first = oai.responses.create(model="local", instructions=SYSTEM,
                                 input="Which file holds the index?", max_output_tokens=5)
    assert first.status == "incomplete" and first.incomplete_details.reason == \
        "max_output_tokens"
    want = _rendered(model, [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": "Which file holds the index?"}])
    assert first.usage.input_tokens == want and first.usage.output_tokens == 5
    reply = first.output_text
    assert reply and first.output[0].type == "message"
    # previous_response_id: the kept conversation, then the new input (instructions are
    # the new request's, as OpenAI has it)
    with oai.responses.stream(model="local", instructions=SYSTEM, input="And the blocks?",
                              previous_response_id=first.id, max_output_tokens=5) as s:
        events = list(s)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    final = events[-1].response
    want2 = _rendered(model, [{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": "Which file holds the index?"},
                              {"role": "assistant", "content": reply},
                              {"role": "user", "content": "And the blocks?"}])
    assert final.usage.input_tokens == want2
    # the earlier prompt was kept: read from the cache (bar the token where the reply's
    # re-rendering parts from what was generated)
    assert final.usage.input_tokens_details.cached_tokens >= want - 1
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output[0].content[0].text


def test_function_call_history_is_rendered(oai: Any, model: Path) -> None:
    tools = [{"type": "function", "name": "run", "description": "Run a shell command.",
              "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]
    items = [{"role": "developer", "content": "Use the tools."},
             {"role": "user", "content": [{"type": "input_text", "text": "List the files."}]},
             {"type": "reasoning", "id": "rs_1", "summary": [
                 {"type": "summary_text", "text": "A listing is needed."}]},
             {"type": "function_call", "call_id": "call_1", "name": "run",
              "arguments": json.dumps({"cmd": "ls"})},
             {"type": "function_call_output", "call_id": "call_1", "output": "README.md"},
             {"role": "assistant", "content": [{"type": "output_text", "text": "One file."}]},
             {"role": "user", "content": "Thanks."}]
    got = oai.responses.create(model="local", instructions="Be brief.", input=items,
                               tools=tools, max_output_tokens=3, store=False)
    expected = [
        {"role": "system", "content": "Be brief.\n\nUse the tools."},
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": "", "reasoning_content": "A listing is needed.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "run", "arguments": {"cmd": "ls"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "README.md"},
        {"role": "assistant", "content": "One file."},
        {"role": "user", "content": "Thanks."},
    ]
    chat_tools = [{"type": "function", "function": {
        "name": "run", "parameters": tools[0]["parameters"],
        "description": tools[0]["description"]}}]
    assert got.usage.input_tokens == _rendered(model, expected, chat_tools)


def test_store_false_and_unknown_ids_are_404s_in_openais_shape(oai: Any) -> None:
    kept = oai.responses.create(model="local", input="hello", max_output_tokens=2, store=False)
    for rid in (kept.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError) as e:
            oai.responses.create(model="local", input="x", previous_response_id=rid,
                                 max_output_tokens=2)
        assert e.value.status_code == 404
        assert e.value.body == {"message": f"Previous response with id '{rid}' not found.",
                                "type": "invalid_request_error",
                                "param": "previous_response_id", "code": "not_found"}
    with pytest.raises(openai.NotFoundError) as gone:
        oai.responses.retrieve("resp_unknown")
    assert gone.value.body == {"message": "Not found: GET /v1/responses/resp_unknown",
                               "type": "invalid_request_error", "param": None,
                               "code": "not_found"}
    with pytest.raises(openai.BadRequestError) as bad:
        oai.responses.create(model="local", input=[{"type": "computer_call", "id": "x"}])
    assert bad.value.body["message"] == (
        "input[0]: items of type 'computer_call' are not supported (supported: message, "
        "function_call, function_call_output, reasoning)")


def test_concurrent_requests_each_get_their_own_figures(claude: Any, oai: Any) -> None:
    """Requests in one batch: each answer's figures are its own prompt's."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [SYSTEM + f"Session {i}. " + "Explain the store. " * (3 * i + 1) for i in range(4)]
    want = [claude.messages.count_tokens(model="local", messages=[
        {"role": "user", "content": p}]).input_tokens for p in prompts]
    assert len(set(want)) == 4

    def ask(i: int) -> int:
        if i % 2:
            r = oai.responses.create(model="local", input=prompts[i], max_output_tokens=8,
                                     store=False)
            return int(r.usage.input_tokens)
        m = claude.messages.create(model="local", max_tokens=8, messages=[
            {"role": "user", "content": prompts[i]}])
        return _sums(m.usage)

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(ask, range(4)))
    assert got == want


def test_a_cache_salt_keeps_an_agents_prompts_apart(claude: Any, oai: Any) -> None:
    turn = [{"role": "user", "content": "A tenant's question about the remote tier."}]

    def read(salt: str) -> int:
        m = claude.messages.create(model="local", max_tokens=2, system=SYSTEM, messages=turn,
                                   extra_body={"cache_salt": salt})
        return int(m.usage.cache_read_input_tokens)

    read("tenant-a")
    assert read("tenant-a") > 0  # its own prompt, again
    assert read("tenant-b") == 0  # another salt shares nothing, not even the system prompt
    first = oai.responses.create(model="local", input="hello", max_output_tokens=2,
                                 extra_body={"cache_salt": "tenant-a"})
    with pytest.raises(openai.NotFoundError):  # a kept response is its tenant's alone
        oai.responses.create(model="local", input="x", previous_response_id=first.id,
                             max_output_tokens=2, extra_body={"cache_salt": "tenant-b"})
