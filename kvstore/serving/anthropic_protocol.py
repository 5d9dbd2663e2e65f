"""The Anthropic Messages API's wire types (``POST /v1/messages`` and
``/v1/messages/count_tokens``) as msgspec Structs: decoding a body validates it and bounds
every list and string. Fields the server does not use (``metadata``, ``service_tier``,
``context_management``, ``output_config``, …) are accepted and ignored; so is any field
this module does not declare (docs/CLI.md lists what each client sends and what becomes of
it)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from .chat import MAX_ITEMS, Name, Text

__all__ = [
    "CacheControl", "ContentBlock", "CountTokensRequest", "Message", "MessagesRequest",
    "TextBlock", "Tool", "ToolChoice", "ToolResultBlock", "ToolUseBlock",
]


class CacheControl(Struct, omit_defaults=True):
    """A breakpoint: ``{"type": "ephemeral"}``, optionally with ``"ttl": "5m"`` or ``"1h"``."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(Struct, tag="text", tag_field="type"):
    text: Text
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None


class ImageBlock(Struct, tag="image", tag_field="type"):
    source: dict[str, Any]
    cache_control: CacheControl | None = None


class DocumentBlock(Struct, tag="document", tag_field="type"):
    source: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolUseBlock(Struct, tag="tool_use", tag_field="type"):
    id: Name
    name: Name
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(Struct, tag="tool_result", tag_field="type"):
    tool_use_id: Name
    content: Text | Annotated[list[TextBlock | ImageBlock | DocumentBlock],
                              Meta(max_length=MAX_ITEMS)] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(Struct, tag="thinking", tag_field="type"):
    thinking: Text
    signature: str | None = None


class RedactedThinkingBlock(Struct, tag="redacted_thinking", tag_field="type"):
    data: str


ContentBlock = (TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock
                | ThinkingBlock | RedactedThinkingBlock)


class Message(Struct):
    """A turn of the conversation. ``system`` is a system message in the conversation's
    midst (Claude Code sends its environment so, after the first user message): text or
    text blocks only."""

    role: Literal["user", "assistant", "system"]
    content: Text | Annotated[list[ContentBlock], Meta(max_length=MAX_ITEMS)]


class Tool(Struct):
    """A client tool (``input_schema``); a server tool (a ``type`` such as
    ``web_search_20250305``, no schema) and a tool whose loading is deferred
    (``defer_loading: true``: the client's tool search loads it when the model asks) are
    accepted and left out of the prompt."""

    name: Name
    input_schema: dict[str, Any] | None = None
    description: Text | None = None
    type: str | None = None
    cache_control: CacheControl | None = None
    defer_loading: bool | None = None


class ToolChoice(Struct):
    type: Literal["auto", "any", "tool", "none"]
    name: Name | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(Struct):
    """``enabled`` (with a budget), ``adaptive`` (the model decides; Claude Code sends it
    with ``display: "omitted"``) or ``disabled``: the template's ``enable_thinking``."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: str | None = None


class _Common(Struct, kw_only=True):
    model: Name
    messages: Annotated[list[Message], Meta(max_length=MAX_ITEMS)]
    system: Text | Annotated[list[TextBlock], Meta(max_length=MAX_ITEMS)] | None = None
    tools: Annotated[list[Tool], Meta(max_length=4096)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    cache_control: CacheControl | None = None
    cache_salt: Annotated[str, Meta(min_length=1, max_length=4096)] | None = None


class MessagesRequest(_Common, kw_only=True):
    """``POST /v1/messages``: ``max_tokens`` is required, as Anthropic requires it."""

    max_tokens: Annotated[int, Meta(ge=1)]
    stop_sequences: Annotated[list[Annotated[str, Meta(max_length=4096)]],
                              Meta(max_length=64)] | None = None
    stream: bool = False
    temperature: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    metadata: dict[str, Any] | None = None


class CountTokensRequest(_Common, kw_only=True):
    """``POST /v1/messages/count_tokens``: the prompt of a Messages request."""
