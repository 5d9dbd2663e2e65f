"""OpenAI's chat and text completions for ``kvstore serve``: a request body in, the engine's
job out (:func:`prepare_chat`, :func:`prepare_text`); the engine's events in, mlx_lm.server
0.32.2's answer out (:class:`Answer`). Pure: no HTTP, no threads.

What a chat request goes through, in the old server's order (``kvstore/mlx_lm/serve.py``
and its hooks):

1. its parameters are checked (:mod:`kvstore.server.params`, which lists every field);
2. a system message the template cannot render in the conversation's midst goes into a
   user message (``system-into-user``, :mod:`kvstore.serving.templates`);
3. its ``cache_control`` marks are taken out (:mod:`kvstore.mlx_lm.cache_control`);
4. the prefix-stability rules rewrite it (:mod:`kvstore.serving.rules`);
5. tools for a template that renders none: a 400, or dropped with ``--drop-tools``;
6. it is rendered with the chat template (:mod:`kvstore.server.render`), and a prompt
   longer than the model's context or ``--max-prompt-tokens`` is a 400;
7. the marks become token positions (``Job.breakpoints``), the rules that fired and how to
   place a position among the messages the prompt cache's :class:`RequestContext`.

Every refusal is an :class:`~kvstore.serving.chat.ApiError` whose message is mlx-lm's (or
the old server's) text where it had one: the app writes it.

The answer: tokens' text through the tokenizer's reasoning and tool-call state machine
(:mod:`kvstore.server.tools`), tool calls parsed by its tool parser (``finish_reason``
``tool_calls``), reasoning as ``reasoning``, a stop string ends the answer before it
(:attr:`Answer.stop_hit`: the caller cancels the job with ``"stop"``), the JSON and the
stream chunks in mlx_lm.server's shapes (``generate_response``,
``completion_usage_response``).
"""

from __future__ import annotations

import copy
import platform
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvstore.mlx_lm.cache_control import FIELD as CACHE_CONTROL
from kvstore.mlx_lm.cache_control import pin_type, take_breakpoints
from kvstore.mlx_lm.partings import locator
from kvstore.mlx_lm.requests import RequestContext
from kvstore.serving.chat import ApiError, invalid
from kvstore.serving.rules import rewrite
from kvstore.serving.templates import FALLBACK, Abilities, no_tools_message, system_into_user

from .engine import Done, Job, Prefill, Token
from .params import parse_params
from .render import PromptTooLong, Rendered, breakpoint_positions, render_chat, render_text
from .tools import Machine, ToolCallFormatter

__all__ = ["Answer", "Prepared", "Served", "model_limits", "new_request_id", "prepare_chat",
           "prepare_text", "system_fingerprint"]

#: config.json keys that give a model's context length, in the order they are trusted
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                "max_sequence_length", "n_ctx", "sliding_window_size_max")


def system_fingerprint() -> str:
    """mlx_lm.server's ``system_fingerprint``: mlx-lm's and MLX's versions, the platform,
    the device's architecture."""
    import mlx.core as mx
    from mlx_lm._version import __version__

    try:
        arch = mx.device_info()["architecture"]
    except Exception:  # noqa: BLE001 - an MLX without device_info
        arch = "unknown"
    mlx_version = mx.__version__  # type: ignore[attr-defined]
    return f"{__version__}-{mlx_version}-{platform.platform()}-{arch}"


