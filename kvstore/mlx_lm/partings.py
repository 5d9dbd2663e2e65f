"""Where in a chat request a token position falls: the message, its role, the kind of
block and how many of that message's tokens come before it (the ``part_*`` fields of the
request log, :class:`~kvstore.mlx_lm.requests.Parting`).

The prompt is rendered once by mlx-lm; this module renders it again only when a request
parted from a stored sequence, and then only the leading ``k`` messages for about
``log2(messages)`` values of ``k`` (a bisection on where message ``k`` starts): a
100k-token transcript of 200 messages costs 8 renders, never one per message. The
renders are the template's text, not tokens (a few ms where tokenizing costs a hundred):
the parting token's place in the text is the length of the prompt's tokens before it,
decoded, and a message's first token is found by bisecting such decodes. A tokenizer
whose decoding does not give back the rendered text is handled in tokens instead.

Message ``k`` starts at ``t(k)``, the tokens that the rendering of the first ``k``
messages (no generation prompt) shares with the prompt; a position ``p`` is in the last
message ``k`` with ``t(k) <= p`` (``k`` = the number of messages: the generation prompt
after them). A template may refuse a conversation without a user message (Qwen's do):
the first ``k`` messages are then rendered with an empty user message after them.

The block of a message: ``tool_result`` (role ``tool``), ``tool_use`` (an assistant
message's tool calls, from where they start), ``thinking`` (an assistant message's
reasoning: ``reasoning_content``, ``reasoning`` or ``thinking``), ``tools`` (the tool
definitions the first message renders), else ``text``. A part is found where it is in
the prompt by rendering the message once more without it: the tokens by which the two
renderings differ (a template that drops the part renders none, and the position counts
as the message's text). It is the prompt's side that is named: a stored sequence that
goes on with reasoning the template has since dropped parts at the next block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["MessageMap", "locator"]

REASONING = ("reasoning_content", "reasoning", "thinking")  # an assistant message's

Render = Callable[[list[dict[str, Any]], bool], Sequence[Any]]  # (messages, with tools)


def _common(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items ``a`` and ``b`` share (slices compared in C, by bisection)."""
    lo, hi = 0, min(len(a), len(b))  # the first lo match; more than hi do not
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class MessageMap:
    """The messages of one request and how to render their leading ones."""

    def __init__(self, messages: list[dict[str, Any]], render: Render, *,
                 has_tools: bool) -> None:
        self.messages = messages
        self.render = render
        self.has_tools = has_tools
        self._starts: dict[int, int] = {0: 0}

    def start(self, k: int, prompt: Sequence[Any]) -> int:
        """``t(k)``: where message ``k`` starts in ``prompt`` (the rendering of the first
        ``k`` messages shares that many tokens with it)."""
        if k not in self._starts:
            self._starts[k] = _common(self._render(self.messages[:k], True), prompt)
        return self._starts[k]

    def locate(self, prompt: Sequence[Any], position: int) -> tuple[int, str, str, int]:
        """``(message index, role, block, items of the message before position)``."""
        k, role, block, start = self.place(prompt, position)
        return k, role, block, position - start

    def place(self, prompt: Sequence[Any], position: int) -> tuple[int, str, str, int]:
        """``(message index, role, block, where the message starts)``."""
        lo, hi = 0, len(self.messages)  # t(lo) <= position
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.start(mid, prompt) <= position:
                lo = mid
            else:
                hi = mid - 1
        start = self.start(lo, prompt)
        if lo == len(self.messages):
            return lo, "assistant", "generation_prompt", start
        m = self.messages[lo]
        role = str(m.get("role", "-"))
        return lo, role, self._block(lo, m, role, position), start

    def _block(self, k: int, m: dict[str, Any], role: str, position: int) -> str:
        if role == "tool":
            return "tool_result"
        if role == "assistant":
            if any(m.get(f) for f in REASONING):
                lo, hi = self._span(k, {f: v for f, v in m.items() if f not in REASONING})
                if lo <= position < hi:
                    return "thinking"
            if m.get("tool_calls"):
                lo, _ = self._span(k, {f: v for f, v in m.items() if f != "tool_calls"})
                if position >= lo:
                    return "tool_use"
            return "text"
        if k == 0 and self.has_tools:
            lo, hi = self._span(0, None)
            if lo <= position < hi:
                return "tools"
        return "text"

    def _render(self, msgs: list[dict[str, Any]], with_tools: bool) -> Sequence[Any]:
        try:
            return self.render(msgs, with_tools)
        except Exception:  # noqa: BLE001 - a template that wants a user message
            return self.render([*msgs, {"role": "user", "content": ""}], with_tools)

    def _span(self, k: int, variant: dict[str, Any] | None) -> tuple[int, int]:
        """The tokens of the first ``k + 1`` messages' rendering that differ when message
        ``k`` is ``variant`` instead (None: when rendered without the tools): the common
        head and tail cut off. Where a part of a message (its reasoning, its tool calls,
        the tool definitions) lies."""
        head_msgs = self.messages[:k + 1]
        full = self._render(head_msgs, True)
        alt = self._render(head_msgs if variant is None else [*self.messages[:k], variant],
                           variant is not None)
        head = _common(full, alt)
        tail = _common(full[head:][::-1], alt[head:][::-1])
        return head, len(full) - tail


