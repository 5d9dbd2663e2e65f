"""The OpenAI Responses API's wire types (``POST /v1/responses``) as msgspec Structs:
decoding a body validates it and bounds every list and string. An ``input`` item is one of
:data:`InputItem` (a message may omit its ``type``, as the SDK's "easy" message does);
fields the server does not use (``metadata``, ``include``, ``text``, …) are accepted and
ignored."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from .chat import MAX_ITEMS, Name, Text

__all__ = ["FunctionCall", "FunctionCallOutput", "FunctionTool", "InputMessage", "Reasoning",
           "ResponsesRequest", "TextContent"]


class TextContent(Struct):
    """``input_text`` / ``output_text`` / ``refusal`` (``input_image``, ``input_file``:
    refused, no vision tower)."""

    type: Literal["input_text", "output_text", "refusal", "input_image", "input_file"]
    text: Text | None = None
    refusal: Text | None = None


class InputMessage(Struct, kw_only=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | Annotated[list[TextContent], Meta(max_length=MAX_ITEMS)]
    type: Literal["message"] = "message"


class FunctionCall(Struct, kw_only=True):
    type: Literal["function_call"]
    call_id: Name
    name: Name
    arguments: Text


class FunctionCallOutput(Struct, kw_only=True):
    type: Literal["function_call_output"]
    call_id: Name
    output: Text | Annotated[list[TextContent], Meta(max_length=MAX_ITEMS)]


class ReasoningText(Struct):
    text: Text


class Reasoning(Struct, kw_only=True):
    type: Literal["reasoning"]
    summary: Annotated[list[ReasoningText], Meta(max_length=MAX_ITEMS)] = []
    content: Annotated[list[ReasoningText], Meta(max_length=MAX_ITEMS)] | None = None


#: The item types an ``input`` may hold, by their ``type``.
ITEM_TYPES: dict[str, type[Any]] = {"message": InputMessage, "function_call": FunctionCall,
                                    "function_call_output": FunctionCallOutput,
                                    "reasoning": Reasoning}


class FunctionTool(Struct, kw_only=True, omit_defaults=True):
    """A ``function`` tool; tools of other types (``web_search``, ``custom``, …) are
    accepted and left out of the prompt."""

    type: Name
    name: Name | None = None
    parameters: dict[str, Any] | None = None
    description: Text | None = None
    strict: bool | None = None


class ResponsesRequest(Struct, kw_only=True):
    model: Name
    input: Text | Annotated[list[dict[str, Any]], Meta(max_length=MAX_ITEMS)]
    instructions: Text | None = None
    tools: Annotated[list[FunctionTool], Meta(max_length=4096)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: Name | None = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    cache_salt: Annotated[str, Meta(min_length=1, max_length=4096)] | None = None