def model_limits(config: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """``(vocab_size, context_length)`` from a model's config.json (a multimodal model's
    ``text_config`` too); None where it says nothing."""
    configs = [config]
    if isinstance(config.get("text_config"), Mapping):
        configs.append(config["text_config"])
    vocab = next((int(c["vocab_size"]) for c in configs
                  if isinstance(c.get("vocab_size"), int) and c["vocab_size"] > 0), None)
    context = next((int(c[k]) for k in CONTEXT_KEYS for c in configs
                    if isinstance(c.get(k), int) and c[k] > 0), None)
    return vocab, context


@dataclass
class Served:
    """What the server serves, built once at start. ``defaults``: ``temp``, ``top_p``,
    ``top_k``, ``min_p``, ``max_tokens`` (the default and the ceiling),
    ``chat_template_args``, ``max_prompt_tokens`` (None: no limit but the context),
    ``num_draft_tokens``."""

    model_id: str
    aliases: set[str]
    tokenizer: Any
    vocab_size: int
    context_length: int | None
    abilities: Abilities
    drop_tools: bool = False
    rules: Sequence[str] = ()
    excerpts: bool = False
    defaults: dict[str, Any] = field(default_factory=dict)
    fingerprint: str = field(default_factory=system_fingerprint)


@dataclass
class Prepared:
    """A request ready for the engine. ``cuts``: where the prompt cache keeps a snapshot on
    the way (position -> mlx-lm's segment type: ``system``, ``user``, or a breakpoint's
    :func:`~kvstore.mlx_lm.cache_control.pin_type`); ``rewrites``: the rules that fired."""

    job: Job
    kind: Literal["chat", "text"]
    stream: bool
    include_usage: bool
    stops: list[str]
    model: str
    tools: list[Any] | None = None
    initial_state: str = "normal"
    cuts: dict[int, str] = field(default_factory=dict)
    asked_tokens: int | None = None
    rewrites: dict[str, int] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)


def new_request_id(kind: Literal["chat", "text"]) -> str:
    """mlx-lm's ids: ``chatcmpl-<uuid4>``, ``cmpl-<uuid4>``."""
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4()}"


def _limit(served: Served) -> int | None:
    """The most prompt tokens a request may have: the model's context, or less
    (``--max-prompt-tokens``)."""
    limits = [int(n) for n in (served.context_length, served.defaults.get("max_prompt_tokens"))
              if n is not None]
    return min(limits) if limits else None


def _check_length(n: int, served: Served, param: str) -> None:
    """A prompt the model cannot take: a 400 before any prefill."""
    if n == 0:
        raise invalid("the prompt is empty: it renders no tokens", param=param)
    limit = served.defaults.get("max_prompt_tokens")
    if served.context_length is not None and n > served.context_length:
        raise invalid(f"the prompt is {n} tokens, more than the model's context of "
                      f"{served.context_length} tokens", param=param)
    if limit is not None and n > int(limit):
        raise invalid(f"the prompt is {n} tokens, more than the server takes "
                      f"(--max-prompt-tokens {int(limit)})", param=param)


def _check_messages(messages: object) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid(f"messages[{i}] must be an object with a string role",
                          param="messages")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise invalid(f"messages[{i}].content must be a string, a list of parts or "
                          "null", param="messages")
        calls = m.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise invalid(f"messages[{i}].tool_calls must be a list", param="messages")
    return messages


