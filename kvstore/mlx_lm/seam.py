"""The one module that knows mlx-lm's server internals for the agent APIs: it routes
``POST /v1/messages``, ``/v1/messages/count_tokens`` and ``/v1/responses`` to the protocol
adapters of :mod:`kvstore.serving` and runs their chat request through mlx-lm's own
chat-completions path, in-process, so everything that path does (validation, the request's
``cache_salt``, any rewrite installed on it, tool-call parsing, reasoning, batching, the
prompt cache) applies alike.

How: the chat request's JSON is handed to a second ``APIHandler`` instance (the server's
own class, path ``/v1/chat/completions``, always streamed) whose ``wfile`` is a
:class:`_Sink`: each chunk mlx-lm writes is parsed as it comes and handed to the API's
exchange, which writes its own events to the client at once, so streaming stays streaming.
The handler's response generator is wrapped (:class:`_Watched`) to see the generated tokens
(the stop sequence that ended a reply, which mlx-lm strips from the text) and to tag the
request, so that the prompt cache's per-request record (:class:`_Records`, an observer of
each cache) is the one the API's usage figures are read from: the same figures the request
log and ``/metrics`` count.

:data:`RELIED_ON` lists every name of ``mlx_lm.server`` that kvstore relies on (here, in
``serve.py``, ``tenants.py``, ``metrics.py`` and ``prefill.py``); :func:`check_server`
names the first one an mlx-lm upgrade moved (tests/test_mlx_lm_seam.py runs it). What
names cannot say (the handler's instance attributes set in its ``__init__``, the stream's
``data:`` / ``: keepalive n/m`` / ``[DONE]`` lines) the end-to-end tests of
tests/test_agent_apis.py check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import inspect
import io
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import msgspec

from kvstore.serving import anthropic_messages, responses
from kvstore.serving.chat import (
    MAX_BODY_BYTES,
    ApiError,
    CacheUsage,
    ChatRequest,
    Chunk,
    Exchange,
    Finish,
    Progress,
    decode_chunk,
)
from kvstore.serving.responses import ResponseStore

from .requests import CacheObserver, RequestRecord

__all__ = ["RELIED_ON", "SeamError", "agent_apis", "check_server", "created_tokens",
           "carry_cache_control"]

logger = logging.getLogger("kvstore.serve")

#: Every name of ``mlx_lm.server`` kvstore relies on: (dotted name, what it must be, who
#: uses it and why). "class"/"function" must exist as such; "fields: a, b" names dataclass
#: fields; "params: a, b" names a function's leading parameters.
RELIED_ON: tuple[tuple[str, str, str], ...] = (
    ("main", "function", "serve: runs mlx-lm's own command line"),
    ("argparse", "module", "serve: main builds its parser from the module's argparse, "
     "swapped to parse mlx-lm's options before anything is fetched or bound"),
    ("run", "function", "serve: builds the prompt cache from the module's LRUPromptCache and "
     "starts _run_http_server, both looked up at call time"),
    ("LRUPromptCache", "class", "serve: swapped for the persistent prompt cache's factory"),
    ("_run_http_server", "params: host, port, response_generator, server_class, "
     "handler_class", "serve, metrics, seam: the handler class that serves /metrics and the "
     "agent APIs"),
    ("scan_cache_dir", "function", "serve: GET /v1/models without a hub cache"),
    ("APIHandler", "class", "seam: the handler the agent APIs run through"),
    ("APIHandler.do_POST", "function", "seam: the chat path, in-process"),
    ("APIHandler.do_GET", "function", "metrics: GET /metrics beside mlx-lm's routes"),
    ("APIHandler.handle_completion", "params: self, request, stop_words",
     "seam: streams chat chunks to the handler's wfile"),
    ("APIHandler.handle_chat_completions", "function", "seam: builds the chat request"),
    ("APIHandler._set_cors_headers", "params: self", "seam: the agent APIs' answers carry "
     "the server's CORS headers"),
    ("APIHandler.validate_model_parameters", "function", "tenants: checks cache_salt"),
    ("ResponseGenerator", "class", "serve, prefill: the tokenize step swapped for "
     "checkpoints"),
    ("ResponseGenerator.generate", "params: self, request, generation_args, "
     "progress_callback", "tenants, seam: a request's salt and tag"),
    ("ResponseGenerator._tokenize", "params: self, tokenizer, request, args",
     "prefill, tenants, seam: checkpoints, the tenant, the request's record"),
    ("ModelDescription", "fields: model, draft, adapter", "tenants: a salted model"),
    ("CompletionRequest", "fields: request_type, prompt, messages, tools, role_mapping",
     "seam: the request a record is tied to"),
    ("GenerationContext", "fields: prompt, prompt_cache_count", "seam: usage fallback"),
    ("Response", "fields: text, token, finish_reason", "seam: the stop sequence that ended "
     "a reply"),
    ("ModelProvider", "class", "seam: the tokenizer count_tokens renders with "
     "(model_provider.tokenizer, cli_args.model, cli_args.chat_template_args)"),
    ("ResponseGenerator.generation_available", "function", "seam: count_tokens waits for "
     "the model to load while the generation thread lives"),
    ("process_message_content", "params: messages", "seam: count_tokens renders as the chat "
     "path does"),
    ("convert_chat", "params: messages, role_mapping", "seam: count_tokens without a chat "
     "template"),
)

_ROUTES = ("/v1/messages", "/v1/messages/count_tokens", "/v1/responses")
_RECORD_WAIT = 30.0  # seconds a request waits for its prompt-cache record
_LOAD_WAIT = 600.0  # seconds count_tokens waits for the served model to load
_TAG = "_kvstore_request"  # the attribute of mlx-lm's CompletionRequest that tags it


class SeamError(RuntimeError):
    """mlx-lm no longer has something kvstore relies on (one of :data:`RELIED_ON`)."""


def check_server(server: Any) -> None:
    """Raise :class:`SeamError` naming the first of :data:`RELIED_ON` that ``server`` (the
    ``mlx_lm.server`` module) lacks or has in another shape."""
    for name, shape, why in RELIED_ON:
        obj: Any = server
        for part in name.split("."):
            if not hasattr(obj, part):
                raise SeamError(f"mlx_lm.server.{name} is gone (kvstore relies on it: {why})")
            obj = getattr(obj, part)
        what, _, rest = shape.partition(": ")
        wanted = [w.strip() for w in rest.split(",") if w.strip()]
        if what == "class" and not inspect.isclass(obj):
            raise SeamError(f"mlx_lm.server.{name} is no longer a class ({why})")
        if what in ("function", "params") and not callable(obj):
            raise SeamError(f"mlx_lm.server.{name} is no longer a function ({why})")
        if what == "params":
            have = list(inspect.signature(obj).parameters)
            if have[: len(wanted)] != wanted:
                raise SeamError(f"mlx_lm.server.{name} takes ({', '.join(have)}), kvstore "
                                f"relies on ({', '.join(wanted)}) ({why})")
        if what == "fields":
            have_fields = {f.name for f in dataclasses.fields(obj)} \
                if dataclasses.is_dataclass(obj) else set()
            missing = [w for w in wanted if w not in have_fields]
            if missing:
                raise SeamError(f"mlx_lm.server.{name} has no field {missing[0]!r} ({why})")


def carry_cache_control(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body with the Anthropic breakpoints the adapters carry placed where
    :mod:`kvstore.mlx_lm.cache_control` reads them (the body's ``cache_control``, a
    content part's, a message's, a tool's): a tool call's mark becomes its assistant
    message's, which ends with the call. That module's hook, run by mlx-lm's
    ``validate_model_parameters`` on the inner request, takes them all out of the body
    before the chat template sees it."""
    for m in body.get("messages") or []:
        for c in m.get("tool_calls") or []:
            mark = c.pop("cache_control", None)
            if mark is not None:
                m["cache_control"] = mark
    return body


