"""A chat request's prompt tokens, rendered as mlx_lm.server 0.32.2 renders them
(``ResponseGenerator._tokenize``), and what the prompt cache wants to know of them: where
its segments end (the system prompt, the thinking tail), where each ``cache_control``
breakpoint falls, which state the reply starts in (reasoning or not).

Pure functions of the tokenizer (mlx-lm's ``TokenizerWrapper``) and the request's
messages; nothing of ``mlx_lm.server`` is imported: the two small functions of it that
shape the prompt (``process_message_content``, ``convert_chat``) are copied here, and
tests/test_server_openai.py checks that the tokens are the same as mlx-lm's.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.mlx_lm.cache_control import Breakpoint
from kvstore.mlx_lm.writebehind import common_prefix
from kvstore.serving.templates import Abilities, probe

__all__ = ["PromptTooLong", "Rendered", "breakpoint_positions", "convert_chat",
           "process_message_content", "render_chat", "render_text", "template_abilities"]

logger = logging.getLogger("kvstore.serve")


def convert_chat(messages: Sequence[Mapping[str, Any]],
                 role_mapping: Mapping[str, Any] | None = None) -> str:
    """The prompt of a model without a chat template (mlx_lm.server's ``convert_chat``)."""
    default_role_mapping = {
        "system_prompt": (
            "A chat between a curious user and an artificial intelligence "
            "assistant. The assistant follows the given rules no matter what."
        ),
        "system": "ASSISTANT's RULE: ",
        "user": "USER: ",
        "assistant": "ASSISTANT: ",
        "stop": "\n",
    }
    mapping = role_mapping or default_role_mapping
    prompt = ""
    for line in messages:
        role_prefix = mapping.get(line["role"], "")
        stop = mapping.get("stop", "")
        content = line.get("content", "")
        prompt += f"{role_prefix}{content}{stop}"
    prompt += mapping.get("assistant", "")
    return prompt.rstrip()


def process_message_content(messages: list[dict[str, Any]]) -> None:
    """The messages, in place, as the chat template wants them (mlx_lm.server's
    ``process_message_content`` without images): a list of text parts joined into one
    string, null content an empty string, tool-call arguments given as JSON text parsed.
    ValueError: a part that is not text, or arguments that are not JSON."""
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            fragments = [p["text"] for p in content
                         if isinstance(p, dict) and p.get("type") == "text"
                         and isinstance(p.get("text"), str)]
            if len(fragments) != len(content):
                raise ValueError("Only 'text' content type is supported.")
            message["content"] = "".join(fragments)
        elif content is None:
            message["content"] = ""
        if tool_calls := message.get("tool_calls"):
            for tool_call in tool_calls:
                if isinstance(tool_call, dict) and isinstance(
                        func := tool_call.get("function"), dict):
                    if (args := func.get("arguments")) and isinstance(args, str):
                        func["arguments"] = json.loads(args)


class PromptTooLong(Exception):
    """The prompt has ``tokens`` tokens, more than ``limit``: found before the renderings
    the cache's segments need (a prompt of 4,096 tools is refused after one)."""

    def __init__(self, tokens: int, limit: int) -> None:
        super().__init__(f"the prompt is {tokens} tokens, more than {limit}")
        self.tokens, self.limit = tokens, limit


@dataclass
class Rendered:
    """A prompt: its tokens, where the prompt cache's segments end (position -> mlx-lm's
    segment type: ``system`` at the end of the system prompt, ``user`` before a thinking
    tail), the state the reply starts in (``normal``, ``reasoning``), and the messages as
    the template saw them (content joined, arguments parsed)."""

    prompt: list[int]
    cuts: dict[int, str] = field(default_factory=dict)
    initial_state: str = "normal"
    messages: list[dict[str, Any]] = field(default_factory=list)


def render_text(tokenizer: Any, prompt: str) -> Rendered:
    """``/v1/completions``: the prompt encoded (special tokens added, as mlx-lm does)."""
    return Rendered(list(tokenizer.encode(prompt)))


def _template(tokenizer: Any, messages: list[dict[str, Any]], tools: list[Any] | None,
              args: Mapping[str, Any], *, generation: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=generation,
                                        **{**args, "tools": tools, "tokenize": True})
    return list(out)


def _within(prompt: list[int], limit: int | None) -> list[int]:
    if limit is not None and len(prompt) > limit:
        raise PromptTooLong(len(prompt), limit)
    return prompt


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                tools: list[Any] | None, template_args: Mapping[str, Any],
                role_mapping: Mapping[str, Any] | None = None, *, limit: int | None = None
                ) -> Rendered:
    """The chat prompt as mlx_lm.server 0.32.2's ``_tokenize`` makes it (the messages are
    copied, not changed). ValueError / TypeError / jinja's errors: what the template or the
    content could not take; :class:`PromptTooLong`: more tokens than ``limit``."""
    msgs = copy.deepcopy([dict(m) for m in messages])
    if not getattr(tokenizer, "has_chat_template", False):
        return Rendered(_within(list(tokenizer.encode(convert_chat(msgs, role_mapping))),
                                limit), messages=msgs)
    process_message_content(msgs)
    prompt = _within(_template(tokenizer, msgs, tools, template_args, generation=True), limit)
    out = Rendered(prompt, messages=msgs)

    if getattr(tokenizer, "has_thinking", False):
        start = tokenizer.rfind_think_start(prompt)
        end = tokenizer.rfind_think_end(prompt)
        if start > end:
            out.initial_state = "reasoning"
    out.initial_state = getattr(tokenizer, "response_initial_state", None) \
        or out.initial_state

    if not msgs or msgs[-1].get("role") != "user":
        return out
    # the prompt cache's segments: the system prompt, then the rest, then a thinking tail
    num_system = 0
    for m in msgs:
        if m.get("role") != "system":
            break
        num_system += 1
    sys_end = 0
    if num_system > 0:
        sys_tokens = _template(tokenizer, msgs[:num_system] + [{"role": "user",
                                                                "content": ""}],
                               tools, template_args, generation=False)
        for i, (a, b) in enumerate(zip(sys_tokens, prompt, strict=False)):
            if a != b:
                sys_end = i
                break
        if 0 < sys_end < len(prompt):
            out.cuts[sys_end] = "system"
        else:
            sys_end = 0
    tail_start = len(prompt)
    if getattr(tokenizer, "has_thinking", False):
        think = tokenizer.rfind_think_start(prompt, start=tail_start - 11)
        if think >= 0:
            tail_start = think
    if sys_end < tail_start < len(prompt):
        out.cuts[tail_start] = "user"
    return out