def _template_args(served: Served, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    args = dict(served.defaults.get("chat_template_args") or {})
    args.update(kwargs)
    return args


def _render(served: Served, param: str, fn: Any, *args: Any, **kw: Any) -> Rendered:
    """A rendering, its failure a 400 (mlx-lm answered a 404 with the error's text)."""
    try:
        out: Rendered = fn(*args, **kw)
    except ApiError:
        raise
    except PromptTooLong as e:
        _check_length(e.tokens, served, param)
        raise  # not reached: the limit is the server's
    except Exception as e:  # noqa: BLE001 - the template's or the content's error: the client's
        raise invalid(str(e) or type(e).__name__, param=param) from None
    return out


def prepare_chat(body: Mapping[str, Any], served: Served) -> Prepared:
    """A ``/v1/chat/completions`` body (a JSON object) as a job; ApiError: refused."""
    if "messages" not in body:
        raise invalid("Request did not contain messages", param="messages")
    _check_messages(body["messages"])
    params = parse_params(body, served.defaults, served.vocab_size)
    work: dict[str, Any] = copy.deepcopy(dict(body))
    moved = 0
    if not served.abilities.mid_system:
        work, moved = system_into_user(work)
    try:
        marks = take_breakpoints(work)
    except ValueError as e:
        raise invalid(str(e), param=CACHE_CONTROL) from None
    fired: dict[str, int] = {}
    if served.rules:
        work, fired = rewrite(work, served.rules)
    if moved:
        fired[FALLBACK] = moved
    tools = work.get("tools") or None
    if tools is not None and not isinstance(tools, list):
        raise invalid("tools must be a list", param="tools")
    if tools and not served.abilities.tools:
        if not served.drop_tools:
            raise invalid(no_tools_message(served.model_id, "--drop-tools"), param="tools")
        tools = None
    role_mapping = work.get("role_mapping")
    if role_mapping is not None and not isinstance(role_mapping, dict):
        raise invalid("role_mapping must be an object", param="role_mapping")
    messages = work["messages"]
    args = _template_args(served, params.chat_template_kwargs)
    tok = served.tokenizer
    rendered = _render(served, "messages", render_chat, tok, messages, tools, args,
                       role_mapping, limit=_limit(served))
    found = breakpoint_positions(tok, messages, tools, args, rendered.prompt, marks)
    cuts = dict(rendered.cuts)
    for n, (ttl, priority) in found.items():
        cuts[n] = pin_type(ttl, priority)
    context = RequestContext(rewrites=dict(fired))
    if getattr(tok, "has_chat_template", False):
        context.locate = locator(tok, rendered.messages, tools, args)
    if served.excerpts:
        context.decode = lambda toks: str(tok.decode(list(toks)))
    job = Job(prompt=rendered.prompt, max_tokens=params.max_tokens, sampling=params.sampling,
              top_logprobs=params.top_logprobs, logprobs=params.logprobs, salt=params.salt,
              breakpoints={n: ttl for n, (ttl, _) in found.items()}, context=context,
              cuts=cuts)
    return Prepared(job=job, kind="chat", stream=params.stream,
                    include_usage=params.include_usage, stops=params.stops, model=params.model,
                    tools=tools, initial_state=rendered.initial_state, cuts=cuts,
                    asked_tokens=params.asked_tokens, rewrites=fired,
                    messages=rendered.messages)


def prepare_text(body: Mapping[str, Any], served: Served) -> Prepared:
    """A ``/v1/completions`` body (a JSON object) as a job; ApiError: refused."""
    if "prompt" not in body:
        raise invalid("Request did not contain a prompt", param="prompt")
    prompt = body["prompt"]
    params = parse_params(body, served.defaults, served.vocab_size)
    if isinstance(prompt, str):
        rendered = _render(served, "prompt", render_text, served.tokenizer, prompt)
    elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < served.vocab_size
            for t in prompt):
        rendered = Rendered(list(prompt))
    else:
        raise invalid("prompt must be a string or a non-empty list of token ids in the "
                      "vocabulary", param="prompt")
    _check_length(len(rendered.prompt), served, "prompt")
    tok = served.tokenizer
    context = RequestContext()
    if served.excerpts:
        context.decode = lambda toks: str(tok.decode(list(toks)))
    job = Job(prompt=rendered.prompt, max_tokens=params.max_tokens, sampling=params.sampling,
              top_logprobs=params.top_logprobs, logprobs=params.logprobs, salt=params.salt,
              context=context)
    return Prepared(job=job, kind="text", stream=params.stream,
                    include_usage=params.include_usage, stops=params.stops, model=params.model,
                    asked_tokens=params.asked_tokens)


# --- the answer ----------------------------------------------------------------------------


