"""The OpenAI Responses API on the chat path: a ``/v1/responses`` request converted to the
internal chat request, and the chat path's events back to a response object or to the
Responses event stream (``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` / ``.done``, ``response.reasoning_text.delta`` / ``.done``,
``response.function_call_arguments.delta`` / ``.done``, ``response.content_part.done``,
``response.output_item.done``, ``response.completed``).

``input`` items: messages (``developer`` is a system message), ``function_call`` (a tool
call of the assistant message before it), ``function_call_output`` (a ``tool`` message),
``reasoning`` (the next assistant message's ``reasoning_content``). ``instructions`` and the
system messages that open the input are one system message, joined by blank lines.
``previous_response_id`` prepends the conversation of a response this server kept
(:class:`ResponseStore`: bounded, in memory; ``store: false`` keeps nothing); an unknown
id is a 404 that names it.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any

import msgspec

from .chat import (
    ApiError,
    CacheUsage,
    ChatMessage,
    ChatRequest,
    ChatTool,
    ChatToolSpec,
    Chunk,
    Exchange,
    Finish,
    Progress,
    StreamOptions,
    ToolCall,
    ToolFunction,
    invalid,
    sse,
)
from .responses_protocol import (
    ITEM_TYPES,
    FunctionCall,
    FunctionCallOutput,
    InputMessage,
    Reasoning,
    ResponsesRequest,
    TextContent,
)

__all__ = ["ResponseStore", "ResponsesExchange", "error_body", "parse"]

_KINDS = {400: "invalid_request_error", 404: "invalid_request_error", 413:
          "invalid_request_error", 500: "server_error"}


def error_body(err: ApiError) -> bytes:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    code = "not_found" if err.status == 404 else None
    return msgspec.json.encode({"error": {"message": err.message,
                                          "type": _KINDS.get(err.status, "server_error"),
                                          "param": err.param, "code": code}})


class ResponseStore:
    """The conversations of the responses this server kept, for ``previous_response_id``:
    at most ``max_items`` of them and ``max_bytes`` of their JSON, the oldest dropped first.
    A response is found only by a request with the same ``cache_salt``."""

    def __init__(self, max_items: int = 1024, max_bytes: int = 256 << 20) -> None:
        self.max_items, self.max_bytes = max_items, max_bytes
        self._lock = threading.Lock()
        self._items: OrderedDict[str, tuple[str | None, bytes]] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, rid: str, salt: str | None, messages: list[ChatMessage]) -> None:
        data = msgspec.json.encode(messages)
        if len(data) > self.max_bytes:
            return
        with self._lock:
            self._items[rid] = (salt, data)
            self._bytes += len(data)
            while len(self._items) > self.max_items or self._bytes > self.max_bytes:
                _, (_, old) = self._items.popitem(last=False)
                self._bytes -= len(old)

    def get(self, rid: str, salt: str | None) -> list[ChatMessage]:
        with self._lock:
            found = self._items.get(rid)
            if found is not None:
                self._items.move_to_end(rid)
        if found is None or found[0] != salt:
            raise ApiError(404, "not_found_error",
                           f"Previous response with id '{rid}' not found.",
                           param="previous_response_id")
        return msgspec.json.decode(found[1], type=list[ChatMessage])


def parse(body: bytes, store: ResponseStore) -> ResponsesExchange:
    """A ``/v1/responses`` body as an exchange; :class:`ApiError` when it is not a valid one
    (or names a response this server does not keep)."""
    try:
        req = msgspec.json.decode(body, type=ResponsesRequest)
    except msgspec.ValidationError as e:
        raise invalid(str(e)) from None
    except msgspec.DecodeError as e:
        raise invalid(f"the body is not valid JSON: {e}") from None
    return ResponsesExchange(req, store)


def _text(content: str | list[TextContent], where: str) -> str:
    if isinstance(content, str):
        return content
    out = []
    for k, c in enumerate(content):
        if c.type in ("input_image", "input_file"):
            raise invalid(f"{c.type} content is not supported: the model served has no vision "
                          f"tower ({where}.content[{k}])", param=f"{where}.content[{k}]")
        out.append(c.text if c.text is not None else (c.refusal or ""))
    return "".join(out)


def _items(req: ResponsesRequest) -> list[ChatMessage]:
    """The conversation of ``req.input``."""
    if isinstance(req.input, str):
        return [ChatMessage("user", req.input)]
    out: list[ChatMessage] = []
    open_assistant = False  # the last message is an assistant turn still taking calls
    for i, raw in enumerate(req.input):
        where = f"input[{i}]"
        kind = raw.get("type", "message")
        spec = ITEM_TYPES.get(kind) if isinstance(kind, str) else None
        if spec is None:
            raise invalid(f"{where}: items of type {kind!r} are not supported (supported: "
                          f"{', '.join(ITEM_TYPES)})", param=where)
        try:
            item = msgspec.convert(raw, spec)
        except msgspec.ValidationError as e:
            raise invalid(f"{where}: {e}", param=where) from None
        if isinstance(item, InputMessage):
            role = "system" if item.role == "developer" else item.role
            text = _text(item.content, where)
            last = out[-1] if out else None
            if role == "assistant" and open_assistant and last is not None \
                    and not last.content and not last.tool_calls:
                last.content = text  # the reply after its reasoning
            else:
                out.append(ChatMessage(role, text))
            open_assistant = role == "assistant"
        elif isinstance(item, Reasoning):
            parts = item.content if item.content else item.summary
            out.append(ChatMessage("assistant", "",
                                   reasoning_content="".join(p.text for p in parts)))
            open_assistant = True
        elif isinstance(item, FunctionCall):
            call = ToolCall(item.call_id, ToolFunction(item.name, item.arguments))
            if not (open_assistant and out):
                out.append(ChatMessage("assistant", ""))
            out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
            open_assistant = True
        elif isinstance(item, FunctionCallOutput):
            out.append(ChatMessage("tool", _text(item.output, where), tool_call_id=item.call_id))
            open_assistant = False
    return out


def _leading_system(instructions: str | None, conversation: list[ChatMessage]
                    ) -> list[ChatMessage]:
    """``instructions`` and the system (developer) messages that open the conversation, as
    one system message (joined by a blank line): many chat templates take one system
    message, and only first."""
    texts = [instructions] if instructions else []
    n = 0
    while n < len(conversation) and conversation[n].role == "system":
        texts.append(str(conversation[n].content or ""))
        n += 1
    head = [ChatMessage("system", "\n\n".join(texts))] if texts else []
    return head + conversation[n:]


def _tools(req: ResponsesRequest) -> list[ChatTool] | None:
    tools = [ChatTool(ChatToolSpec(t.name, t.parameters or {"type": "object", "properties": {}},
                                   t.description))
             for t in req.tools or [] if t.type == "function" and t.name]
    return tools or None


class ResponsesExchange(Exchange):
    """One ``/v1/responses`` request: its chat request and the response it is answered
    with; a completed response's conversation is kept in the store unless ``store`` is
    false."""

    def __init__(self, req: ResponsesRequest, store: ResponseStore) -> None:
        self.req, self.store = req, store
        self.stream = req.stream
        history = store.get(req.previous_response_id, req.cache_salt) \
            if req.previous_response_id is not None else []
        self.conversation = history + _items(req)
        self.chat = ChatRequest(
            messages=_leading_system(req.instructions, self.conversation),
            max_tokens=req.max_output_tokens,  # none: the server's default (--max-tokens)
            tools=_tools(req), tool_choice=req.tool_choice, temperature=req.temperature,
            top_p=req.top_p, stream=True, stream_options=StreamOptions(),
            cache_salt=req.cache_salt)
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: str | None = None  # "message" or "reasoning": the item being streamed
        self.reply = ChatMessage("assistant", "")
        self.last_ping = 0.0

    # --- the response object ---------------------------------------------------------

    def _response(self, status: str, usage: CacheUsage | None, reason: str | None = None
                  ) -> dict[str, Any]:
        r = self.req
        out: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None,
            "incomplete_details": {"reason": reason} if reason else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "model": r.model, "output": self.output if status != "in_progress" else [],
            "parallel_tool_calls": r.parallel_tool_calls if r.parallel_tool_calls is not None
            else True,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": r.store,
            "temperature": r.temperature, "top_p": r.top_p,
            "text": {"format": {"type": "text"}},
            "tool_choice": r.tool_choice if r.tool_choice is not None else "auto",
            "tools": [msgspec.to_builtins(t) for t in r.tools or []],
            "truncation": "disabled", "metadata": r.metadata or {}, "usage": None,
        }
        if usage is not None:
            out["usage"] = {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": usage.reused_tokens,
                                         "cache_write_tokens": usage.created_tokens},
                "output_tokens": usage.output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.prompt_tokens + usage.output_tokens,
            }
        return out

    def _ev(self, kind: str, **fields: Any) -> bytes:
        if not self.stream:
            return b""
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(kind, data)

    # --- output items --------------------------------------------------------------

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        i = len(self.output) - 1
        item = self.output[i]
        item["status"] = "completed"
        out = b""
        if self.open == "message":
            part = item["content"][0]
            out += self._ev("response.output_text.done", item_id=item["id"], output_index=i,
                            content_index=0, text=part["text"], logprobs=[])
            out += self._ev("response.content_part.done", item_id=item["id"], output_index=i,
                            content_index=0, part=part)
        else:
            part = item["content"][0]
            out += self._ev("response.reasoning_text.done", item_id=item["id"],
                            output_index=i, content_index=0, text=part["text"])
        self.open = None
        return out + self._ev("response.output_item.done", output_index=i, item=item)

    def _delta(self, kind: str, text: str) -> bytes:
        out = b""
        if self.open != kind:
            out += self._close()
            if kind == "message":
                item: dict[str, Any] = {"id": f"msg_{uuid.uuid4().hex}", "type": "message",
                                        "status": "in_progress", "role": "assistant",
                                        "content": []}
            else:
                item = {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [],
                        "content": [], "status": "in_progress"}
            self.output.append(item)
            self.open = kind
            i = len(self.output) - 1
            out += self._ev("response.output_item.added", output_index=i,
                            item=json.loads(json.dumps(item)))
            part = ({"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    if kind == "message" else {"type": "reasoning_text", "text": ""})
            item["content"].append(part)
            if kind == "message":
                out += self._ev("response.content_part.added", item_id=item["id"],
                                output_index=i, content_index=0, part=dict(part))
        i = len(self.output) - 1
        item = self.output[i]
        item["content"][0]["text"] += text
        if kind == "message":
            self.reply.content = str(self.reply.content or "") + text
            out += self._ev("response.output_text.delta", item_id=item["id"], output_index=i,
                            content_index=0, delta=text, logprobs=[])
        else:
            self.reply.reasoning_content = (self.reply.reasoning_content or "") + text
            out += self._ev("response.reasoning_text.delta", item_id=item["id"],
                            output_index=i, content_index=0, delta=text)
        return out

    def _call(self, call_id: str | None, name: str, arguments: str) -> bytes:
        out = self._close()
        cid = f"call_{(call_id or uuid.uuid4().hex).replace('-', '')}"
        item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                "call_id": cid, "name": name, "arguments": ""}
        self.output.append(item)
        i = len(self.output) - 1
        out += self._ev("response.output_item.added", output_index=i, item=dict(item))
        item["arguments"] = arguments
        out += self._ev("response.function_call_arguments.delta", item_id=item["id"],
                        output_index=i, delta=arguments)
        out += self._ev("response.function_call_arguments.done", item_id=item["id"],
                        output_index=i, arguments=arguments, name=name)
        item["status"] = "completed"
        out += self._ev("response.output_item.done", output_index=i, item=item)
        self.reply.tool_calls = [*(self.reply.tool_calls or []),
                                 ToolCall(cid, ToolFunction(name, arguments))]
        return out

    # --- the events ------------------------------------------------------------------

    def start(self, usage: CacheUsage) -> bytes:
        return (self._ev("response.created", response=self._response("in_progress", None))
                + self._ev("response.in_progress", response=self._response("in_progress", None)))

    def event(self, ev: Chunk | Progress) -> bytes:
        if isinstance(ev, Progress):
            # the Responses stream has no ping: a comment keeps a long prefill's connection
            # busy (SSE parsers skip it)
            now = time.monotonic()
            if not self.stream or now - self.last_ping < 1.0:
                return b""
            self.last_ping = now
            return f": keepalive {ev.done}/{ev.total}\n\n".encode()
        if ev.delta is None:
            return b""
        d, out = ev.delta, b""
        if d.reasoning:
            out += self._delta("reasoning", d.reasoning)
        if d.content:
            out += self._delta("message", d.content)
        for tc in d.tool_calls or []:
            if tc.function is not None and tc.function.name:
                out += self._call(tc.id, tc.function.name, tc.function.arguments or "")
        return out

    def finish(self, fin: Finish) -> bytes:
        out = self._close()
        incomplete = fin.reason == "length"
        status = "incomplete" if incomplete else "completed"
        resp = self._response(status, fin.usage, "max_output_tokens" if incomplete else None)
        if self.req.store:
            self.store.put(self.id, self.req.cache_salt, [*self.conversation, self.reply])
        if not self.stream:
            return msgspec.json.encode(resp)
        kind = "response.incomplete" if incomplete else "response.completed"
        return out + self._ev(kind, response=resp)

    def stream_error(self, err: ApiError) -> bytes:
        return self._ev("error", code=None, message=err.message, param=err.param)
