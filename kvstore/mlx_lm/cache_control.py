"""Cache breakpoints: a chat request's ``cache_control`` marks (Anthropic's prompt caching, as
OpenRouter carries it on chat messages) made entries that the store keeps for their TTL.

A breakpoint is ``{"type": "ephemeral"}`` (optionally ``"ttl": "5m"`` or ``"1h"``; 5m by
default) on a message's content part (``{"type": "text", "text": ..., "cache_control":
...}``), on a message, or on a tool definition; a ``cache_control`` field at the top of the
body is the SDK's automatic caching: a breakpoint at the last block of the last message.
At most :data:`MAX_BREAKPOINTS`, as Anthropic allows.

The server (:mod:`kvstore.server.openai`) reads and strips the marks from the body
(:func:`take_breakpoints`: the chat template never sees them; a malformed mark is a 400
answer), finds each mark's token position (where the messages up to and including the
marked block, rendered with the same template, part from the whole prompt) and hands the
cache at exactly that token to the prompt cache, with a type that names the pin
(:func:`pin_type`); the positions are also given to the prompt cache
(``set_breakpoints``), which counts a use of each one a request reuses.

The prompt cache keeps the entry in memory beside mlx-lm's LRU and saves it to the store
with its TTL (``Store.save(pin_ttl=...)``): see :class:`~kvstore.mlx_lm.PersistentPromptCache`
and :mod:`kvstore.local.gc` for how long and within which share of the budgets.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

__all__ = [
    "FIELD",
    "MAX_BREAKPOINTS",
    "TTLS",
    "Breakpoint",
    "parse_pin_type",
    "pin_type",
    "take_breakpoints",
]

logger = logging.getLogger("kvstore.mlx_lm")

FIELD = "cache_control"
#: The TTLs a mark may name, in seconds (Anthropic's two).
TTLS = {"5m": 300.0, "1h": 3600.0}
MAX_BREAKPOINTS = 4


@dataclasses.dataclass(frozen=True)
class Breakpoint:
    """Where a mark is: ``message`` (an index into the messages) and ``part`` (into its
    content list; None: the whole message), or ``tool`` (an index into the tools)."""

    ttl: float
    message: int | None = None
    part: int | None = None
    tool: int | None = None


def _ttl(mark: object, where: str) -> float:
    if not isinstance(mark, dict) or mark.get("type") != "ephemeral":
        raise ValueError(f"{where}: cache_control must be {{\"type\": \"ephemeral\"}} "
                         "(optionally with \"ttl\": \"5m\" or \"1h\")")
    ttl = mark.get("ttl", "5m")
    if ttl not in TTLS:
        raise ValueError(f"{where}: cache_control ttl must be \"5m\" or \"1h\", not {ttl!r}")
    return TTLS[ttl]


def take_breakpoints(body: dict[str, Any]) -> list[Breakpoint]:
    """The marks of a chat request ``body``, removed from it (ValueError: a malformed one,
    or more than :data:`MAX_BREAKPOINTS`)."""
    found: list[Breakpoint] = []
    messages = body.get("messages")
    if isinstance(messages, list):
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                continue
            if FIELD in m:
                found.append(Breakpoint(_ttl(m.pop(FIELD), f"messages[{i}]"), message=i))
            content = m.get("content")
            if isinstance(content, list):
                for j, p in enumerate(content):
                    if isinstance(p, dict) and FIELD in p:
                        found.append(Breakpoint(_ttl(p.pop(FIELD), f"messages[{i}].content[{j}]"),
                                                message=i, part=j))
    tools = body.get("tools")
    if isinstance(tools, list):
        for k, t in enumerate(tools):
            if isinstance(t, dict) and FIELD in t:
                found.append(Breakpoint(_ttl(t.pop(FIELD), f"tools[{k}]"), tool=k))
    if FIELD in body:  # automatic caching: the last block of the last message
        ttl = _ttl(body.pop(FIELD), FIELD)
        if isinstance(messages, list) and messages:
            last = messages[-1]
            content = last.get("content") if isinstance(last, dict) else None
            part = len(content) - 1 if isinstance(content, list) and content else None
            found.append(Breakpoint(ttl, message=len(messages) - 1, part=part))
    if len(found) > MAX_BREAKPOINTS:
        raise ValueError(f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be "
                         f"provided. Found {len(found)}.")
    return found


# --- the segment type of a pinned cut -----------------------------------------------------

_TYPE_PREFIX = "pin:"


def pin_type(ttl: float, priority: str) -> str:
    """The segment type of a cut at a breakpoint (what ``insert_cache`` receives)."""
    return f"{_TYPE_PREFIX}{ttl:g}:{priority}"


def parse_pin_type(cache_type: str) -> tuple[float, str] | None:
    """``(ttl, priority)`` of a pinned cut's segment type; None for any other type."""
    if not cache_type.startswith(_TYPE_PREFIX):
        return None
    ttl, _, priority = cache_type[len(_TYPE_PREFIX):].partition(":")
    try:
        seconds = float(ttl)
    except ValueError:
        return None
    if priority not in ("system", "user", "assistant") or not seconds > 0:
        return None
    return seconds, priority
