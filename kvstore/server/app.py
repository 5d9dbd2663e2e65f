"""The HTTP side of ``kvstore serve``: a Starlette app over the engine
(:mod:`kvstore.server.engine`) and the protocol layer (:mod:`kvstore.server.openai`).

Endpoints: ``POST /v1/chat/completions`` (and ``/chat/completions``), ``/v1/completions``
(OpenAI, as mlx_lm.server 0.32.2 answers them), ``POST /v1/messages`` and
``/v1/messages/count_tokens`` (Anthropic), ``POST /v1/responses`` (OpenAI Responses),
``GET /v1/models``, ``GET /health`` and, with ``--metrics-on-api-port``, ``GET /metrics``.

A request is parsed and checked by the protocol layer (an ``ApiError`` is a 4xx in the
API's shape), submitted to the engine (a full queue: 429, or 529 ``overloaded_error`` on
``/v1/messages``, with ``Retry-After``) and answered from the engine's events: streamed as
server-sent events (the prefill's ``: keepalive n/m`` comments, as mlx-lm sends them, and a
``: ping`` comment every :data:`PING_SECONDS` while nothing else is sent), or whole. A
client that leaves cancels its job within one engine step: a stream's send fails, a
request not streamed sees ``http.disconnect`` while it waits. An exception inside one
request is a 500 in its API's shape (an error event once a stream has begun); the server
goes on. The agent APIs drive the adapters of :mod:`kvstore.serving` with the chat
chunks the protocol layer writes.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvstore.serving import anthropic_messages, responses
from kvstore.serving.chat import (
    ApiError,
    CacheUsage,
    Chunk,
    Exchange,
    Finish,
    Progress,
)
from kvstore.serving.responses import ResponseStore

from .engine import Busy, Done, Handle, Prefill, Token
from .guards import MAX_JSON_DEPTH, Guard, Settings, error_body, json_depth
from .openai import Answer, Served, prepare_chat, prepare_text

__all__ = ["App", "PING_SECONDS", "Settings", "carry_cache_control", "created_tokens"]

logger = logging.getLogger("kvstore.serve")

PING_SECONDS = 10.0  # a comment line on a stream that has had nothing else to send
SHUTDOWN = "shutdown"  # the reason a job is cancelled with when the server stops
_SHUTTING_DOWN = "the server is shutting down"
_STOPPED = "generation stopped before the answer was complete"
_chunk = msgspec.json.Encoder()


def created_tokens(rec: Any) -> int:
    """The prompt tokens a request wrote to the cache: those it computed, when its reply's
    snapshot went to the store (queued, or deferred); none when it was kept in memory
    only or never inserted."""
    return int(rec.computed_tokens) if rec.reply in ("queued", "deferred") else 0


def carry_cache_control(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body with the Anthropic breakpoints the adapters carry placed where the
    chat path reads them: a tool call's mark becomes its assistant message's, which ends
    with the call."""
    for m in body.get("messages") or []:
        for c in m.get("tool_calls") or []:
            mark = c.pop("cache_control", None)
            if mark is not None:
                m["cache_control"] = mark
    return body


def _json(obj: Any, status: int = 200) -> Response:
    """A JSON answer (msgspec: a NaN or infinite logprob is ``null``, never a 500)."""
    return Response(_chunk.encode(obj), status, media_type="application/json")


class _Stream(StreamingResponse):
    """A stream whose job is cancelled however the response ends, even one whose body was
    never started (its client left at once)."""

    def __init__(self, content: AsyncIterator[bytes], handle: Handle, app: App) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.handle, self.app = handle, app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.handle.cancel()  # the client left (a no-op once the job is done)
            self.app.handles.discard(self.handle)


class _Refused(Exception):
    """An answer already made (a status and body), raised out of a handler."""

    def __init__(self, response: Response) -> None:
        super().__init__()
        self.response = response


def _openai_error(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "server_error" if status >= 500
                      else "invalid_request_error", "code": status}}