def created_tokens(rec: RequestRecord) -> int:
    """The prompt tokens a request wrote to the cache: those it computed, when its reply's
    snapshot went to the store (queued, or deferred to be replaced by its conversation's
    next one); none when it was kept in memory only (shorter than ``--min-tokens``, a model
    that cannot be fingerprinted) or never inserted."""
    return rec.computed_tokens if rec.reply in ("queued", "deferred") else 0


# --- a request's record --------------------------------------------------------------


@dataclasses.dataclass
class _Slot:
    tag: int
    rec: RequestRecord | None = None
    fetched: threading.Event = dataclasses.field(default_factory=threading.Event)
    finished: threading.Event = dataclasses.field(default_factory=threading.Event)


class _Records(CacheObserver):
    """The prompt-cache record of each agent-API request being served. The generation
    thread tokenizes a request (its tag noted) just before its cache lookup opens its
    record (:meth:`fetched`, same thread), so the record is the tagged request's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: dict[int, _Slot] = {}
        self._ids = itertools.count(1)
        self._thread = threading.local()

    def add(self) -> _Slot:
        slot = _Slot(next(self._ids))
        with self._lock:
            self._slots[slot.tag] = slot
        return slot

    def close(self, slot: _Slot) -> None:
        with self._lock:
            self._slots.pop(slot.tag, None)

    def noting(self, tag: int | None) -> None:
        self._thread.tag = tag

    def fetched(self, rec: RequestRecord) -> None:
        tag = getattr(self._thread, "tag", None)
        self._thread.tag = None
        with self._lock:
            slot = self._slots.get(tag) if tag is not None else None
        if slot is not None:
            slot.rec = rec
            slot.fetched.set()

    def finished(self, rec: RequestRecord) -> None:
        with self._lock:
            slot = next((s for s in self._slots.values() if s.rec is rec), None)
        if slot is not None:
            slot.finished.set()


class _Watched:
    """The server's response generator, for one request: tags the request and watches the
    tokens it generates."""

    def __init__(self, inner: Any, tag: int, stops: list[str]) -> None:
        self._inner, self._tag, self.stops = inner, tag, stops
        self.text_stop: str | None = None  # the stop sequence the text reached
        self.ctx: Any = None
        self.tokens = 0
        self.last_token: int | None = None
        self.tail = ""  # the end of the raw text, stop sequences included

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def generate(self, request: Any, args: Any, *rest: Any, **kw: Any) -> Any:
        setattr(request, _TAG, self._tag)
        ctx, gen = self._inner.generate(request, args, *rest, **kw)
        self.ctx = ctx

        def watched() -> Iterator[Any]:
            for r in gen:
                self.tokens += 1
                self.last_token = r.token
                self.tail = (self.tail + r.text)[-8192:]
                yield r
                # mlx-lm stops on a stop sequence's tokens, which a word tokenized in
                # context often is not: the text decides (the reply is then not kept)
                hit = next((s for s in self.stops if s and r.finish_reason is None
                            and s in self.tail[-(len(s) + len(r.text)):]), None)
                if hit is not None:
                    self.text_stop = hit
                    return

        return ctx, watched()

    def stop_sequence(self, stops: list[str], reason: str) -> str | None:
        """The stop sequence the reply ended with (mlx-lm strips it from the text and, on
        ``stop``, does not decode the last token), or None."""
        if self.text_stop is not None:
            return self.text_stop
        tok = getattr(self._inner.model_provider, "tokenizer", None)
        if not stops or tok is None or self.last_token is None \
                or self.last_token in set(getattr(tok, "eos_token_ids", ()) or ()):
            return None
        tail = self.tail + (tok.decode([self.last_token]) if reason == "stop" else "")
        hits = [(tail.rfind(s) + len(s), s) for s in stops if s and s in tail[-len(s) - 8:]]
        return max(hits)[1] if hits else None


# --- the inner handler's output --------------------------------------------------------


class _Sink(io.RawIOBase):
    """The inner handler's ``wfile``: its status line, headers and server-sent events,
    parsed as they are written and handed on."""

    def __init__(self, on_start: Callable[[], None], on_event: Callable[[Chunk | Progress],
                                                                      None]) -> None:
        super().__init__()
        self.on_start, self.on_event = on_start, on_event
        self.status: int | None = None
        self.head = b""
        self.body = b""
        self.done = False

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        b = bytes(data)
        if self.status is None:
            self.head += b
            head, sep, rest = self.head.partition(b"\r\n\r\n")
            if not sep:
                return len(b)
            first = head.split(b"\r\n", 1)[0].split()
            self.status = int(first[1]) if len(first) > 1 and first[1].isdigit() else 500
            if self.status == 200:
                self.on_start()
            b = rest
        self.body += b
        if self.status == 200:
            while b"\n\n" in self.body:
                event, _, self.body = self.body.partition(b"\n\n")
                self._event(event)
        return len(data)

    def _event(self, event: bytes) -> None:
        for line in event.split(b"\n"):
            if line.startswith(b"data: "):
                data = line[6:].strip()
                if data == b"[DONE]":
                    self.done = True
                else:
                    self.on_event(decode_chunk(data))
            elif line.startswith(b": keepalive"):
                done, _, total = line.split()[-1].partition(b"/")
                if done.isdigit() and total.isdigit():
                    self.on_event(Progress(int(done), int(total)))

    def error_message(self) -> str:
        try:
            err = json.loads(self.body)
            return str(err.get("error", err)) if isinstance(err, dict) else str(err)
        except ValueError:
            return self.body.decode("utf-8", "replace")


# --- the handler -------------------------------------------------------------------------


def _handler(base: type[Any], server: Any, records: _Records, store: ResponseStore
             ) -> type[Any]:
    """``base`` (mlx-lm's ``APIHandler``) answering the agent APIs too."""

    class AgentHandler(base):  # type: ignore[misc]
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            path = urlsplit(self.path).path.rstrip("/")
            if not path.startswith(_ROUTES):
                super().do_POST()
                return
            errors = responses.error_body if path.startswith("/v1/responses") \
                else anthropic_messages.error_body
            served = _Served(self, server, records, store, path, errors)
            if path not in _ROUTES:
                served.not_found("POST")
                return
            try:
                served.run()
            except (BrokenPipeError, ConnectionResetError):
                logger.info("kvstore: the client of %s went away", path)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = urlsplit(self.path).path.rstrip("/")
            if not path.startswith(_ROUTES):
                super().do_GET()
                return
            errors = responses.error_body if path.startswith("/v1/responses") \
                else anthropic_messages.error_body
            _Served(self, server, records, store, path, errors).not_found("GET")

    return AgentHandler


class _Served:
    """One agent-API request on the outer handler ``h``."""

    def __init__(self, h: Any, server: Any, records: _Records, store: ResponseStore,
                 path: str, errors: Callable[[ApiError], bytes]) -> None:
        self.h, self.server, self.records, self.store = h, server, records, store
        self.path, self.errors = path, errors
        self.sent = False  # the status line is written
        self.ex: Exchange | None = None

    def _write(self, status: int, body: bytes, content_type: str = "application/json"
               ) -> None:
        h = self.h
        h.send_response(status)
        h.send_header("Content-Type", content_type)
        h.send_header("Content-Length", str(len(body)))
        h._set_cors_headers()
        h.end_headers()
        h.wfile.write(body)
        h.wfile.flush()
        self.sent = True

    def not_found(self, method: str) -> None:
        """A path of an agent API that this server does not answer: a 404 in its shape."""
        self._write(404, self.errors(ApiError(404, "not_found_error",
                                              f"Not found: {method} {self.path}")))

    def _fail(self, err: ApiError) -> None:
        if not self.sent:
            self._write(err.status, self.errors(err))
        elif self.ex is not None and self.ex.stream:
            self.h.wfile.write(self.ex.stream_error(err))
            self.h.wfile.flush()

    def run(self) -> None:
        try:
            self._run()
        except ApiError as e:
            self._fail(e)
        except (BrokenPipeError, ConnectionResetError):
            raise
        except Exception as e:  # noqa: BLE001 - one request's failure, told to its client
            logger.warning("kvstore: %s failed", self.path, exc_info=True)
            self._fail(ApiError(500, "api_error", f"{type(e).__name__}: {e}"))

    def _body(self) -> bytes:
        raw = self.h.headers.get("Content-Length")
        if raw is None or not raw.strip().isdigit():
            raise ApiError(411 if raw is None else 400, "invalid_request_error",
                           "a Content-Length header with the body's size is required")
        n = int(raw)
        if n > MAX_BODY_BYTES:
            raise ApiError(413, "request_too_large", f"the request body is {n} bytes, over "
                           f"the limit of {MAX_BODY_BYTES} bytes")
        body: bytes = self.h.rfile.read(n)
        return body

    def _run(self) -> None:
        body = self._body()
        if self.path == "/v1/messages/count_tokens":
            chat = anthropic_messages.count_request(body)
            n = self._count(chat)
            self._write(200, msgspec.json.encode({"input_tokens": n}))
            return
        self.ex = responses.parse(body, self.store) if self.path == "/v1/responses" \
            else anthropic_messages.parse(body)
        self._chat(self.ex)

    # --- the chat path, in-process --------------------------------------------------------

    def _inner(self, chat: ChatRequest, sink: _Sink, generator: Any) -> Any:
        """A second handler of the server's class on the chat-completions path, writing to
        ``sink``: mlx-lm's own do_POST runs the request as any chat request."""
        data = json.dumps(carry_cache_control(chat.body())).encode()
        h = self.h
        inner = object.__new__(type(h))
        headers = http.client.HTTPMessage()
        headers["Content-Type"] = "application/json"
        headers["Content-Length"] = str(len(data))
        inner.__dict__.update(
            created=h.created, response_generator=generator,
            system_fingerprint=h.system_fingerprint, rfile=io.BytesIO(data), wfile=sink,
            headers=headers, path="/v1/chat/completions", command="POST",
            request_version="HTTP/1.1", requestline="POST /v1/chat/completions HTTP/1.1",
            client_address=h.client_address, server=h.server, close_connection=True)
        inner.log_message = lambda *args: None  # the outer request is logged
        return inner

    def _chat(self, ex: Exchange) -> None:
        slot = self.records.add()
        watched = _Watched(self.h.response_generator, slot.tag, ex.chat.stop or [])
        usage_chunk: list[Chunk] = []
        finish: list[str] = []

        def start() -> None:
            usage = self._usage(slot, watched, None, 0, wait=True)
            if ex.stream:
                h = self.h
                h.send_response(200)
                h.send_header("Content-Type", "text/event-stream")
                h.send_header("Cache-Control", "no-cache")
                h._set_cors_headers()
                h.end_headers()
                self.sent = True
                self._out(ex.start(usage))

        def event(ev: Chunk | Progress) -> None:
            if isinstance(ev, Chunk):
                if ev.usage is not None:
                    usage_chunk.append(ev)
                    return
                if ev.finish_reason is not None:
                    finish.append(ev.finish_reason)
            self._out(ex.event(ev))

        sink = _Sink(start, event)
        try:
            self._inner(ex.chat, sink, watched).do_POST()
            if sink.status != 200:
                msg = sink.error_message()
                raise ApiError(400 if sink.status is not None and sink.status < 500 else 500,
                               "invalid_request_error" if sink.status is not None
                               and sink.status < 500 else "api_error", msg)
            reason = finish[-1] if finish else "stop"
            stop = watched.stop_sequence(ex.chat.stop or [], reason) \
                if reason in ("stop", "length") else None
            if watched.text_stop is None:  # the reply's insert, when it was not cut short
                slot.finished.wait(_RECORD_WAIT if slot.rec is not None else 0)
            fallback = usage_chunk[-1] if usage_chunk else None
            usage = self._usage(slot, watched, fallback, watched.tokens, wait=False)
            fin = Finish("stop_sequence" if stop else reason, usage, stop)  # type: ignore[arg-type]
            out = ex.finish(fin)
            if ex.stream:
                self._out(out)
            else:
                self._write(200, out)
        finally:
            self.records.close(slot)

    def _out(self, data: bytes) -> None:
        if data:
            self.h.wfile.write(data)
            self.h.wfile.flush()

    def _usage(self, slot: _Slot, watched: _Watched, chunk: Chunk | None, output: int, *,
               wait: bool) -> CacheUsage:
        """The request's figures from its prompt-cache record; mlx-lm's own counts when it
        has none (a prompt cache that keeps no records)."""
        if wait:
            slot.fetched.wait(_RECORD_WAIT)
        rec = slot.rec
        if rec is not None:
            done = slot.finished.is_set()
            return CacheUsage(rec.prompt_tokens, rec.reused_tokens,
                              created_tokens(rec) if done else 0, output)
        if chunk is not None and chunk.usage is not None:
            u = chunk.usage
            cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
            return CacheUsage(u.prompt_tokens, cached, 0, output)
        ctx = watched.ctx
        if ctx is not None:
            return CacheUsage(len(ctx.prompt), max(0, ctx.prompt_cache_count), 0, output)
        return CacheUsage(0, 0, 0, output)

    # --- count_tokens -------------------------------------------------------------------

    def _count(self, chat: ChatRequest) -> int:
        """The prompt's token count: the request through mlx-lm's chat path up to the
        request it builds (validation, rewrites), rendered as the chat path renders it."""
        built: list[Any] = []
        sink = _Sink(lambda: None, lambda ev: None)
        inner = self._inner(chat, sink, self.h.response_generator)  # never generates
        inner.handle_completion = lambda request, stop_words: built.append(request)
        inner.do_POST()
        if not built:
            raise ApiError(400, "invalid_request_error", sink.error_message())
        request = built[0]
        generator = self.h.response_generator
        provider = generator.model_provider
        # the generation thread loads --model when it starts: wait for it (bounded)
        deadline = time.monotonic() + _LOAD_WAIT
        while getattr(provider, "tokenizer", None) is None and provider.cli_args.model \
                and generator.generation_available() and time.monotonic() < deadline:
            time.sleep(0.05)
        tok = getattr(provider, "tokenizer", None)
        if tok is None:
            raise ApiError(400, "invalid_request_error", "no model is loaded: serve with "
                           "--model, or send a request that loads one")
        messages = request.messages
        if not tok.has_chat_template:
            return len(tok.encode(self.server.convert_chat(messages, request.role_mapping)))
        self.server.process_message_content(messages)
        kwargs = dict(provider.cli_args.chat_template_args or {})
        kwargs.update(chat.chat_template_kwargs or {})
        ids = tok.apply_chat_template(messages, tools=request.tools, add_generation_prompt=True,
                                      tokenize=True, **kwargs)
        return len(ids)


@contextlib.contextmanager
def agent_apis(server: Any) -> Iterator[None]:
    """``server`` (the ``mlx_lm.server`` module) serving the agent APIs for the duration of
    the block: its ``_run_http_server`` given the agent handler, each prompt cache it makes
    observed for the requests' records, its tokenize step noting each request's tag."""
    records, store = _Records(), ResponseStore()
    make_cache, run_http = server.LRUPromptCache, server._run_http_server
    tokenize = server.ResponseGenerator._tokenize

    def cache(*args: Any, **kwargs: Any) -> Any:
        c = make_cache(*args, **kwargs)
        observers = getattr(c, "observers", None)
        if isinstance(observers, list):
            observers.append(records)
        return c

    def run(host: str, port: int, response_generator: Any, server_class: Any = None,
            handler_class: Any = None) -> Any:
        from http.server import ThreadingHTTPServer

        return run_http(host, port, response_generator, server_class or ThreadingHTTPServer,
                        _handler(handler_class or server.APIHandler, server, records, store))

    def tokenize_noting(self: Any, tokenizer: Any, request: Any, args: Any) -> Any:
        records.noting(getattr(request, _TAG, None))
        return tokenize(self, tokenizer, request, args)

    server.LRUPromptCache, server._run_http_server = cache, run
    server.ResponseGenerator._tokenize = tokenize_noting
    try:
        yield
    finally:
        server.LRUPromptCache, server._run_http_server = make_cache, run_http
        server.ResponseGenerator._tokenize = tokenize
