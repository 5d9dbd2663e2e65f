"""The one internal chat request every API adapter produces, and the events it is answered
with.

The request is an OpenAI chat-completions body, the one mlx-lm's chat path takes:
messages (with ``tool_calls``, role ``tool``, the reasoning of an earlier reply as
``reasoning_content``), tools, sampling, ``max_tokens``, ``stop``, ``cache_salt``, and
the Anthropic ``cache_control`` breakpoints carried on the content parts and the body
(OpenRouter's layout) for the prompt cache to read. The events are the chunks that path
streams (:class:`Chunk`), the prefill's progress (:class:`Progress`) and how it ended
(:class:`Finish`, with the request's cache figures, :class:`CacheUsage`).

Knows nothing of mlx-lm: ``kvstore.server.app`` runs the request and produces the events.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

__all__ = [
    "MAX_BODY_BYTES", "ApiError", "CacheUsage", "ChatMessage", "ChatRequest", "ChatTool",
    "Chunk", "Finish", "Progress", "TextPart", "ToolCall", "ToolFunction", "decode_chunk",
]

#: The largest request body any adapter reads (a 150k-token transcript is ~1 MB of JSON;
#: a body this large is refused with a 413 before it is read).
MAX_BODY_BYTES = 32 << 20

#: Bounds every wire type shares: how many items a list may hold, how long a string is.
MAX_ITEMS = 100_000
MAX_TEXT = 16 << 20
Text = Annotated[str, Meta(max_length=MAX_TEXT)]
Name = Annotated[str, Meta(max_length=1024)]


class ApiError(Exception):
    """A request the server refuses: the HTTP status, the error's kind (Anthropic's
    ``error.type``: ``invalid_request_error``, ``not_found_error``,
    ``request_too_large``, ``api_error``, …) and its message. Each API's serving module
    writes it in that API's shape."""

    def __init__(self, status: int, kind: str, message: str, *, param: str | None = None
                 ) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.param = status, kind, message, param


def invalid(message: str, *, param: str | None = None) -> ApiError:
    """A 400 ``invalid_request_error``."""
    return ApiError(400, "invalid_request_error", message, param=param)


# --- the request -------------------------------------------------------------


class TextPart(Struct, omit_defaults=True, tag="text", tag_field="type"):
    """A text content part; ``cache_control`` is an Anthropic breakpoint, carried as is."""

    text: str
    cache_control: dict[str, Any] | None = None


class ToolFunction(Struct, omit_defaults=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Struct, omit_defaults=True, tag="function", tag_field="type"):
    id: str
    function: ToolFunction
    cache_control: dict[str, Any] | None = None  # an Anthropic tool_use block's


class ChatMessage(Struct, omit_defaults=True):
    """One chat message. ``reasoning_content`` is the field chat templates (Qwen3,
    DeepSeek, GLM) render an earlier reply's reasoning from."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatToolSpec(Struct, omit_defaults=True):
    name: str
    parameters: dict[str, Any]
    description: str | None = None


class ChatTool(Struct, omit_defaults=True, tag="function", tag_field="type"):
    function: ChatToolSpec
    cache_control: dict[str, Any] | None = None


class StreamOptions(Struct):
    include_usage: bool = True


class ChatRequest(Struct, omit_defaults=True):
    """The internal request: an OpenAI chat-completions body. Absent sampling parameters
    and an absent ``max_tokens`` are left to the server's own defaults (``--temp``,
    ``--top-p``, ``--top-k``, ``--max-tokens``). The model
    is always the server's own (``default_model``): agents send their vendor's model names,
    which the API's answer echoes."""

    messages: list[ChatMessage]
    max_tokens: int | None = None  # None: the server's default (``--max-tokens``)
    model: str = "default_model"
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] | None = None
    stream: bool = False  # the server always streams the chat path
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    cache_control: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def body(self) -> dict[str, Any]:
        """The request as the JSON object the chat path reads."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out


# --- the events --------------------------------------------------------------


class FunctionDelta(Struct):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(Struct):
    index: int | None = None
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


class Delta(Struct):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class Choice(Struct):
    index: int = 0
    finish_reason: str | None = None
    delta: Delta | None = None


class PromptDetails(Struct):
    cached_tokens: int = 0


class ChunkUsage(Struct):
    prompt_tokens: int
    completion_tokens: int
    prompt_tokens_details: PromptDetails | None = None


class Chunk(Struct):
    """One streamed chat chunk: text, reasoning and whole tool calls (mlx-lm parses a
    call once it is complete)."""

    id: str = ""
    choices: list[Choice] = []
    usage: ChunkUsage | None = None

    @property
    def delta(self) -> Delta | None:
        return self.choices[0].delta if self.choices else None

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason if self.choices else None


_chunk = msgspec.json.Decoder(Chunk)


def decode_chunk(data: bytes) -> Chunk:
    """A chunk from the JSON of one ``data:`` line."""
    return _chunk.decode(data)


class Progress(Struct):
    """The prefill has processed ``done`` of ``total`` prompt tokens."""

    done: int
    total: int


class CacheUsage(Struct):
    """The request's figures, from the prompt cache's per-request record (the request log
    and ``/metrics`` count the same): ``prompt_tokens`` = ``reused_tokens`` (read from any
    tier) + ``created_tokens`` (computed and written to the cache by this request) +
    ``uncached_tokens`` (computed, not kept)."""

    prompt_tokens: int
    reused_tokens: int
    created_tokens: int
    output_tokens: int

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.reused_tokens - self.created_tokens


class Finish(Struct):
    """How the reply ended: ``stop`` (end of turn), ``stop_sequence`` (one of the request's
    stop strings, named), ``length`` (``max_tokens``) or ``tool_calls``."""

    reason: Literal["stop", "stop_sequence", "length", "tool_calls"]
    usage: CacheUsage
    stop_sequence: str | None = None


Event = Chunk | Progress | Finish


class Exchange:
    """One request of an API once its body is parsed: the chat request to run, and how the
    events that answer it are written back (each API's serving module subclasses it).

    Streamed, the server writes :meth:`start` once the prompt's cache lookup is done, then
    :meth:`event` for each chunk and progress report, then :meth:`finish`; not streamed,
    :meth:`event` only gathers and :meth:`finish` returns the whole body. An error before
    the first byte is written whole (:meth:`error_body`); one after it, as a stream event
    (:meth:`stream_error`).
    """

    stream: bool = False
    chat: ChatRequest

    def start(self, usage: CacheUsage) -> bytes:
        return b""

    def event(self, ev: Chunk | Progress) -> bytes:
        raise NotImplementedError

    def finish(self, fin: Finish) -> bytes:
        raise NotImplementedError

    def stream_error(self, err: ApiError) -> bytes:
        raise NotImplementedError


def sse(event: str | None, data: object) -> bytes:
    """One server-sent event: ``event: NAME`` (when named) and its JSON ``data``."""
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + msgspec.json.encode(data) + b"\n\n"