def _mlx_error(err: ApiError) -> Response:
    """A chat/text completion's refusal, in mlx_lm.server's shape (``{"error": "..."}``) for
    a 4xx, OpenAI's for a 5xx."""
    if err.status >= 500:
        return _json(_openai_error(err.status, err.message), err.status)
    return _json({"error": err.message}, err.status)


class App:
    """The ASGI application: the guards (:class:`~kvstore.server.guards.Guard`) in front of
    the routes. :meth:`stop` (called on SIGTERM) ends every request in flight."""

    def __init__(self, engine: Any, served: Served, metrics: Any, settings: Settings) -> None:
        self.engine, self.served, self.metrics, self.settings = engine, served, metrics, settings
        self.store = ResponseStore()
        self.created = int(time.time())
        self.stopping = False
        self.handles: set[Handle] = set()
        routes = [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.text, methods=["POST"]),
            Route("/v1/messages", self.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ]
        if settings.metrics_on_api_port:
            routes.append(Route("/metrics", self.metrics_page, methods=["GET"]))
        self.router = Starlette(routes=routes)
        self.router.add_exception_handler(404, self._not_found)
        self.router.add_exception_handler(405, self._not_found)
        self.asgi = Guard(self.router, settings)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.asgi(scope, receive, send)

    @property
    def left(self) -> int:
        return len(self.handles)

    def stop(self) -> None:
        """The server stops: every request in flight ends now (with the error that says
        so), and new ones are refused by the engine."""
        self.stopping = True
        for h in list(self.handles):
            h.cancel(SHUTDOWN)

    # --- the plain endpoints --------------------------------------------------------------

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        path = request.url.path.rstrip("/")
        method = request.method
        if path.startswith("/v1/messages"):
            return Response(anthropic_messages.error_body(ApiError(
                404, "not_found_error", f"Not found: {method} {path}")), 404,
                media_type="application/json")
        if path.startswith("/v1/responses"):
            return Response(responses.error_body(ApiError(
                404, "not_found_error", f"Not found: {method} {path}")), 404,
                media_type="application/json")
        return Response(b"Not Found", 404, media_type="application/json")

    async def health(self, request: Request) -> Response:
        ok = bool(self.engine.healthy())
        return JSONResponse({"status": "ok" if ok else "unavailable"},
                            status_code=200 if ok else 503)

    async def models(self, request: Request) -> Response:
        asked = request.path_params.get("model")
        listed = self.served.model_id
        data = [{"id": listed, "object": "model", "created": self.created}]
        if asked is not None and asked != listed and asked not in self.served.aliases:
            data = []
        return JSONResponse({"object": "list", "data": data})

    async def metrics_page(self, request: Request) -> Response:
        body, content_type = self.metrics.exposition(request.headers.get("accept"))
        return Response(body, 200, headers={"Content-Type": content_type})

    # --- shared -----------------------------------------------------------------------

    @staticmethod
    def _decode(raw: bytes) -> Any:
        """The body's JSON; a 400 when it is not JSON or nests deeper than
        :data:`MAX_JSON_DEPTH`."""
        try:
            value = msgspec.json.decode(raw)
        except RecursionError:
            value = None
            deep = True
        except msgspec.DecodeError as e:
            raise ApiError(400, "invalid_request_error",
                           f"Invalid JSON in request body: {e}") from None
        else:
            deep = json_depth(value) > MAX_JSON_DEPTH
        if deep:
            raise ApiError(400, "invalid_request_error",
                           f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels")
        return value

    def _submit(self, prepared: Any, path: str, *, streamed: bool) -> Handle:
        job = prepared.job
        job.streamed = streamed
        cuts = getattr(prepared, "cuts", None)
        if cuts and not job.cuts:  # the prompt cache's snapshots on the way (segment ends)
            job.cuts = dict(cuts)
        try:
            handle: Handle = self.engine.submit(job)
        except Busy as e:
            retry = max(1, round(getattr(e, "retry_after", 1.0) or 1.0))
            status = 529 if path.startswith("/v1/messages") else (
                503 if getattr(e, "stopping", False) else 429)
            message = _SHUTTING_DOWN if getattr(e, "stopping", False) else (
                f"the server is busy ({e}): try again in {retry} s")
            raise _Refused(Response(error_body(path, status, message), status,
                                    headers={"Retry-After": str(retry)},
                                    media_type="application/json")) from None
        self.handles.add(handle)
        if self.stopping:
            handle.cancel(SHUTDOWN)
        return handle

    async def _events(self, handle: Handle) -> AsyncIterator[Token | Prefill | Done | None]:
        """The job's events; None each :data:`PING_SECONDS` without one."""
        async for batch in handle.batches(PING_SECONDS):
            if not batch:
                yield None
            for ev in batch:
                yield ev

    @staticmethod
    async def _watch_disconnect(request: Request, handle: Handle) -> None:
        """Cancel ``handle`` when the client of a request not streamed leaves."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                handle.cancel()
                return

    async def _run_whole(self, request: Request, handle: Handle,
                         on: Callable[[Token | Prefill | Done], object]) -> Done:
        """Feed each event to ``on`` until the job's Done, cancelling the job if the client
        leaves meanwhile."""
        watcher = asyncio.ensure_future(self._watch_disconnect(request, handle))
        try:
            async for ev in self._events(handle):
                if ev is None:
                    continue
                if isinstance(ev, Prefill):
                    logger.info("Prompt processing progress: %d/%d", ev.done, ev.total)
                on(ev)
                if isinstance(ev, Done):
                    return ev
            raise RuntimeError("the engine ended the job without a Done")
        finally:
            watcher.cancel()
            self.handles.discard(handle)

    def _ended_early(self, done: Done) -> str | None:
        """What to tell the client when the job did not end normally, else None."""
        if done.finish == SHUTDOWN:
            return f"{_STOPPED}: {_SHUTTING_DOWN}"
        if done.finish == "error":
            return f"{_STOPPED}: {done.error or 'an error in the engine'}"
        return None

    # --- OpenAI chat and text completions ---------------------------------------------------

    async def chat(self, request: Request) -> Response:
        return await self._completion(request, "chat")

    async def text(self, request: Request) -> Response:
        return await self._completion(request, "text")

    async def _completion(self, request: Request, kind: str) -> Response:
        try:
            body = self._decode(await request.body())
            if not isinstance(body, dict):
                raise ApiError(400, "invalid_request_error",
                               "Request should be a JSON dictionary")
            prepared = (prepare_chat if kind == "chat" else prepare_text)(body, self.served)
            rid = f"chatcmpl-{uuid.uuid4()}" if kind == "chat" else f"cmpl-{uuid.uuid4()}"
            answer = Answer(prepared, self.served, rid, int(time.time()))
            handle = self._submit(prepared, request.url.path, streamed=prepared.stream)
        except ApiError as e:
            return _mlx_error(e)
        except _Refused as r:
            return r.response
        except Exception as e:  # noqa: BLE001 - one request's failure, told to its client
            logger.exception("kvstore: %s failed", request.url.path)
            return _json(_openai_error(500, f"{type(e).__name__}: {e}"), 500)
        if prepared.stream:
            return _Stream(self._openai_stream(handle, answer), handle, self)
        try:
            done = await self._run_whole(request, handle, lambda ev: self._feed(answer, handle,
                                                                                ev))
            early = self._ended_early(done)
            if early is not None:
                logger.error("kvstore: %s", early)
                return _json(_openai_error(500, early), 500)
            return _json(answer.response())
        except Exception as e:  # noqa: BLE001
            handle.cancel("error")
            logger.exception("kvstore: %s failed", request.url.path)
            return _json(_openai_error(500, f"{type(e).__name__}: {e}"), 500)

    @staticmethod
    def _feed(answer: Answer, handle: Handle, ev: Token | Prefill | Done) -> list[dict[str, Any]]:
        if isinstance(ev, Prefill):
            return []
        if isinstance(ev, Done) and ev.finish in (SHUTDOWN, "error"):
            return []
        chunks = answer.feed(ev)
        if answer.stop_hit:
            handle.cancel("stop")
        return chunks

    async def _openai_stream(self, handle: Handle, answer: Answer) -> AsyncIterator[bytes]:
        try:
            async for ev in self._events(handle):
                if ev is None:
                    yield b": ping\n\n"
                    continue
                if isinstance(ev, Prefill):
                    logger.info("Prompt processing progress: %d/%d", ev.done, ev.total)
                    line = answer.keepalive(ev)
                    if line:
                        yield line.encode() if isinstance(line, str) else line
                    continue
                for chunk in self._feed(answer, handle, ev):
                    yield b"data: " + _chunk.encode(chunk) + b"\n\n"
                if isinstance(ev, Done):
                    early = self._ended_early(ev)
                    if early is not None:
                        logger.error("kvstore: %s", early)
                        yield b"data: " + _chunk.encode(_openai_error(500, early)) + b"\n\n"
                        return
                    yield b"data: [DONE]\n\n"
                    return
        except Exception as e:  # noqa: BLE001 - told to the client as the stream's last event
            logger.exception("kvstore: a stream failed")
            yield b"data: " + _chunk.encode(_openai_error(500, f"{type(e).__name__}: {e}")) \
                + b"\n\n"
        finally:
            handle.cancel()  # the client left (a no-op once the job is done): "cancelled"
            self.handles.discard(handle)

    # --- the agent APIs -------------------------------------------------------------------

    async def messages(self, request: Request) -> Response:
        return await self._agent(request, lambda raw: anthropic_messages.parse(raw),
                                 anthropic_messages.error_body)

    async def responses(self, request: Request) -> Response:
        return await self._agent(request, lambda raw: responses.parse(raw, self.store),
                                 responses.error_body)

    async def count_tokens(self, request: Request) -> Response:
        errors = anthropic_messages.error_body
        try:
            raw = await request.body()
            self._check_depth(raw)
            chat = anthropic_messages.count_request(raw)
            prepared = _inner(chat.body(), self.served)
            return _json({"input_tokens": len(prepared.job.prompt)})
        except ApiError as e:
            return Response(errors(e), e.status, media_type="application/json")
        except Exception as e:  # noqa: BLE001
            logger.exception("kvstore: %s failed", request.url.path)
            return Response(errors(ApiError(500, "api_error", f"{type(e).__name__}: {e}")),
                            500, media_type="application/json")

    def _check_depth(self, raw: bytes) -> None:
        try:
            self._decode(raw)
        except ApiError as e:
            if "nests deeper" in e.message:
                raise
            # not JSON: the adapter's own parse says so in its words

    async def _agent(self, request: Request, parse: Callable[[bytes], Exchange],
                     errors: Callable[[ApiError], bytes]) -> Response:
        path = request.url.path
        try:
            raw = await request.body()
            self._check_depth(raw)
            ex = parse(raw)
            prepared = _inner(ex.chat.body(), self.served)
            answer = Answer(prepared, self.served, f"chatcmpl-{uuid.uuid4()}",
                            int(time.time()))
            handle = self._submit(prepared, path, streamed=ex.stream)
        except ApiError as e:
            return Response(errors(e), e.status, media_type="application/json")
        except _Refused as r:
            return r.response
        except Exception as e:  # noqa: BLE001
            logger.exception("kvstore: %s failed", path)
            return Response(errors(ApiError(500, "api_error", f"{type(e).__name__}: {e}")),
                            500, media_type="application/json")
        drive = _Drive(ex, answer, handle, len(prepared.job.prompt))
        if ex.stream:
            return _Stream(self._agent_stream(drive, errors), handle, self)
        try:
            done = await self._run_whole(request, handle, drive.on)
            early = self._ended_early(done)
            if early is not None:
                logger.error("kvstore: %s", early)
                err = ApiError(500, "api_error", early)
                return Response(errors(err), 500, media_type="application/json")
            return Response(drive.finish(done), 200, media_type="application/json")
        except ApiError as e:
            return Response(errors(e), e.status, media_type="application/json")
        except Exception as e:  # noqa: BLE001
            handle.cancel("error")
            logger.exception("kvstore: %s failed", path)
            return Response(errors(ApiError(500, "api_error", f"{type(e).__name__}: {e}")),
                            500, media_type="application/json")

    async def _agent_stream(self, drive: _Drive, errors: Callable[[ApiError], bytes]
                            ) -> AsyncIterator[bytes]:
        handle = drive.handle
        try:
            yield drive.ex.start(drive.start_usage())
            async for ev in self._events(handle):
                if ev is None:
                    yield b": ping\n\n"
                    continue
                if isinstance(ev, Prefill):
                    logger.info("Prompt processing progress: %d/%d", ev.done, ev.total)
                out = drive.on(ev)
                if out:
                    yield out
                if isinstance(ev, Done):
                    early = self._ended_early(ev)
                    if early is not None:
                        logger.error("kvstore: %s", early)
                        yield drive.ex.stream_error(ApiError(500, "api_error", early))
                        return
                    yield drive.finish(ev)
                    return
        except Exception as e:  # noqa: BLE001
            logger.exception("kvstore: a stream failed")
            yield drive.ex.stream_error(ApiError(500, "api_error", f"{type(e).__name__}: {e}"))
        finally:
            handle.cancel()
            self.handles.discard(handle)


def _inner(body: dict[str, Any], served: Served) -> Any:
    """An agent API's chat request through the chat path; its refusal names no field (the
    chat request's fields are not the API's)."""
    try:
        return prepare_chat(carry_cache_control(body), served)
    except ApiError as e:
        raise ApiError(e.status, e.kind, e.message) from None


class _Drive:
    """One agent-API request: the engine's events through the protocol layer's chat
    chunks into the API's exchange."""

    def __init__(self, ex: Exchange, answer: Answer, handle: Handle, prompt_tokens: int
                 ) -> None:
        self.ex, self.answer, self.handle = ex, answer, handle
        self.prompt_tokens = prompt_tokens
        self.reasons: list[str] = []

    def start_usage(self) -> CacheUsage:
        return CacheUsage(self.prompt_tokens, 0, 0, 0)

    def on(self, ev: Token | Prefill | Done) -> bytes:
        if isinstance(ev, Prefill):
            return self.ex.event(Progress(ev.done, ev.total))
        out = b""
        for c in App._feed(self.answer, self.handle, ev):
            chunk = msgspec.convert(c, Chunk)
            if chunk.usage is not None and not chunk.choices:
                continue
            if chunk.finish_reason is not None:
                self.reasons.append(chunk.finish_reason)
            out += self.ex.event(chunk)
        return out

    def finish(self, done: Done) -> bytes:
        rec = done.record
        if rec is not None:
            usage = CacheUsage(rec.prompt_tokens, rec.reused_tokens, created_tokens(rec),
                               done.generated)
        else:
            usage = CacheUsage(done.prompt_tokens, done.cached_tokens, 0, done.generated)
        stop = _stop_sequence(self.answer)
        reason = self.reasons[-1] if self.reasons else (
            "length" if done.finish == "length" else "stop")
        if stop is not None:
            return self.ex.finish(Finish("stop_sequence", usage, stop))
        if reason not in ("stop", "length", "tool_calls"):
            reason = "stop"
        return self.ex.finish(Finish(reason, usage))  # type: ignore[arg-type]


def _stop_sequence(answer: Answer) -> str | None:
    """The stop string that ended the answer, if one did."""
    v = getattr(answer, "stop_word", None)
    return v if isinstance(v, str) else None

