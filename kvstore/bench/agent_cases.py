"""A replayed coding-agent session (issue 34): the prompts a coding agent sends, turn after
turn, with the habits that break a prefix cache, driven through ``kvstore serve``.

The session: a system prompt and 20 tool definitions (about 6k tokens of the tiny
models' tokenizer), then 12 requests of the main agent, each the whole history so far:
a task, then a tool call and its result per turn. After the main agent's 6th request a
subagent starts with the same system prompt and tools and makes 3 requests of its own;
then the main agent goes on. Every request's first system block is Claude Code's billing
line with a new random ``cch``; the tool schemas' and the tool calls' keys come in
another order on every request (a client that rebuilds them from a map). The replies are
scripted (the tiny models' are noise): a request asks for one token, the next request
carries the scripted tool call instead, as an agent's client sends back what its model
chose.

The session is written once, in the shape of Anthropic's Messages API (system blocks,
``tool_use`` and ``tool_result``), and a :class:`Driver` sends it in its own API:
:class:`AnthropicMessagesDriver` (``/v1/messages`` with the ``anthropic`` client, as Claude
Code sends it) or :class:`OpenAIChatDriver` (``/v1/chat/completions`` with the ``openai``
client); a
Messages driver with the ``anthropic`` SDK plugs in beside it.

``kvstore bench --only agents`` measures the time to first token (a one-token request's
time) per request, through ``mlx_lm.server`` alone, ``kvstore serve`` and ``kvstore serve
--rules none``, on the tiny llama model (:func:`agent_rows`).
"""

from __future__ import annotations

import contextlib
import json
import random
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .common import Row
from .servers import server

Log = Callable[[str], None]

#: A ChatML template that renders tools, tool calls and tool results (Qwen's layout, with
#: the tiny tokenizer's special tokens): the tiny models' own template renders content only.
AGENT_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content }}"
    "{%- if tools %}{{- '\\n\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>' }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- if not loop.first %}"
    "{{- '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content"
    " + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": '"
    " + (call.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TOOL_NAMES = ("read_file", "write_file", "edit_file", "list_dir", "glob", "grep",
              "run_shell", "git_status", "git_diff", "git_commit", "web_fetch", "web_search",
              "todo_write", "ask_user", "run_tests", "lint", "format_code", "open_pr",
              "notebook_edit", "task")
BILLING = "x-anthropic-billing-header: cc_version=2.1.37.a3f; cc_entrypoint=cli; cch={};"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    input: dict[str, Any]


@dataclass(frozen=True)
class Turn:
    """One message of the history: the user's text, the assistant's tool calls, or a
    tool's result (``call_id`` names the call)."""

    role: str  # "user", "assistant", "tool"
    text: str = ""
    calls: tuple[ToolCall, ...] = ()
    call_id: str = ""


@dataclass(frozen=True)
class AgentRequest:
    """One request of the session, in the Messages API's shape: the system blocks, the
    tools (``name``, ``description``, ``input_schema``) and the history."""

    agent: str  # "main" or "subagent"
    system: tuple[str, ...]
    tools: tuple[dict[str, Any], ...]
    turns: tuple[Turn, ...]


def _words(n: int, seed: int) -> str:
    from ..tiny import sample_text

    return sample_text(n, seed=seed)


def tool_definitions(seed: int = 0) -> list[dict[str, Any]]:
    """The 20 tools: a description and a schema of two properties each (about 5.8k
    tokens of the tiny tokenizer, which splits JSON finely)."""
    out = []
    for i, name in enumerate(TOOL_NAMES):
        props = {p: {"type": t, "description": f"The {p} the {name} tool works on."}
                 for p, t in (("path", "string"), ("limit", "integer"))}
        out.append({"name": name, "description": _words(30, seed * 1000 + i),
                    "input_schema": {"type": "object", "properties": props,
                                     "required": ["path"]}})
    return out


def _shuffled(value: Any, rng: random.Random) -> Any:
    """``value`` with every dict's keys in a random order (what a client that builds its
    JSON from a hash map sends)."""
    if isinstance(value, dict):
        keys = list(value)
        rng.shuffle(keys)
        return {k: _shuffled(value[k], rng) for k in keys}
    if isinstance(value, list):
        return [_shuffled(v, rng) for v in value]
    return value