def locator(tokenizer: Any, messages: list[dict[str, Any]], tools: list[Any] | None,
            template_args: dict[str, Any]
            ) -> Callable[[Sequence[int], int], tuple[int, str, str, int]]:
    """:meth:`MessageMap.locate` for a request that mlx-lm templated with ``tokenizer``'s
    chat template, ``tools`` and ``template_args`` (its chat template arguments), in
    tokens of the prompt."""

    def render(tokenize: bool) -> Render:
        def run(msgs: list[dict[str, Any]], with_tools: bool) -> Sequence[Any]:
            out = tokenizer.apply_chat_template(
                msgs, tools=tools if with_tools else None, tokenize=tokenize,
                add_generation_prompt=False, **template_args)
            return str(out) if not tokenize else list(out)
        return run

    def decode(tokens: Sequence[int]) -> str:
        return str(tokenizer.decode(list(tokens)))

    def locate(prompt: Sequence[int], position: int) -> tuple[int, str, str, int]:
        text = str(tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True,
            **template_args))
        head = decode(prompt[:position])
        if not text.startswith(head) or decode(prompt) != text:
            return MessageMap(messages, render(True), has_tools=bool(tools)).locate(
                prompt, position)
        k, role, block, start = MessageMap(messages, render(False),
                                           has_tools=bool(tools)).place(text, len(head))
        return k, role, block, position - first_token(prompt, position, len(head), start)

    def first_token(prompt: Sequence[int], position: int, at: int, start: int) -> int:
        """The fewest leading tokens whose text reaches ``start`` (the ``position`` first
        make ``at`` characters): galloping back from ``position`` by decoding only the
        tokens after each try (cost: the message's own tokens before the parting), checked
        with two whole decodes; a bisection over whole decodes when the check fails."""
        def reaches(j: int) -> bool:
            return at - len(decode(prompt[j:position])) >= start

        step, hi = 1, position  # reaches(hi)
        lo = max(position - step, 0)
        while lo > 0 and reaches(lo):
            hi, step = lo, step * 2
            lo = max(position - step, 0)
        if lo == 0 and reaches(0):
            hi = 0
        while lo < hi:  # reaches(hi), not reaches(lo) (or lo == 0)
            mid = (lo + hi) // 2
            if reaches(mid):
                hi = mid
            else:
                lo = mid + 1
        if len(decode(prompt[:hi])) >= start and (
                hi == 0 or len(decode(prompt[:hi - 1])) < start):
            return hi
        lo, hi = 0, position
        while lo < hi:
            mid = (lo + hi) // 2
            if len(decode(prompt[:mid])) < start:
                lo = mid + 1
            else:
                hi = mid
        return lo

    return locate