class Answer:
    """One request's answer, fed the engine's events in order.

    Streamed: :meth:`feed` returns the chunks to send now (JSON objects: each is written as
    ``data: <json>``; after the last, the app writes ``data: [DONE]``), and
    :meth:`keepalive` the comment line for a prefill's progress. Not streamed: feed the
    events, then :meth:`response` is the body. When :attr:`stop_hit` turns true the caller
    cancels the job with ``"stop"``; events after it are ignored but the :class:`Done`.
    """

    def __init__(self, prepared: Prepared, served: Served, request_id: str, created: int
                 ) -> None:
        self.prepared, self.served = prepared, served
        self.id, self.created = request_id, created
        self.stream = prepared.stream
        chat = prepared.kind == "chat"
        self.object = ("chat.completion.chunk" if self.stream else "chat.completion") \
            if chat else "text_completion"
        tok = served.tokenizer
        self._sm = Machine(tok, prepared.stops)
        self._state = self._sm.start(prepared.initial_state)
        self._prev: str | None = prepared.initial_state
        parser = tok.tool_parser if getattr(tok, "has_tool_calling", False) else None
        self._formatter = ToolCallFormatter(parser, prepared.tools, self.stream)
        self._text = self._reasoning = self._tool_text = ""
        self._tool_calls: list[str] = []
        self._made_tool_call = False
        self._raw = ""  # every token's text, for the stop word that matched
        self.tokens: list[int] = []
        self._logprobs: list[float] = []
        self._top: list[list[tuple[int, float]]] = []
        self.generated = 0
        self.stop_word: str | None = None  # the stop string that ended the answer
        self.finish_reason: str | None = None
        self.done: Done | None = None
        self._body: dict[str, Any] | None = None

    # --- state -------------------------------------------------------------------------

    @property
    def stop_hit(self) -> bool:
        """A stop string matched: the caller cancels the job with ``"stop"``."""
        return self.stop_word is not None

    @property
    def error(self) -> ApiError | None:
        """Why there is no answer, once Done was fed: the engine's error (500), or the job
        was cancelled for another reason than a stop string (the client left, a shutdown)."""
        d = self.done
        if d is None or self.finish_reason is not None:
            return None
        if d.finish == "error":
            return ApiError(500, "api_error", "generation stopped before the answer was "
                            f"complete: {d.error or 'error'}")
        return ApiError(500, "api_error", f"generation stopped before the answer was "
                        f"complete: {d.finish}")

    def keepalive(self, ev: Prefill) -> str | None:
        """mlx-lm's comment line for a prefill's progress (streamed requests only), with the
        blank line that ends it."""
        return f": keepalive {ev.done}/{ev.total}\n\n" if self.stream else None

    # --- events ------------------------------------------------------------------------

    def feed(self, ev: Token | Prefill | Done) -> list[dict[str, Any]]:
        if isinstance(ev, Token):
            return self._token(ev)
        if isinstance(ev, Done):
            return self._finish(ev)
        return []

    def _collect(self, segments: Sequence[tuple[str | None, str]]) -> None:
        for state, clean in segments:
            if state == "reasoning":
                self._reasoning += clean
            elif state == "tool":
                self._tool_text += clean
            elif state == "normal":
                if self._prev == "tool":
                    self._tool_calls.append(self._tool_text)
                    self._tool_text = ""
                    self._made_tool_call = True
                self._text += clean
            self._prev = state

    def _token(self, ev: Token) -> list[dict[str, Any]]:
        if self.stop_hit or self.done is not None:
            return []
        self.generated += 1
        self.tokens.append(ev.id)
        self._logprobs.append(float(ev.logprob) if ev.logprob is not None else 0.0)
        if self.prepared.job.top_logprobs > 0:
            self._top.append(list(ev.top or []))
        self._raw += ev.text
        self._state, segments = Machine.split(self._state, ev.text)
        self._collect(segments)
        current = self._state[0]
        if current is None:
            self.stop_word = self._matched()
        if self.stream and current != "tool" and (self._text or self._tool_calls
                                                  or self._reasoning):
            return [self._chunk(None)]
        return []

    def _matched(self) -> str:
        """The stop string the state machine ended at: the one whose first occurrence in the
        raw text ends first (the longest where two end together)."""
        hits = [(self._raw.find(w) + len(w), -len(w), w)
                for w in self.prepared.stops if w and w in self._raw]
        return min(hits)[2] if hits else next(w for w in self.prepared.stops if w)

    def _finish(self, ev: Done) -> list[dict[str, Any]]:
        if self.done is not None:
            return []
        self.done = ev
        if self.stop_hit:
            finish = "stop"
        elif ev.finish == "length":
            self._state, flushed, current = Machine.flush(self._state)
            self._collect([(current, flushed)])
            finish = "length"
        elif ev.finish == "stop":
            self._state = Machine.discard(self._state)
            finish = "stop"
        else:  # an error, or cancelled: no answer (see `error`)
            return []
        if self._prev == "tool" and self._tool_text:
            self._tool_calls.append(self._tool_text)
            self._tool_text = ""
            self._made_tool_call = True
        if finish == "stop" and self._made_tool_call:
            finish = "tool_calls"
        self.finish_reason = finish
        if not self.stream:
            self._body = self._whole()
            return []
        out = [self._chunk(finish)]
        if self.prepared.include_usage:
            out.append(self.usage_chunk())
        return out

    # --- the JSON ----------------------------------------------------------------------

    def _head(self, object_type: str) -> dict[str, Any]:
        return {"id": self.id, "system_fingerprint": self.served.fingerprint,
                "object": object_type, "model": self.prepared.model, "created": self.created}

    def _usage(self) -> dict[str, Any]:
        d = self.done
        prompt = len(self.prepared.job.prompt)
        usage: dict[str, Any] = {"prompt_tokens": prompt,
                                 "completion_tokens": self.generated,
                                 "total_tokens": prompt + self.generated}
        cached = d.cached_tokens if d is not None else -1
        if cached is not None and cached >= 0:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    def _message(self, choice: dict[str, Any], text: str, tool_calls: list[dict[str, Any]],
                 reasoning: str) -> None:
        if self.object == "text_completion":
            choice["text"] = text
            return
        key = "delta" if self.stream else "message"
        message: dict[str, Any] = {"role": "assistant"}
        if not self.stream:
            message["content"] = text if text else None
        elif text:
            message["content"] = text
        if reasoning:
            message["reasoning"] = reasoning
        if tool_calls:
            message["tool_calls"] = tool_calls
        choice[key] = message

    def _chunk(self, finish: str | None) -> dict[str, Any]:
        """One stream chunk of what was gathered since the last (mlx-lm's
        ``generate_response`` streamed), which it then forgets."""
        out = self._head(self.object)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        self._message(choice, self._text, self._formatter(self._tool_calls), self._reasoning)
        out["choices"] = [choice]
        self._text = self._reasoning = ""
        self._tool_calls = []
        return out

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk with ``stream_options.include_usage`` (mlx-lm's
        ``completion_usage_response``: object ``chat.completion``, no choices)."""
        out = self._head("chat.completion")
        out["choices"] = []
        out["usage"] = self._usage()
        return out

    def _logprobs_json(self) -> dict[str, Any] | None:
        tok = self.served.tokenizer
        if self._top:
            content: list[dict[str, Any]] = []
            for chosen, lp, top in zip(self.tokens, self._logprobs, self._top, strict=True):
                if not top:
                    content.append({})
                    continue
                names = tok.convert_ids_to_tokens([chosen, *(i for i, _ in top)])
                entries = [{"id": i, "token": s, "logprob": g}
                           for (i, g), s in zip(top, names[1:], strict=True)]
                content.append({"id": chosen, "token": names[0], "logprob": lp,
                                "top_logprobs": entries})
            return {"content": content}
        if self.prepared.job.logprobs and self._logprobs:
            return {"content": [{"id": i, "logprob": g}
                                for i, g in zip(self.tokens, self._logprobs, strict=True)]}
        return None

    def _whole(self) -> dict[str, Any]:
        out = self._head(self.object)
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish_reason}
        logprobs = self._logprobs_json()
        if logprobs is not None:
            choice["logprobs"] = logprobs
        out["choices"] = [choice]
        out["usage"] = self._usage()
        self._message(choice, self._text, self._formatter(self._tool_calls), self._reasoning)
        return out

    def response(self) -> dict[str, Any]:
        """The non-streamed body, once Done was fed; ApiError when there is none
        (:attr:`error`)."""
        if self._body is not None:
            return self._body
        if self.done is None:
            raise RuntimeError("the answer is not complete: feed the engine's Done first")
        err = self.error
        assert err is not None
        raise err