def session(*, turns: int = 12, subagent_at: int = 6, subagent_turns: int = 3,
            seed: int = 0, nonce: Callable[[], str] = lambda: secrets.token_hex(3)[:5],
            drift: bool = True) -> list[AgentRequest]:
    """The session's requests in the order they are sent (see the module's docstring).
    ``nonce``: each request's ``cch``; ``drift``: keys in a new order on every request."""
    system = _words(300, seed + 7)
    tools = tool_definitions(seed)
    rng = random.Random(seed)

    def step(i: int, agent: str) -> tuple[Turn, Turn]:
        name = TOOL_NAMES[(i * 7 + len(agent)) % len(TOOL_NAMES)]
        call = ToolCall(f"toolu_{agent}_{i:02d}", name,
                        {"path": f"src/module_{i}.py", "limit": 200 + i,
                         "options": {"context": 3, "follow": True}})
        return (Turn("assistant", calls=(call,)),
                Turn("tool", text=_words(110, seed * 100 + i + (50 if agent != "main" else 0)),
                     call_id=call.id))

    def request(agent: str, history: list[Turn]) -> AgentRequest:
        tl = tools
        hist = history
        if drift:
            tl = [_shuffled(t, rng) for t in tools]
            hist = [Turn(t.role, t.text, tuple(ToolCall(c.id, c.name, _shuffled(c.input, rng))
                                               for c in t.calls), t.call_id) for t in history]
        return AgentRequest(agent, (BILLING.format(nonce()), system), tuple(tl), tuple(hist))

    out: list[AgentRequest] = []
    main = [Turn("user", "Fix the failing test in the parser module and explain the cause.")]
    sub: list[Turn] = [Turn("user", "Find every caller of handler_3 and list their files.")]
    for i in range(turns):
        if i:
            main += step(i, "main")
        out.append(request("main", main))
        if i + 1 == subagent_at:
            for j in range(subagent_turns):
                if j:
                    sub += step(j, "subagent")
                out.append(request("subagent", sub))
    return out


# --- drivers: one API each ------------------------------------------------------------------


@dataclass(frozen=True)
class Sent:
    """What the server said of one request: its prompt and reused tokens, and the time to
    its first token (a one-token reply: the whole request)."""

    agent: str
    prompt_tokens: int
    cached_tokens: int
    seconds: float

    @property
    def reused(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Driver(Protocol):
    def send(self, request: AgentRequest) -> Sent: ...


def openai_chat_body(request: AgentRequest) -> dict[str, Any]:
    """The request as ``/v1/chat/completions`` takes it: the system blocks one system
    message (a line each), tools as functions, tool calls with JSON arguments."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "\n".join(request.system)}]
    for t in request.turns:
        if t.role == "assistant":
            messages.append({"role": "assistant", "content": t.text, "tool_calls": [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": json.dumps(c.input)}}
                for c in t.calls]})
        elif t.role == "tool":
            messages.append({"role": "tool", "tool_call_id": t.call_id, "content": t.text})
        else:
            messages.append({"role": "user", "content": t.text})
    tools = [{"type": "function", "function": {"name": d["name"],
                                               "description": d["description"],
                                               "parameters": d["input_schema"]}}
             for d in request.tools]
    return {"messages": messages, "tools": tools}


@dataclass
class OpenAIChatDriver:
    """Sends each request to ``/v1/chat/completions`` with the official ``openai`` client."""

    client: Any
    model: str = "default_model"

    def send(self, request: AgentRequest) -> Sent:
        body = openai_chat_body(request)
        t0 = time.perf_counter()
        r = self.client.chat.completions.create(model=self.model, max_tokens=1,
                                                temperature=0.0, **body)
        seconds = time.perf_counter() - t0
        details = r.usage.prompt_tokens_details
        cached = (details.cached_tokens or 0) if details else 0
        return Sent(request.agent, r.usage.prompt_tokens, cached, seconds)


def anthropic_messages_body(request: AgentRequest) -> dict[str, Any]:
    """The request as Claude Code sends it to ``/v1/messages``: the system blocks as text
    blocks (the billing line the first), tools with their ``input_schema``, each call a
    ``tool_use`` block of the assistant and each result a ``tool_result`` block of the
    user."""
    messages: list[dict[str, Any]] = []
    for t in request.turns:
        if t.role == "assistant":
            blocks: list[dict[str, Any]] = [{"type": "text", "text": t.text}] if t.text else []
            blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.input}
                       for c in t.calls]
            messages.append({"role": "assistant", "content": blocks})
        elif t.role == "tool":
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": t.call_id, "content": t.text}]})
        else:
            messages.append({"role": "user", "content": t.text})
    return {"system": [{"type": "text", "text": text} for text in request.system],
            "tools": list(request.tools), "messages": messages}


@dataclass
class AnthropicMessagesDriver:
    """Sends each request to ``/v1/messages`` with the official ``anthropic`` client, as
    Claude Code does; the prompt is the three usage figures' sum."""

    client: Any
    model: str = "default_model"

    def send(self, request: AgentRequest) -> Sent:
        body = anthropic_messages_body(request)
        t0 = time.perf_counter()
        # current SDKs send no sampling parameters: the server's defaults (greedy) hold
        r = self.client.messages.create(model=self.model, max_tokens=1, **body)
        seconds = time.perf_counter() - t0
        u = r.usage
        read = u.cache_read_input_tokens or 0
        prompt = u.input_tokens + read + (u.cache_creation_input_tokens or 0)
        return Sent(request.agent, prompt, read, seconds)


def replay(driver: Driver, requests: Sequence[AgentRequest]) -> list[Sent]:
    """Send the session's requests in order."""
    return [driver.send(r) for r in requests]


# --- servers ---------------------------------------------------------------------------------


def serve_args(model_dir: Path, root: Path | None, extra: Sequence[str] = ()) -> list[str]:
    """The arguments of ``kvstore serve`` (``root`` None: of ``mlx_lm.server``) for the
    session: the model, the template that renders tools, a log line per request."""
    args = ["--model", str(model_dir), "--chat-template", AGENT_TEMPLATE,
            "--log-level", "INFO", *extra]
    return args if root is None else ["--root", str(root), "--min-tokens", "64", *args]


def openai_driver(port: int) -> OpenAIChatDriver:
    import openai

    return OpenAIChatDriver(openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1",
                                          api_key="unused", timeout=600, max_retries=0))


