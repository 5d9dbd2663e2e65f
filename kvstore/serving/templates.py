"""What a model's chat template can render, found by rendering probes, and what the server
does where it cannot.

Agents send two things some templates cannot render:

- **tools**: a template that never prints ``tools`` (SmolLM2's) renders a request with tools
  exactly as one without, so an agent's tools would be dropped without a word. Found by
  rendering a probe conversation with and without :data:`PROBE_TOOL`: the same text, no
  tools. The server then refuses a request with tools (:func:`no_tools_message`), unless
  the operator chose to drop them.
- **a system message in the conversation's midst** (Claude Code's environment block, sent
  after the first user message): some templates raise on it ("System message must be at
  the beginning", "roles must alternate"), some leave it out. Found by rendering a probe
  conversation with one: the template must render it, and print its text. Where it
  cannot, the fallback :func:`system_into_user` (named ``system-into-user``) puts its text
  in a user message. It depends only on the messages before and at it, so it is the same
  from turn to turn and the prompt's prefix holds.

Pure: the caller hands in a function that renders messages and tools with the model's
template (:data:`Render`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["FALLBACK", "PROBE_TOOL", "Abilities", "Render", "no_tools_message", "probe",
           "system_into_user"]

#: Renders (messages, tools or None) with the generation prompt, as text.
Render = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str]

#: The name of the mid-conversation system message's fallback (the request log's
#: ``rewrites`` names it when it fires).
FALLBACK = "system-into-user"

PROBE_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "kvstore_probe_tool", "description": "A tool that shows whether tools render.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}
_MID = "kvstore-probe: a system message in the conversation's midst."


@dataclass(frozen=True)
class Abilities:
    """What the template renders: ``tools``; ``mid_system``, a system message after the
    first user message, in place."""

    tools: bool
    mid_system: bool


def _renders(render: Render, messages: list[dict[str, Any]],
             tools: list[dict[str, Any]] | None) -> str | None:
    try:
        return render(messages, tools)
    except Exception:  # noqa: BLE001 - a template that raises renders nothing
        return None


def probe(render: Render) -> Abilities:
    """The template's :class:`Abilities`, by rendering probe conversations."""
    chat = [{"role": "system", "content": "You are a probe."},
            {"role": "user", "content": "Hello."}]
    bare = _renders(render, chat, None)
    with_tool = _renders(render, chat, [PROBE_TOOL])
    tools = bare is not None and with_tool is not None and bare != with_tool
    mid = {"role": "system", "content": _MID}
    mid_system = all(
        (out := _renders(render, msgs, None)) is not None and _MID in out
        for msgs in ([*chat, mid], [*chat, mid, {"role": "user", "content": "Go on."}],
                     [chat[1], mid]))
    return Abilities(tools=tools, mid_system=mid_system)


def no_tools_message(model: str, option: str) -> str:
    """The error a request with tools gets from a model whose template renders none."""
    return (f"the chat template of {model} renders no tools: the request's tools would be "
            f"dropped, and an agent that calls tools cannot work with this model. Serve a "
            f"model whose template renders tools, or start the server with {option} to "
            f"accept such requests and drop their tools")


def _text(content: Any) -> list[dict[str, Any]]:
    """A message's content as text parts."""
    if isinstance(content, list):
        return [dict(p) if isinstance(p, Mapping) else p for p in content]
    return [{"type": "text", "text": "" if content is None else str(content)}]


def system_into_user(body: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
    """The chat ``body`` with every system message after the first non-system one moved
    into a user message: appended to the user message just before it (after a blank line),
    else put before the user message just after it, else made a user message of its own.
    Content becomes text parts, so a breakpoint on a part keeps its part (the caller reads
    the marks after this). Returns the new body and how many messages moved (the body
    given is not changed)."""
    out = dict(body)
    messages = body.get("messages")
    if not isinstance(messages, list):
        return out, 0
    leading = 0
    while leading < len(messages) and isinstance(messages[leading], Mapping) \
            and messages[leading].get("role") in ("system", "developer"):
        leading += 1
    new: list[Any] = list(messages[:leading])
    moved = 0
    pending: list[dict[str, Any]] = []  # system text waiting for the next user message
    for m in messages[leading:]:
        if not isinstance(m, Mapping):
            new.append(m)
            continue
        role = m.get("role")
        if role in ("system", "developer"):
            moved += 1
            parts = _text(m.get("content")) or [{"type": "text", "text": ""}]
            if "cache_control" in m:  # a mark on the message: the end of its text
                parts[-1] = {**parts[-1], "cache_control": m["cache_control"]}
            prev = new[-1] if new else None
            if isinstance(prev, dict) and prev.get("role") == "user" and not pending:
                new[-1] = {**prev, "content": [*_text(prev.get("content")),
                                               {"type": "text", "text": "\n\n"}, *parts]}
            else:
                pending += [*parts, {"type": "text", "text": "\n\n"}]
            continue
        if pending and role == "user":
            new.append({**m, "content": [*pending, *_text(m.get("content"))]})
            pending = []
            continue
        if pending:  # no user message next: the system text is a user message of its own
            new.append({"role": "user", "content": pending[:-1]})
            pending = []
        new.append(m)
    if pending:
        new.append({"role": "user", "content": pending[:-1]})
    if moved:
        out["messages"] = new
    return out, moved