def _partial(messages: Sequence[Any], tools: Sequence[Any] | None,
             bp: Breakpoint) -> tuple[list[Any], list[Any] | None, str]:
    """The messages and tools that end with ``bp``'s block, and its priority
    (kvstore.mlx_lm.cache_control's rule)."""
    if bp.tool is not None:  # tools render in the system part: the leading system messages
        lead = []            # and the tools up to the marked one
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ("system", "developer"):
                break
            lead.append(dict(m))
        return lead, list(tools or [])[: bp.tool + 1], "system"
    i = bp.message if bp.message is not None else len(messages) - 1
    msgs = [dict(m) for m in messages[: i + 1]]
    last = msgs[-1]
    content = last.get("content")
    if bp.part is not None and isinstance(content, list):
        last["content"] = content[: bp.part + 1]
    role = last.get("role")
    return msgs, list(tools) if tools else None, \
        "system" if role in ("system", "developer") else "user"


def breakpoint_positions(tokenizer: Any, messages: Sequence[Any], tools: Sequence[Any] | None,
                         template_args: Mapping[str, Any], prompt: Sequence[int],
                         marks: Sequence[Breakpoint]) -> dict[int, tuple[float, str]]:
    """Each mark's token position in ``prompt`` -> ``(ttl, priority)``: the messages up to its
    block (``messages``: as sent, marks taken out) rendered without a generation prompt,
    then the common prefix with ``prompt``. Positions 0 and the whole prompt are left out;
    the longest TTL wins where two meet (kvstore.mlx_lm.cache_control.positions)."""
    out: dict[int, tuple[float, str]] = {}
    if not marks or not getattr(tokenizer, "has_chat_template", False):
        return out
    for bp in marks:
        msgs, tl, priority = _partial(messages, tools, bp)
        msgs = copy.deepcopy(msgs)
        try:
            process_message_content(msgs)
            n = common_prefix(_template(tokenizer, msgs, tl, template_args, generation=False),
                        prompt)
        except Exception:  # noqa: BLE001 - a template that cannot render a part: no pin
            logger.warning("kvstore: cache breakpoint %s not placed", bp, exc_info=True)
            continue
        if 0 < n < len(prompt):
            ttl = max(bp.ttl, out.get(n, (0.0, ""))[0])
            out[n] = (ttl, priority)
    return out


def template_abilities(tokenizer: Any, chat_template_args: Mapping[str, Any] | None
                       ) -> Abilities:
    """What the model's chat template renders (kvstore.serving.templates.probe); without a
    template each message is written as ``role: content``: no tools."""
    if not getattr(tokenizer, "has_chat_template", False):
        return Abilities(tools=False, mid_system=True)
    args = dict(chat_template_args or {})

    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        return str(tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                 add_generation_prompt=True, **args))

    return probe(render)
