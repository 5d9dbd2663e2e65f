"""Prefix-stability rules: named rewrites of a chat request body that change no meaning
and keep its prompt's prefix the same from one request to the next.

A prompt cache reuses a prompt's leading tokens only while they are the same tokens.
Coding agents break their own prefix: Claude Code puts a billing line with a nonce in its
system prompt, opencode the day's date, some clients serialize tool schemas and tool-call
arguments with their keys in another order from one turn to the next. Each rule below
undoes one such habit.
A rule is a pure function of the chat body (an OpenAI chat-completions body: ``messages``,
``tools``; the Messages and Responses adapters build one): it returns a new body (the
one given is not changed) and how many places it rewrote (0: it did not fire).

:data:`RULES` is the one table: ``kvstore serve`` applies the enabled ones in its order
before mlx-lm templates the request, counts each that fired in the request's log line
and in ``/metrics``, and docs/CLI.md's table of rules is checked against it.

Considered and left out (docs/CLI.md says so too): a mid-conversation system message
that a template hoists into the first system block, and reasoning that a template drops
from earlier assistant turns, both change the prompt's prefix, but only the chat
template decides them, and moving or dropping a message changes what the model sees: a
request's log line names the message where its prompt parted from the stored one
instead (``part_msg``, ``part_block``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvstore.errors import KVStoreError

__all__ = ["RULES", "Rule", "UnknownRuleError", "names", "rewrite", "select"]

Body = Mapping[str, Any]


@dataclass(frozen=True)
class Rule:
    """One rewrite: its name (the ``--no-rule`` argument, the log's and the metric's
    label), a one-line summary (docs/CLI.md's table) and the function."""

    name: str
    summary: str
    apply: Callable[[Body], tuple[dict[str, Any], int]]


class UnknownRuleError(KVStoreError, ValueError):
    """A rule name that :data:`RULES` does not hold."""


# --- claude-billing-header -------------------------------------------------------------

#: Claude Code's first system block: ``x-anthropic-billing-header: cc_version=2.1.37.a3f;
#: cc_entrypoint=cli; cch=9f2c1;`` (``cch`` new on every request; 2.1.332 sends none, and
#: the 3-hex suffix of ``cc_version`` is the same in every session of a version). The line
#: goes with its line break: its ``name=value;`` fields, any it may gain later included, and
#: nothing after the last ``;`` (a client that joins the system blocks without a line break
#: leaves the next block's text right after it).
BILLING_LINE = re.compile(r"^x-anthropic-billing-header:(?:[ \t]*[\w.-]+=[^;\n]*;)*[ \t]*"
                          r"(?:\r?\n)*", re.MULTILINE)


def _strip_billing(text: str) -> tuple[str, int]:
    return BILLING_LINE.subn("", text)


def claude_billing_header(body: Body) -> tuple[dict[str, Any], int]:
    """Remove Claude Code's ``x-anthropic-billing-header: …; cch=<5 hex>;`` line from the
    system prompt: the first message when it is a system (or developer) message, in its
    string content or its first text part (a part left empty stays, empty, so that the
    parts keep their places for the breakpoints that name them). The line is a billing
    nonce for Anthropic's API, not an instruction."""
    out = dict(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[0], dict):
        return out, 0
    first = messages[0]
    if first.get("role") not in ("system", "developer"):
        return out, 0
    content = first.get("content")
    n = 0
    if isinstance(content, str):
        text, n = _strip_billing(content)
        new_content: Any = text
    elif isinstance(content, list):
        i = next((i for i, p in enumerate(content)
                  if isinstance(p, dict) and p.get("type") == "text"
                  and isinstance(p.get("text"), str)), None)
        if i is None:
            return out, 0
        text, n = _strip_billing(content[i]["text"])
        parts = list(content)
        parts[i] = {**content[i], "text": text}
        new_content = parts
    if n:
        out["messages"] = [{**first, "content": new_content}, *messages[1:]]
    return out, n


# --- sorted-tool-schemas ---------------------------------------------------------------

def _sorted(value: Any) -> tuple[Any, bool]:
    """``value`` with every dict's keys in sorted order (lists keep theirs), and whether
    any order changed."""
    if isinstance(value, dict):
        changed = list(value) != sorted(value, key=str)
        out = {}
        for k in sorted(value, key=str):
            out[k], c = _sorted(value[k])
            changed = changed or c
        return out, changed
    if isinstance(value, list):
        items = [_sorted(v) for v in value]
        return [v for v, _ in items], any(c for _, c in items)
    return value, False


def sorted_tool_schemas(body: Body) -> tuple[dict[str, Any], int]:
    """Put the keys of every object in ``tools`` (the definitions and their JSON schemas)
    in sorted order, recursively; list order (``required``, ``enum``) is kept. Chat
    templates render tools with ``tojson``, which keeps key order: a client that builds
    its schemas in another order from one request to the next changes the prompt from
    the first tool on. Counts the tools whose order changed."""
    out = dict(body)
    tools = body.get("tools")
    if not isinstance(tools, list):
        return out, 0
    new, n = [], 0
    for t in tools:
        s, changed = _sorted(t)
        new.append(s)
        n += changed
    if n:
        out["tools"] = new
    return out, n


# --- sorted-tool-arguments -------------------------------------------------------------

def _sorted_arguments(args: Any) -> tuple[Any, bool]:
    if isinstance(args, dict):
        return _sorted(args)
    if not isinstance(args, str):
        return args, False
    try:
        parsed = json.loads(args)
    except ValueError:
        return args, False  # not JSON: rendered as the client sent it
    if not isinstance(parsed, dict):
        return args, False
    s, changed = _sorted(parsed)
    # mlx-lm parses a string back into an object before templating, and the template
    # chooses the separators: only the key order reaches the prompt.
    return (json.dumps(s, ensure_ascii=False) if changed else args), changed


def sorted_tool_arguments(body: Body) -> tuple[dict[str, Any], int]:
    """Put the keys of each assistant tool call's ``arguments`` (a JSON object, or a
    string holding one) in sorted order, recursively. The same call then renders the
    same tokens whatever order the client serialized it in. A call the model wrote in
    another order is rendered sorted too, so the reply's own snapshot serves the next
    prompt only up to that call (the prompt before it is kept whole). Counts the calls
    whose order changed."""
    out = dict(body)
    messages = body.get("messages")
    if not isinstance(messages, list):
        return out, 0
    new, n = [], 0
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if not isinstance(calls, list):
            new.append(m)
            continue
        new_calls, changed_here = [], 0
        for c in calls:
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or "arguments" not in fn:
                new_calls.append(c)
                continue
            args, changed = _sorted_arguments(fn["arguments"])
            changed_here += changed
            new_calls.append({**c, "function": {**fn, "arguments": args}} if changed else c)
        n += changed_here
        new.append({**m, "tool_calls": new_calls} if changed_here else m)
    if n:
        out["messages"] = new
    return out, n


# --- opencode-env-date --------------------------------------------------------------

#: opencode's system prompt ends its ``<env>`` block with the day's date
#: (``  Today's date: Sun Dec 06 2026``), before its skills and, in the template, every tool.
ENV_DATE = re.compile(r"^[ \t]*Today's date: [^\n]*\n", re.MULTILINE)


def _env_date(text: str) -> tuple[str, str | None]:
    """``text`` without the date line of its ``<env>`` block, and the line (None: none)."""
    start, end = text.find("<env>"), text.find("</env>")
    if start == -1 or end < start:
        return text, None
    m = ENV_DATE.search(text, start, end + 1)
    if m is None:
        return text, None
    return text[:m.start()] + text[m.end():], m.group(0).strip()


def opencode_env_date(body: Body) -> tuple[dict[str, Any], int]:
    """Move opencode's ``Today's date: …`` line from the ``<env>`` block of the system
    prompt to the end of the first user message. The date changes once a day, and where
    opencode puts it every tool and the whole conversation come after it: a session
    resumed on another day recomputed three quarters of its prompt. After the first user
    message (where Claude Code puts its environment), a new day costs only the
    conversation. The model reads the same line, later."""
    out = dict(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[0], dict) \
            or messages[0].get("role") not in ("system", "developer"):
        return out, 0
    first = messages[0]
    content = first.get("content")
    if not isinstance(content, str):
        return out, 0
    text, line = _env_date(content)
    user = next((i for i, m in enumerate(messages)
                 if isinstance(m, dict) and m.get("role") == "user"), None)
    if line is None or user is None:
        return out, 0
    u = messages[user]
    uc = u.get("content")
    if isinstance(uc, str):
        moved: Any = f"{uc}\n\n{line}"
    elif isinstance(uc, list):
        moved = [*uc, {"type": "text", "text": f"\n\n{line}"}]
    else:
        return out, 0
    new = list(messages)
    new[0] = {**first, "content": text}
    new[user] = {**u, "content": moved}
    out["messages"] = new
    return out, 1


#: The rules, in the order they are applied; every one is on unless turned off.
RULES: tuple[Rule, ...] = (
    Rule("claude-billing-header",
         "removes Claude Code's `x-anthropic-billing-header: …; cch=…;` line (a new nonce "
         "every request) from the first system message",
         claude_billing_header),
    Rule("sorted-tool-schemas",
         "sorts the keys of every object in `tools`, recursively (list order is kept)",
         sorted_tool_schemas),
    Rule("sorted-tool-arguments",
         "sorts the keys of each assistant tool call's `arguments`, recursively",
         sorted_tool_arguments),
    Rule("opencode-env-date",
         "moves opencode's `Today's date: …` line from the system prompt's `<env>` block "
         "to the end of the first user message",
         opencode_env_date),
)


def names() -> list[str]:
    """The rules' names, in :data:`RULES`' order."""
    return [r.name for r in RULES]


def select(*, only: str | None = None, off: Iterable[str] = ()) -> tuple[str, ...]:
    """The names enabled by ``--rules`` (``only``: comma-separated names, ``none`` or
    empty for none; None: all) less ``--no-rule`` ones (``off``); an unknown name is an
    :class:`UnknownRuleError` that lists the known ones."""
    known = names()
    chosen = list(known) if only is None else [
        n.strip() for n in only.split(",") if n.strip() and n.strip() != "none"]
    off = list(off)
    for n in chosen + off:
        if n not in known:
            raise UnknownRuleError(f"no rule named {n!r} (rules: {', '.join(known)})")
    return tuple(n for n in known if n in chosen and n not in off)


def rewrite(body: Body, enabled: Iterable[str]) -> tuple[dict[str, Any], dict[str, int]]:
    """``body`` after the ``enabled`` rules (in :data:`RULES`' order), and how many places
    each that fired rewrote (rules that did not fire are left out)."""
    on = set(enabled)
    out, fired = dict(body), {}
    for rule in RULES:
        if rule.name in on:
            out, n = rule.apply(out)
            if n:
                fired[rule.name] = n
    return out, fired
