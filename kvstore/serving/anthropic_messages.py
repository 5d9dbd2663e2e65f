"""The Anthropic Messages API on the chat path: a ``/v1/messages`` request converted to the
internal chat request, and the chat path's events back to a message or to Anthropic's
event stream (``message_start``, ``content_block_start``, ``content_block_delta`` with
``text_delta`` / ``thinking_delta`` / ``input_json_delta``, ``content_block_stop``,
``ping``, ``message_delta`` with ``stop_reason`` and usage, ``message_stop``).

History: a ``tool_use`` block becomes an assistant tool call (its ``input`` as JSON
arguments), a ``tool_result`` a ``tool`` message, a ``thinking`` block the assistant
message's ``reasoning_content`` (so the template renders it back as the model wrote it);
``redacted_thinking`` is dropped; an image or a document is a 400 (the models served have
no vision tower). A list of text blocks is a list of text parts, one each, whether or not a
block carries a breakpoint, so the same request with and without ``cache_control`` is the
same chat request but for the marks (the chat path joins the parts before the template sees
them). Each block's ``cache_control`` rides on its content part (or tool call, or tool), the
request's on the body. A ``system`` message in the conversation's midst stays where it was
sent, a system message.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import msgspec

from .anthropic_protocol import (
    CacheControl,
    CountTokensRequest,
    DocumentBlock,
    ImageBlock,
    Message,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
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
    TextPart,
    ToolCall,
    ToolFunction,
    invalid,
    sse,
)

__all__ = ["STOP_REASONS", "MessagesExchange", "count_request", "error_body", "parse"]

#: The chat path's finish reason -> Anthropic's ``stop_reason``.
STOP_REASONS = {"stop": "end_turn", "stop_sequence": "stop_sequence", "length": "max_tokens",
                "tool_calls": "tool_use"}

_ERROR_KINDS = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 529: "overloaded_error"}
NO_VISION = ("{kind} content is not supported: the model served has no vision tower "
             "(messages[{i}].content[{j}])")


def error_body(err: ApiError) -> bytes:
    """``{"type": "error", "error": {"type": ..., "message": ...}}``."""
    kind = err.kind if err.kind in _ERROR_KINDS.values() else \
        _ERROR_KINDS.get(err.status, "api_error")
    return msgspec.json.encode({"type": "error", "error": {"type": kind, "message": err.message}})


def _decode(body: bytes, kind: type[Any]) -> Any:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise invalid(str(e)) from None
    except msgspec.DecodeError as e:
        raise invalid(f"the body is not valid JSON: {e}") from None


def parse(body: bytes) -> MessagesExchange:
    """A ``/v1/messages`` body as an exchange; :class:`ApiError` when it is not a valid one."""
    return MessagesExchange(_decode(body, MessagesRequest))


def count_request(body: bytes) -> ChatRequest:
    """A ``/v1/messages/count_tokens`` body as the chat request whose prompt it counts."""
    req: CountTokensRequest = _decode(body, CountTokensRequest)
    return ChatRequest(messages=_messages(req), max_tokens=1,
                       tools=_tools(req), cache_salt=req.cache_salt,
                       cache_control=_cc(req.cache_control),
                       chat_template_kwargs=_template_kwargs(req))


def _cc(c: CacheControl | None) -> dict[str, Any] | None:
    return msgspec.to_builtins(c) if c is not None else None


def _part(b: TextBlock) -> TextPart:
    return TextPart(b.text, _cc(b.cache_control))


def _system(req: CountTokensRequest | MessagesRequest) -> list[ChatMessage]:
    if req.system is None or req.system == [] or req.system == "":
        return []
    if isinstance(req.system, str):
        return [ChatMessage("system", req.system)]
    return [ChatMessage("system", [_part(b) for b in req.system])]


def _system_message(m: Message, i: int) -> ChatMessage:
    """A system message in the conversation's midst, where it was sent (a template that
    cannot render one there gets the fallback the server names, ``system-into-user``)."""
    if isinstance(m.content, str):
        return ChatMessage("system", m.content)
    parts = []
    for j, b in enumerate(m.content):
        if not isinstance(b, TextBlock):
            raise invalid(f"messages[{i}].content[{j}]: a system message holds text blocks "
                          f"only, not {type(b).__name__}")
        parts.append(_part(b))
    return ChatMessage("system", parts)


def _tool_result(b: ToolResultBlock, i: int, j: int) -> ChatMessage:
    if b.content is None or isinstance(b.content, str):
        parts = [TextPart(b.content or "")]
    else:
        parts = []
        for k, c in enumerate(b.content):
            if isinstance(c, ImageBlock | DocumentBlock):
                raise invalid(NO_VISION.format(kind="image" if isinstance(c, ImageBlock)
                                               else "document", i=i, j=f"{j}].content[{k}"))
            parts.append(_part(c))
    if b.cache_control is not None:  # the block's breakpoint: the end of its last part
        if not parts:
            parts = [TextPart("")]
        parts[-1] = TextPart(parts[-1].text, _cc(b.cache_control))
    return ChatMessage("tool", parts, tool_call_id=b.tool_use_id)


def _message(m: Message, i: int) -> list[ChatMessage]:
    if m.role == "system":
        return [_system_message(m, i)]
    if isinstance(m.content, str):
        return [ChatMessage(m.role, m.content)]
    out: list[ChatMessage] = []
    parts: list[TextPart] = []
    calls: list[ToolCall] = []
    reasoning: list[str] = []
    for j, b in enumerate(m.content):
        if isinstance(b, TextBlock):
            parts.append(_part(b))
        elif isinstance(b, ImageBlock | DocumentBlock):
            raise invalid(NO_VISION.format(kind="image" if isinstance(b, ImageBlock)
                                           else "document", i=i, j=j))
        elif isinstance(b, ThinkingBlock):
            if m.role != "assistant":
                raise invalid(f"messages[{i}].content[{j}]: a thinking block belongs to an "
                              "assistant message")
            reasoning.append(b.thinking)
        elif isinstance(b, RedactedThinkingBlock):
            continue
        elif isinstance(b, ToolUseBlock):
            if m.role != "assistant":
                raise invalid(f"messages[{i}].content[{j}]: a tool_use block belongs to an "
                              "assistant message")
            calls.append(ToolCall(b.id, ToolFunction(b.name, json.dumps(b.input,
                                                                        ensure_ascii=False)),
                                  _cc(b.cache_control)))
        elif isinstance(b, ToolResultBlock):
            if m.role != "user":
                raise invalid(f"messages[{i}].content[{j}]: a tool_result block belongs to a "
                              "user message")
            if parts:  # text before a result keeps its place
                out.append(ChatMessage("user", parts))
                parts = []
            out.append(_tool_result(b, i, j))
    if m.role == "assistant":
        out.append(ChatMessage("assistant", parts if parts else "",
                               tool_calls=calls or None,
                               reasoning_content="".join(reasoning) if reasoning else None))
    elif parts or not out:
        out.append(ChatMessage("user", parts))
    return out


def _messages(req: CountTokensRequest | MessagesRequest) -> list[ChatMessage]:
    out = _system(req)
    for i, m in enumerate(req.messages):
        out += _message(m, i)
    return out


def _tools(req: CountTokensRequest | MessagesRequest) -> list[ChatTool] | None:
    """The client tools; with ``tool_choice: none`` too (the prompt keeps its prefix; the
    choice is passed on, not enforced). Server tools and deferred ones are left out."""
    if not req.tools:
        return None
    tools = [ChatTool(ChatToolSpec(t.name, t.input_schema, t.description), _cc(t.cache_control))
             for t in req.tools if t.input_schema is not None and t.type in (None, "custom")
             and not t.defer_loading]
    return tools or None


def _tool_choice(req: MessagesRequest) -> str | dict[str, Any] | None:
    c = req.tool_choice
    if c is None:
        return None
    if c.type == "tool":
        if not c.name:
            raise invalid("tool_choice.name: required when tool_choice.type is 'tool'")
        return {"type": "function", "function": {"name": c.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[c.type]


def _template_kwargs(req: CountTokensRequest | MessagesRequest) -> dict[str, Any] | None:
    if req.thinking is None:
        return None
    return {"enable_thinking": req.thinking.type != "disabled"}


class MessagesExchange(Exchange):
    """One ``/v1/messages`` request: its chat request and the message it is answered with."""

    def __init__(self, req: MessagesRequest) -> None:
        self.req = req
        self.stream = req.stream
        self.chat = ChatRequest(
            messages=_messages(req), max_tokens=req.max_tokens,
            tools=_tools(req), tool_choice=_tool_choice(req), temperature=req.temperature,
            top_p=req.top_p, top_k=req.top_k, stop=req.stop_sequences or None,
            stream=True, stream_options=StreamOptions(), cache_salt=req.cache_salt,
            cache_control=_cc(req.cache_control), chat_template_kwargs=_template_kwargs(req))
        self.id = f"msg_{uuid.uuid4().hex}"
        self.blocks: list[dict[str, Any]] = []  # the reply's content, gathered
        self.open: str | None = None  # the type of the block being streamed
        self.last_ping = 0.0

    # --- the reply's blocks ------------------------------------------------------

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        if not self.stream:
            return b""
        return sse("content_block_stop", {"type": "content_block_stop",
                                          "index": len(self.blocks) - 1})

    def _delta(self, kind: str, text: str) -> bytes:
        """Append ``text`` to the open block of ``kind`` ("text" or "thinking")."""
        out = b""
        if self.open != kind:
            out += self._close()
            block: dict[str, Any] = {"type": kind, kind: ""}
            if kind == "thinking":
                block["signature"] = ""
            self.blocks.append(block)
            self.open = kind
            if self.stream:
                out += sse("content_block_start", {"type": "content_block_start",
                                                   "index": len(self.blocks) - 1,
                                                   "content_block": dict(block)})
        self.blocks[-1][kind] += text
        if self.stream:
            out += sse("content_block_delta", {
                "type": "content_block_delta", "index": len(self.blocks) - 1,
                "delta": {"type": f"{kind}_delta", kind: text}})
        return out

    def _tool_use(self, call_id: str | None, name: str, arguments: str) -> bytes:
        out = self._close()
        try:
            args = json.loads(arguments) if arguments else {}
        except json.JSONDecodeError:
            args = {"arguments": arguments}  # not JSON: keep the text, as a field
        if not isinstance(args, dict):
            args = {"arguments": args}
        tid = call_id if call_id and call_id.startswith("toolu_") else \
            f"toolu_{(call_id or uuid.uuid4().hex).replace('-', '')}"
        block = {"type": "tool_use", "id": tid, "name": name, "input": args}
        self.blocks.append(block)
        if self.stream:
            i = len(self.blocks) - 1
            out += sse("content_block_start", {"type": "content_block_start", "index": i,
                                               "content_block": {**block, "input": {}}})
            out += sse("content_block_delta", {
                "type": "content_block_delta", "index": i,
                "delta": {"type": "input_json_delta",
                          "partial_json": json.dumps(args, ensure_ascii=False)}})
            out += sse("content_block_stop", {"type": "content_block_stop", "index": i})
        return out

    # --- the events ----------------------------------------------------------------

    @staticmethod
    def usage(u: CacheUsage) -> dict[str, int]:
        """Anthropic's usage: ``input_tokens`` + ``cache_read_input_tokens`` +
        ``cache_creation_input_tokens`` is the prompt's token count."""
        return {"input_tokens": u.uncached_tokens, "output_tokens": u.output_tokens,
                "cache_creation_input_tokens": u.created_tokens,
                "cache_read_input_tokens": u.reused_tokens}

    def _message(self, usage: CacheUsage, stop_reason: str | None,
                 stop_sequence: str | None, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.req.model,
                "content": content, "stop_reason": stop_reason,
                "stop_sequence": stop_sequence, "usage": self.usage(usage)}

    def start(self, usage: CacheUsage) -> bytes:
        if not self.stream:
            return b""
        return (sse("message_start", {"type": "message_start",
                                      "message": self._message(usage, None, None, [])})
                + sse("ping", {"type": "ping"}))

    def event(self, ev: Chunk | Progress) -> bytes:
        if isinstance(ev, Progress):
            now = time.monotonic()
            if not self.stream or now - self.last_ping < 1.0:
                return b""
            self.last_ping = now
            return sse("ping", {"type": "ping"})
        d = ev.delta
        if d is None:
            return b""
        out = b""
        if d.reasoning:
            out += self._delta("thinking", d.reasoning)
        if d.content:
            out += self._delta("text", d.content)
        for tc in d.tool_calls or []:
            f = tc.function
            if f is not None and f.name:
                out += self._tool_use(tc.id, f.name, f.arguments or "")
        return out

    def finish(self, fin: Finish) -> bytes:
        reason = STOP_REASONS[fin.reason]
        if not self.stream:
            return msgspec.json.encode(self._message(fin.usage, reason, fin.stop_sequence,
                                                     self.blocks))
        return (self._close()
                + sse("message_delta", {"type": "message_delta",
                                        "delta": {"stop_reason": reason,
                                                  "stop_sequence": fin.stop_sequence},
                                        "usage": self.usage(fin.usage)})
                + sse("message_stop", {"type": "message_stop"}))

    def stream_error(self, err: ApiError) -> bytes:
        return b"event: error\ndata: " + error_body(err) + b"\n\n"