def anthropic_driver(port: int) -> AnthropicMessagesDriver:
    import anthropic

    return AnthropicMessagesDriver(anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}",
                                                       api_key="unused", timeout=600,
                                                       max_retries=0))


@dataclass
class Run:
    label: str
    sent: list[Sent] = field(default_factory=list)


def agent_rows(scratch: Path, log: Log) -> list[Row]:
    """Time to first token per request of the session on the tiny llama model: through
    ``mlx_lm.server`` alone, ``kvstore serve`` (default rules) and ``kvstore serve
    --rules none``, each on a fresh root; one run each, the three interleaved by request
    (the same request sent to each in turn) so that the machine's load falls on all."""
    from ..tiny import make_tiny_model

    model = make_tiny_model(scratch / "agent-model", "llama")
    requests = session()
    modes: dict[str, tuple[str, Path | None, list[str]]] = {
             "mlx_lm.server": ("mlx_lm.server", None, []),
             "kvstore serve": ("kvstore.serve", scratch / "agents-root", []),
             "kvstore serve --rules none": ("kvstore.serve", scratch / "agents-root-off",
                                            ["--rules", "none"])}
    runs = {label: Run(label) for label in modes}
    log(f"[agents] {len(requests)} requests of a replayed agent session, tiny llama")
    with contextlib.ExitStack() as stack:
        drivers: dict[str, Driver] = {}
        for label, (module, root, args) in modes.items():
            port = stack.enter_context(server(module, serve_args(model, root, args),
                                              scratch / f"agents-{len(drivers)}.log"))
            drivers[label] = openai_driver(port)
        for r in requests:
            for label, d in drivers.items():
                runs[label].sent.append(d.send(r))
    for label, run in runs.items():
        log(f"  {label}: " + " ".join(f"{s.seconds * 1e3:.0f}ms/{s.reused:.0%}"
                                       for s in run.sent))
    base, kv, off = (runs[k].sent for k in modes)
    later = slice(1, None)

    def med(xs: Sequence[Sent]) -> float:
        from .common import median

        return median([s.seconds for s in xs])

    extra: dict[str, float] = {f"ttft_ms_{i + 1}_{key}": s.seconds * 1e3 for key, sent in
             (("baseline", base), ("kvstore", kv), ("rules_off", off))
             for i, s in enumerate(sent)}
    extra.update({f"reused_{i + 1}_{key}": s.reused for key, sent in
                  (("kvstore", kv), ("rules_off", off)) for i, s in enumerate(sent)})
    return [
        Row("agents", "agent session: time to first token, requests 2-15 median (tiny llama)",
            "s", med(kv[later]), med(base[later]), "mlx_lm.server alone", "speedup",
            extra=extra),
        Row("agents", "agent session: time to first token, requests 2-15 median, rules off "
            "(tiny llama)", "s", med(kv[later]), med(off[later]),
            "kvstore serve --rules none", "speedup"),
    ]

