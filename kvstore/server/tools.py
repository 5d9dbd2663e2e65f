"""The reply's text split as mlx_lm.server 0.32.2 splits it: reasoning (between the
tokenizer's think tags), tool calls (between its tool-call tags, parsed by its tool parser)
and the answer, and the request's stop strings, which end it.

mlx-lm builds a :class:`mlx_lm.generate.TextStateMachine` from the tokenizer
(``make_text_state_machine``) with the stop words as self-transitions that strip them, and
stops the generation on a stop word's *tokens*, which a word tokenized in context often is
not. Here the stop words are transitions to the machine's end (state None): the text
decides, the text before the stop word is the answer's, and what comes after is dropped.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Sequence
from typing import Any

from mlx_lm.generate import TextStateMachine

__all__ = ["Machine", "ToolCallFormatter", "text_state_machine"]

#: a TextStateMachine's runtime state: (state name, trie node, states, pending text)
State = tuple[Any, ...]

logger = logging.getLogger("kvstore.serve")


def text_state_machine(tokenizer: Any, stop_words: Sequence[str] = ()) -> TextStateMachine:
    """mlx-lm's ``make_text_state_machine`` for ``tokenizer``, with each stop word a
    transition to the end (None) from every state."""
    transitions: dict[str, list[tuple[str, str | None]]] = {}
    if getattr(tokenizer, "has_thinking", False):
        transitions.setdefault("normal", []).append((tokenizer.think_start, "reasoning"))
        transitions["reasoning"] = [(tokenizer.think_end, "normal")]
    response = dict(getattr(tokenizer, "response_transitions", None) or {})
    if getattr(tokenizer, "has_tool_calling", False):
        targets = {dst for edges in response.values() for _, dst in edges}
        if "tool" not in targets:
            transitions.setdefault("normal", []).append((tokenizer.tool_call_start, "tool"))
        if getattr(tokenizer, "has_thinking", False):
            transitions["reasoning"].append((tokenizer.tool_call_start, "tool"))
        transitions["tool"] = ([(tokenizer.tool_call_end, "normal")]
                               if tokenizer.tool_call_end else [])
    for w in getattr(tokenizer, "structural_markers", None) or ():
        transitions.setdefault("normal", []).append((w, "normal"))
    for state, edges in response.items():
        transitions.setdefault(state, []).extend(edges)
    words = [w for w in stop_words if w]
    if words:
        for state in set(transitions) | {"normal"}:
            transitions.setdefault(state, []).extend((w, None) for w in words)
    return TextStateMachine(transitions or None)  # type: ignore[no-untyped-call]


class Machine:
    """:func:`text_state_machine` with typed steps (mlx-lm's are untyped)."""

    def __init__(self, tokenizer: Any, stop_words: Sequence[str] = ()) -> None:
        self._sm = text_state_machine(tokenizer, stop_words)

    def start(self, initial: str) -> State:
        state: State = self._sm.make_state(initial)  # type: ignore[no-untyped-call]
        return state

    @staticmethod
    def split(state: State, text: str) -> tuple[State, list[tuple[str | None, str]]]:
        """The text's segments by state; the last is the current state (None: a stop word
        ended the machine)."""
        out: tuple[State, list[tuple[str | None, str]]] = \
            TextStateMachine.split(state, text)  # type: ignore[no-untyped-call]
        return out

    @staticmethod
    def flush(state: State) -> tuple[State, str, str | None]:
        """The text held back (a possible control sequence's start), emitted: at ``length``."""
        out: tuple[State, str, str | None] = \
            TextStateMachine.flush(state)  # type: ignore[no-untyped-call]
        return out

    @staticmethod
    def discard(state: State) -> State:
        """The text held back, dropped: at ``stop``."""
        new, _ = TextStateMachine.discard(state)  # type: ignore[no-untyped-call]
        return new  # type: ignore[no-any-return]


class ToolCallFormatter:
    """The tool calls of a reply, parsed and written as OpenAI's ``tool_calls`` (mlx_lm.server
    0.32.2's ``ToolCallFormatter``): a call the parser cannot read (cut short by
    ``max_tokens``) is left out with a warning; streamed, each call has its ``index``."""

    def __init__(self, tool_parser: Any, tools: list[Any] | None, streaming: bool = False
                 ) -> None:
        self._idx = 0
        self._tool_parser = tool_parser
        self._tools = tools
        self._streaming = streaming

    def _format(self, tc: dict[str, Any]) -> dict[str, Any]:
        tc_id = tc.pop("id", None) or str(uuid.uuid4())
        tc["arguments"] = json.dumps(tc["arguments"], ensure_ascii=False)
        out: dict[str, Any] = {"function": tc, "type": "function", "id": tc_id}
        if self._streaming:
            out["index"] = self._idx
            self._idx += 1
        return out

    def __call__(self, tool_calls: Sequence[str]) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = []
        if not tool_calls or self._tool_parser is None:
            return result
        for tool_text in tool_calls:
            try:
                parsed = self._tool_parser(tool_text, self._tools)
            except (ValueError, json.JSONDecodeError) as e:
                logger.warning("Failed to parse tool call (%s: %s) — tool text was likely "
                               "truncated mid-generation.", type(e).__name__, e)
                continue
            except Exception as e:  # noqa: BLE001 - a parser's bug fails no request
                logger.warning("Failed to parse tool call (%s: %s)", type(e).__name__, e)
                continue
            if not isinstance(parsed, list):
                parsed = [parsed]
            result.extend(self._format(tc) for tc in parsed
                          if isinstance(tc, dict) and "arguments" in tc)
        return result
