"""The scheduler of ``kvstore serve``: one thread owns the model.

A :class:`Job` (a prompt's tokens, how many to generate, how to sample) is handed to
:meth:`Engine.submit`, which answers with a :class:`Handle` at once (or raises
:class:`Busy`). The engine's thread then, for each job:

1. fetches the longest cached prefix of its prompt from the
   :class:`~kvstore.mlx_lm.prompt_cache.PersistentPromptCache` (``set_tenant``,
   ``set_request``, ``set_breakpoints``, ``fetch_nearest_cache``: as mlx-lm's server did);
2. prefills the rest itself, a chunk between two decode steps (one chunk of one job, or
   the chunks of several short ones, each job once a step and in turn), so that a long
   prompt holds the others up by at most one chunk a step. A chunk is at most
   ``prefill_chunk`` tokens and about ``prefill_seconds`` of prefill, at the rate the job's
   last chunk ran (:func:`chunk_tokens`): on a machine that prefills 15 tokens a second,
   2,048 tokens would hold every other request up for two minutes (a prompt with at most
   :data:`FIRST_CHUNK` tokens left is not cut by time). A
   chunk also ends at each *cut*: a cache breakpoint, a segment end the protocol asked
   for (:attr:`Job.cuts`), a checkpoint (every ``checkpoint_every`` tokens, for a model
   whose cache cannot be trimmed) and a prefix another job is waiting for; the cache
   there is inserted into the prompt cache with the cut's type. With ``prefill_threads``
   above 1, that many jobs' chunks run side by side, each on a thread and a stream of its
   own (on a CPU, MLX runs a forward pass on one core);
3. decodes it together with the other running jobs in one
   :class:`mlx_lm.generate.BatchGenerator` (continuous batching, up to
   ``max_concurrency`` jobs), streaming a :class:`Token` per token. A job that is decoded
   while no other is runs alone on its own caches (:class:`_Solo`: a batch of one costs
   more a step) until another job is ready to decode, and then joins the batch;
4. inserts the prompt and the reply into the prompt cache (as mlx-lm's server did) and
   ends with :class:`Done`.

Jobs that arrive together and share a prefix the cache does not hold (an agent and its
subagents: the same long system prompt and tools) compute it once: the first one's
prefill is cut where the others' prompts part from it, that cache is inserted, and the
others fetch it when the first one has passed there.

Every exception inside one job ends that job (``Done(finish="error")``); the loop goes
on. A failure of a decode step ends every job being decoded (the batch shares its
state). :meth:`Handle.cancel` takes effect within one decode step or one prefill chunk:
what the job's cache holds by then is still saved.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import itertools
import logging
import queue
import random
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, make_stop_sequences
from mlx_lm.models import cache as _cache
from mlx_lm.sample_utils import greedy_sampler, make_logits_processors, make_sampler

from kvstore.mlx_lm.cache_control import pin_type
from kvstore.mlx_lm.prefill import (
    checkpoint_positions,
    checkpoint_type,
    conversation_id,
    default_every,
    needs_checkpoints,
    parse_checkpoint_type,
)
from kvstore.mlx_lm.prompt_cache import PersistentPromptCache
from kvstore.mlx_lm.requests import RequestContext, RequestRecord
from kvstore.mlx_lm.writebehind import common_prefix

__all__ = ["Busy", "Done", "Engine", "Handle", "Job", "Prefill", "Sampling", "Token",
           "chunk_tokens"]

logger = logging.getLogger("kvstore.server")

#: Shortest shared prefix (tokens) worth a job's waiting for another job's prefill.
SHARE_MIN = 256
#: The fewest prompt tokens a time-bounded chunk holds (a forward pass reads every weight
#: once, whatever its length: shorter chunks spend more on that than on the tokens).
MIN_CHUNK = 64
#: The chunk before the engine has timed any: ``prefill_chunk`` or this, the fewer.
FIRST_CHUNK = 256
#: Seconds between two wake-ups of a reader not streamed for its tokens (its stop strings
#: are looked for when it wakes: a stop ends its job at most this much later).
BULK_WAKE = 0.02


def chunk_tokens(rate: float | None, seconds: float, most: int) -> int:
    """How many prompt tokens go between two decode steps: about ``seconds`` of prefill at
    ``rate`` (prompt tokens a second, as the last chunks ran), at least :data:`MIN_CHUNK`
    and at most ``most`` (``prefill_chunk``). ``seconds`` 0: ``most`` always; no rate yet:
    :data:`FIRST_CHUNK`."""
    if seconds <= 0:
        return most
    if rate is None:
        return min(most, FIRST_CHUNK)
    return min(most, max(MIN_CHUNK, int(rate * seconds)))


class Busy(Exception):
    """:meth:`Engine.submit` refused a job: the queue is full, or the engine is stopping."""

    def __init__(self, message: str, *, retry_after: float = 1.0, stopping: bool = False
                 ) -> None:
        super().__init__(message)
        self.retry_after = retry_after  # seconds, for Retry-After
        self.stopping = stopping


@dataclass(frozen=True, slots=True)
class Sampling:
    """How to choose each token (already validated by the protocol layer)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.0
    repetition_penalty: float = 0.0  # 0: off
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    presence_context_size: int = 20
    frequency_penalty: float = 0.0
    frequency_context_size: int = 20
    logit_bias: tuple[tuple[int, float], ...] = ()  # ids already checked < vocab size
    seed: int | None = None  # with a temperature: this job's own random stream


@dataclass(slots=True)
class Job:
    """One request, as the engine runs it."""

    prompt: list[int]  # the whole prompt's tokens (rendered by the protocol layer)
    max_tokens: int  # already capped by --max-tokens
    sampling: Sampling = field(default_factory=Sampling)
    top_logprobs: int = 0  # 0: none; k>0: the token's logprob and the k best (k<=20)
    logprobs: bool = False  # the chosen token's logprob
    salt: str | None = None  # tenant: PersistentPromptCache.set_tenant
    breakpoints: dict[int, float] = field(default_factory=dict)  # position -> ttl s
    context: RequestContext | None = None  # PersistentPromptCache.set_request
    #: Positions of the prompt where the cache is inserted with the given type as the
    #: prefill passes them (mlx-lm's segment ends: ``{end of the system prompt:
    #: "system"}``; a breakpoint's pinned type, ``cache_control.pin_type(ttl,
    #: priority)``). A breakpoint without one is inserted as ``pin_type(ttl, "user")``.
    cuts: dict[int, str] = field(default_factory=dict)
    #: Whether its reader shows each token as it comes (a stream). A reader that answers
    #: once at the end (a request not streamed) is woken for a token at most every
    #: :data:`BULK_WAKE` seconds; for every other event at once.
    streamed: bool = True


@dataclass(slots=True)
class Token:
    """A generated token. ``text``: what it adds to the detokenized reply (an EOS token,
    which is sent too, gives what the detokenizer still held, usually nothing)."""

    id: int
    text: str
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # the k best (id, logprob), best first


@dataclass(slots=True)
class Prefill:
    """Prefill progress, at most one per chunk: ``done`` of the ``total`` prompt tokens the
    job computes (those the cache did not give), as mlx-lm's server counts them."""

    done: int
    total: int


@dataclass(slots=True)
class Done:
    """The job's end; the last event."""

    finish: str  # "stop" (an EOS token), "length", "error", or the reason given to cancel()
    prompt_tokens: int
    cached_tokens: int
    generated: int
    record: RequestRecord | None = None  # the prompt cache's record of the request
    error: str | None = None  # finish == "error": what went wrong (the loop goes on)


Event = Token | Prefill | Done


class Handle:
    """A submitted job's events and its cancel; thread-safe."""

    def __init__(self, poke: Callable[[], None], *, streamed: bool = True) -> None:
        self._poke = poke
        self._streamed = streamed
        self._woke = 0.0  # when a token last woke the reader (monotonic)
        self._cond = threading.Condition(threading.Lock())
        self._events: deque[Event] = deque()
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self._signaled = False  # a wake-up is on its way to the waiter
        self._reason: str | None = None
        self._done = False

    def cancel(self, reason: str = "cancelled") -> None:
        """End the job within one decode step or prefill chunk; its Done's finish is
        ``reason``. Tokens of the steps before it took effect may still come first.
        Idempotent: the first reason stands; nothing after its Done."""
        with self._cond:
            if self._reason is not None or self._done:
                return
            self._reason = reason
        self._poke()

    @property
    def cancelled(self) -> str | None:
        """The reason given to :meth:`cancel`, if any."""
        return self._reason

    def get(self, timeout: float | None = None) -> Event:
        """The next event (blocking); TimeoutError when none came within ``timeout``."""
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._events), timeout):
                raise TimeoutError("no event from the engine")
            return self._events.popleft()

    async def batches(self, idle: float | None) -> AsyncIterator[list[Event]]:
        """The events in order, all those that are ready at a time (a reader that fell
        behind a decode step or two takes them in one go, not one wake-up each); an empty
        list after ``idle`` seconds without one (None: never). Ends after :class:`Done`.

        The engine wakes the reader's event loop once for the events it puts before the
        reader takes them, not once an event: on a busy loop each wake-up costs the
        engine's thread a turn at the GIL."""
        wake = asyncio.Event()
        with self._cond:
            self._waiter = (asyncio.get_running_loop(), wake)
        try:
            while True:
                with self._cond:
                    got = list(self._events)
                    self._events.clear()
                    if not got:
                        wake.clear()
                        self._signaled = False
                if not got:
                    try:
                        async with asyncio.timeout(idle):
                            await wake.wait()
                    except TimeoutError:
                        yield []
                    continue
                yield got
                if isinstance(got[-1], Done):  # nothing is put after it
                    return
        finally:
            with self._cond:
                self._waiter = None

    def _put(self, ev: Event) -> None:
        with self._cond:
            if self._done:
                return
            self._done = isinstance(ev, Done)
            self._events.append(ev)
            self._cond.notify_all()
            waiter = None if self._signaled else self._waiter
            if waiter is not None and not self._streamed and isinstance(ev, Token):
                now = time.monotonic()
                if now - self._woke < BULK_WAKE:
                    waiter = None  # the next event wakes it, Done at the latest
                else:
                    self._woke = now
            if waiter is not None:
                self._signaled = True
        if waiter is not None:
            loop, wake = waiter
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # its loop is closed: nobody listens any more
                pass


class _Work:
    """The engine's side of one job (the loop thread's alone)."""

    def __init__(self, job: Job, handle: Handle) -> None:
        self.job = job
        self.handle = handle
        self.state = "queued"  # queued, waiting, prefill, decode
        self.cache: list[Any] | None = None
        self.pos = 0  # prompt tokens the cache holds
        self.start = 0  # ... after the fetch: the cached tokens
        self.cuts: dict[int, str] = {}
        self.record: RequestRecord | None = None
        self.uid: int | None = None
        self.detok: Any = None
        self.generated = 0
        self.leader: _Work | None = None  # waiting for its prefill to pass ``wait_at``
        self.wait_at = 0
        self.failed: BaseException | None = None  # its sampler or a logits processor raised
        self.shared: set[int] = set()  # prefixes of its cache inserted for others
        self.rate: float | None = None  # prompt tokens a second of its last chunk

    @property
    def left(self) -> int:
        """The prompt tokens it has still to prefill (the last goes to the decoder)."""
        return len(self.job.prompt) - 1 - self.pos

    def guarded(self, sampler: Any, processors: list[Any]) -> tuple[Any, list[Any]]:
        """The job's sampler and logits processors, each failure of theirs kept in
        ``failed`` instead of raised: the batch's step goes on (greedy for this job), and
        the loop ends this job alone after it."""

        def guard(p: Any) -> Any:
            def processor(tokens: mx.array, logits: mx.array) -> mx.array:
                if self.failed is None:
                    try:
                        return p(tokens, logits)  # type: ignore[no-any-return]
                    except Exception as e:  # noqa: BLE001
                        self.failed = e
                return logits
            return processor

        def sample(logprobs: mx.array) -> mx.array:
            if self.failed is None:
                try:
                    return sampler(logprobs)  # type: ignore[no-any-return]
                except Exception as e:  # noqa: BLE001
                    self.failed = e
            return greedy_sampler(logprobs)

        return (sampler if sampler is greedy_sampler else sample), [guard(p) for p in processors]


def _seeded(sampler: Callable[[mx.array], mx.array], seed: int
            ) -> Callable[[mx.array], mx.array]:
    """``sampler`` drawing its n-th token from a random stream seeded by ``(seed, n)``: the
    same seed, the same tokens, whatever else the batch holds. (mlx's random state cannot
    be saved and restored: the global one is reseeded from Python's after each draw, so the
    jobs without a seed stay unpredictable.)"""
    step = [0]

    def sample(logprobs: mx.array) -> mx.array:
        mx.random.seed((seed * 1_000_003 + step[0]) % (1 << 63))
        step[0] += 1
        try:
            return sampler(logprobs)
        finally:
            mx.random.seed(_entropy.getrandbits(63))

    return sample


_entropy = random.SystemRandom()


def _outcome(fn: Callable[[], Any]) -> Any:
    """``fn()``, or the exception it raised."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - handed to the caller
        return e


class _Lanes:
    """Threads that run prefill chunks beside the engine's thread, each on a stream of its
    own: on a CPU, MLX runs a forward pass on one core (SmolLM2-135M here: 6.0 s of wall
    time, 6.1 s of CPU time for 100 tokens), so two prompts' chunks run side by side on
    two cores in 0.6x the time (the same arithmetic: the same bits). MLX's streams belong
    to the thread that made them: each lane makes its own and clears it before it ends."""

    def __init__(self, n: int, device: Any) -> None:
        self._inboxes: list[queue.SimpleQueue[Any]] = []
        self._threads: list[threading.Thread] = []
        for i in range(n):
            inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
            t = threading.Thread(target=self._serve, args=(inbox, device),
                                 name=f"kvstore-prefill-{i + 1}", daemon=True)
            t.start()
            self._inboxes.append(inbox)
            self._threads.append(t)

    @staticmethod
    def _serve(inbox: queue.SimpleQueue[Any], device: Any) -> None:
        try:
            stream = mx.new_stream(device)
        except Exception as e:  # noqa: BLE001 - every chunk sent here fails with it
            logger.warning("kvstore serve: a prefill thread has no stream", exc_info=True)
            while (item := inbox.get()) is not None:
                item[1].set_exception(e)
            return
        try:
            with mx.stream(stream):
                while (item := inbox.get()) is not None:
                    fn, done = item
                    try:
                        done.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 - handed to the engine
                        done.set_exception(e)
        finally:
            mx.clear_streams()

    def run(self, fns: Sequence[Callable[[], Any]]) -> list[Any]:
        """Call ``fns``, the first on this thread and one on each lane at the same time:
        each one's result, or the exception it raised."""
        assert len(fns) <= len(self._inboxes) + 1
        futures: list[Future[Any]] = []
        for fn, inbox in zip(fns[1:], self._inboxes, strict=False):
            done: Future[Any] = Future()
            inbox.put((fn, done))
            futures.append(done)
        out = [_outcome(fns[0])]
        for f in futures:
            err = f.exception()
            out.append(f.result() if err is None else err)
        return out

    def close(self) -> None:
        for inbox in self._inboxes:
            inbox.put(None)
        for t in self._threads:
            t.join(timeout=10.0)


@dataclass(slots=True)
class _Out:
    """A decode step's result for one job: the fields of mlx-lm's
    ``GenerationBatch.Response`` that the engine reads. ``prompt_cache`` and ``all_tokens``
    (the tokens that cache holds) only with a ``finish_reason``."""

    uid: int
    token: int
    logprobs: mx.array
    finish_reason: str | None
    prompt_cache: list[Any] | None
    all_tokens: list[int] | None


def _int(a: mx.array) -> int:
    """The value of a one-element integer array (evaluated now)."""
    v: Any = a.item()
    return int(v)


class _Solo:
    """One job decoded alone on its own caches, the way mlx-lm's ``generate_step`` does:
    each step runs the model on the last token and starts the next step's before it waits
    for this one's token. A batch of one pays on every step for what a batch needs (its
    padded cache's masks and offsets, a row split off the logits, the batch's
    bookkeeping); where a step costs about a millisecond (a small model on a CPU), that
    is a tenth of it. Its tokens, logprobs, end (``length``, a stop sequence of
    ``stop``) and final cache are those of the batch: the same sampler and logits
    processors on the same logits, and the cache holds every token it returned.

    The engine makes one for each job that goes on to decode. While no other job is being
    decoded, it steps the job this way; otherwise, or when another job is ready to decode
    (:meth:`handover`), the job goes into the batch with :meth:`insert_args`. Its first
    step runs at the first :meth:`next`: jobs whose prefills end in the same engine step go
    into the batch together, as they did before any step."""

    def __init__(self, model: Any, uid: int, last: int, cache: list[Any],
                 tokens: Sequence[int], sampler: Any, processors: list[Any], stop: Any,
                 max_tokens: int) -> None:
        self.model = model
        self.uid = uid
        self.cache = cache
        self.tokens = list(tokens)  # the tokens the cache holds, once the queued step ran
        self.sampler = sampler
        self.processors = processors
        self.context: Any = None  # the processors' tokens, from the first step
        self.matcher = stop.matcher()
        self.stop = stop
        self.max_tokens = max_tokens
        self.generated = 0
        self._last = last  # the input the next step (or the batch) goes on from
        self._next: tuple[mx.array, mx.array] | None = None  # the step queued: none yet

    def _forward(self, y: mx.array) -> tuple[mx.array, mx.array]:
        """Queue the step on ``y`` (shape [1], maybe not evaluated yet): the token it
        samples and its logprobs, being evaluated."""
        logits = self.model(y[None], cache=self.cache)[:, -1, :]
        if self.context is not None:
            ctx = self.context.update_and_fetch(y)
            for p in self.processors:
                logits = p(ctx, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        sampled = self.sampler(logprobs)
        row = logprobs[0]
        mx.async_eval(sampled, row)  # type: ignore[no-untyped-call]
        return sampled, row

    def _out(self, token: int, logprobs: mx.array) -> _Out:
        self.generated += 1
        finish = "length" if self.generated >= self.max_tokens else None
        if self.matcher.advance(token):
            finish = "stop"
        if finish is None:
            return _Out(self.uid, token, logprobs, None, None, None)
        return _Out(self.uid, token, logprobs, finish, self.cache, self.tokens)

    def next(self) -> _Out:
        """The next token; the step after it is queued first (so it runs while the caller
        handles this one), and its input is then in the cache."""
        if self._next is None:  # the first step: on the prompt's last token
            if self.processors:
                self.context = _cache.TokenBuffer(self.tokens)  # type: ignore[no-untyped-call]
            self.tokens.append(self._last)
            self._next = self._forward(mx.array([self._last]))
        y, logprobs = self._next
        self._next = self._forward(y)
        token = _int(y)
        self.tokens.append(token)
        if self.generated % 256 == 255:
            mx.clear_cache()
        return self._out(token, logprobs)

    def handover(self) -> _Out | None:
        """Stop stepping: the token the queued step computed (None before the first step),
        which is not in the cache yet: the batch goes on from it, unless it ends the job."""
        if self._next is None:
            return None
        y, logprobs = self._next
        self._next = None
        out = self._out(_int(y), logprobs)
        self._last = out.token
        return out

    def insert_args(self) -> dict[str, Any]:
        """The arguments of ``BatchGenerator.insert`` that decode the rest of the job in
        the batch, from the input :meth:`next` would have gone on from."""
        return {"prompts": [[self._last]], "max_tokens": [self.max_tokens - self.generated],
                "caches": [self.cache], "all_tokens": [self.tokens],
                "samplers": [self.sampler], "logits_processors": [self.processors],
                "stop_sequences": [self.stop]}

    @property
    def nbytes(self) -> int:
        return sum(int(c.nbytes) for c in self.cache)


class Engine:
    """The scheduler: see the module's docstring. ``checkpoint_every``: a checkpoint every
    that many prompt tokens for a model whose cache cannot be trimmed (0: none; None:
    :func:`kvstore.mlx_lm.prefill.default_every` for the model). ``prefill_seconds``: the
    time a chunk of prefill aims at (0: every chunk ``prefill_chunk`` tokens).
    ``prompt_cache_bytes`` (mlx-lm's ``--prompt-cache-bytes``): the prompt cache's memory
    tier is trimmed at each fetch to that less what the running jobs' caches hold.
    ``share_min``: the shortest prefix shared with another job's prefill that a job waits
    for (or is given a copy of). ``prefill_threads``: how many jobs' chunks are prefilled
    side by side, each on a thread and a stream of its own (:class:`_Lanes`; 1: one after
    the other on the engine's thread); each of them gets ``prefill_chunk`` tokens and
    ``prefill_seconds`` a step. ``solo``: a job that is decoded while no other is runs on its
    own caches (:class:`_Solo`), not as a batch of one."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        cache: PersistentPromptCache,
        *,
        model_key: Hashable,
        max_concurrency: int = 8,
        max_queue: int = 64,
        prefill_chunk: int = 2048,
        prefill_seconds: float = 1.0,
        checkpoint_every: int | None = 0,
        retry_after: float = 1.0,
        share_min: int = SHARE_MIN,
        prompt_cache_bytes: int | None = None,
        prefill_threads: int = 1,
        solo: bool = True,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if not 0 <= prefill_seconds < float("inf"):
            raise ValueError(f"prefill_seconds must be >= 0 and finite, got {prefill_seconds}")
        if prefill_threads < 1:
            raise ValueError(f"prefill_threads must be >= 1, got {prefill_threads}")
        if checkpoint_every is not None and checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
        self.model = model
        self.tokenizer = tokenizer
        self.cache = cache
        self.model_key = model_key
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self.prefill_seconds = prefill_seconds
        self.prefill_threads = prefill_threads
        self._lanes: _Lanes | None = None
        self._rate: float | None = None  # prompt tokens a second of the last chunks
        self.retry_after = retry_after
        self.share_min = share_min
        self.prompt_cache_bytes = prompt_cache_bytes
        self._every_asked = checkpoint_every
        self.checkpoint_every = 0  # decided at start()
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[_Work] = deque()
        self._active: list[_Work] = []  # admitted: waiting, prefill, decode (loop thread)
        self._decoding: dict[int, _Work] = {}
        self._poked = False
        self._stopping = False
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._crashed = False
        self._bg: Any = None  # a BatchGenerator (untyped)
        self.solo = solo
        self._solo: _Solo | None = None  # the job decoded alone (then the batch is empty)
        self._solo_uids = itertools.count(-1, -1)  # its uids: the batch's are >= 0
        self._stream: Any = None
        self._turn = 0  # round robin over the prefills
        self._counts: dict[str, int] = dict.fromkeys(
            ("submitted", "completed", "cancelled", "errors", "busy", "prefill_tokens",
             "prefill_chunks", "decode_steps", "generated_tokens", "shared_waits",
             "shared_copies"), 0)
        self._eos = make_stop_sequences(tokenizer, [])  # type: ignore[no-untyped-call]
        self._xtc_special = list(tokenizer.encode("\n")) + list(tokenizer.eos_token_ids)
        #: Called with each job's sampler and logits processors before it is decoded
        #: (tests inject failures here); returns what is used.
        self.sampling_hook: Callable[[Job, Any, list[Any]], tuple[Any, list[Any]]] | None = None

    # --- the public interface --------------------------------------------------------

    def start(self) -> None:
        """Start the loop thread (once)."""
        if self._thread is not None:
            raise RuntimeError("the engine was started already")
        self.checkpoint_every = self._decide_every()
        self._thread = threading.Thread(target=self._run, name="kvstore-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Handle:
        """Queue a job; raises :class:`Busy` when the queue is full or the engine stops.
        Jobs submitted before :meth:`start` wait for it."""
        if not job.prompt:
            raise ValueError("a job needs at least one prompt token")
        if job.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {job.max_tokens}")
        handle = Handle(self._poke, streamed=job.streamed)
        work = _Work(job, handle)
        with self._cond:
            if self._stopping:
                self._counts["busy"] += 1
                raise Busy("the server is stopping", retry_after=self.retry_after,
                           stopping=True)
            if self._thread is not None and not self._thread.is_alive():
                raise RuntimeError("the engine is not running")  # its loop died
            free = max(0, self.max_concurrency - len(self._active))
            if len(self._queue) - free >= self.max_queue:
                self._counts["busy"] += 1
                raise Busy(f"{len(self._queue)} requests are waiting",
                           retry_after=self.retry_after)
            self._queue.append(work)
            self._counts["submitted"] += 1
            self._cond.notify_all()
        return handle

    def stop(self, timeout: float | None) -> int:
        """Refuse new jobs, let the queued and running ones finish for up to ``timeout``
        seconds (None: as long as they take), then end the rest (``cancelled``) and the
        loop. Returns how many were left unfinished."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._stopping = True
            while self._queue or self._active:
                if self._thread is None or not self._thread.is_alive():
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(0.1 if left is None else min(left, 0.1))
            unfinished = len(self._queue) + len(self._active)
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
        return unfinished

    def healthy(self) -> bool:
        """False only when the loop thread has died (or was never started)."""
        if self._thread is None or self._crashed:
            return False
        return self._thread.is_alive() or self._stopped

    def counts(self) -> dict[str, int]:
        """``running`` (admitted: prefilling, waiting for a shared prefix or decoding),
        ``queued`` and the counters since the start: ``submitted``, ``completed``,
        ``cancelled``, ``errors``, ``busy`` (refused), ``prefill_tokens`` (the prompt
        tokens the model was run on), ``prefill_chunks``, ``decode_steps``,
        ``generated_tokens``, ``shared_waits`` (jobs that waited for another's prefill),
        ``shared_copies`` (prefixes of a prefill copied for a job that came later)."""
        with self._cond:
            out = dict(self._counts)
            out["queued"] = len(self._queue)
            out["running"] = len(self._active)
        return out

    # --- the loop ------------------------------------------------------------------------

    def _poke(self) -> None:
        with self._cond:
            self._poked = True
            self._cond.notify_all()

    def _count(self, name: str, n: int = 1) -> None:
        with self._cond:
            self._counts[name] += n

    def _decide_every(self) -> int:
        if self._every_asked == 0:
            return 0
        if not needs_checkpoints(_cache.make_prompt_cache(self.model)):
            logger.info("kvstore: no checkpoints: this model's cache can be trimmed")
            return 0
        every = self._every_asked
        if every is None:
            every = default_every(self.model, self.cache.store.block_tokens)
        logger.info("kvstore: a checkpoint every %d prompt tokens", every)
        return every

    def _run(self) -> None:
        try:
            self._stream = mx.default_stream(mx.default_device())
            if self.prefill_threads > 1:
                self._lanes = _Lanes(self.prefill_threads - 1, mx.default_device())
            with mx.stream(self._stream):
                self._bg = self._new_batch()
                self._loop()
        except BaseException:
            self._crashed = True
            logger.exception("kvstore serve: the engine's thread died")
            raise
        finally:
            if self._lanes is not None:
                self._lanes.close()
            with self._cond:
                self._cond.notify_all()

    def _busy(self) -> bool:
        """Whether the loop has something to do now (under the lock)."""
        if self._queue and len(self._active) < self.max_concurrency:
            return True
        return any(w.state in ("prefill", "decode") for w in self._active)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._poked or self._stopped or self._busy()):
                    self._cond.wait()
                self._poked = False
                stopped = self._stopped
            if stopped:
                self._end_all("cancelled")
                return
            try:
                self._tick()
            except Exception as e:  # noqa: BLE001 - a bug here must not end the loop
                logger.exception("kvstore serve: an engine step failed; its jobs end")
                for w in list(self._active):
                    self._fail(w, e)
                self._reset_batch()
            with self._cond:
                if not self._queue and not self._active:
                    self._cond.notify_all()  # stop() waits for this

    def _tick(self) -> None:
        self._take_cancels()
        self._admit()
        # at most a chunk of prompt tokens between two decode steps (prefill_chunk, and
        # about prefill_seconds): one chunk of one job, or several short ones (each job
        # once a step, in turn). Each job's share is sized by its own last chunk's rate
        # (a job's context sets it: 20k tokens in, a chunk runs several times slower
        # than a short prompt's), a job's first by the engine's. A prompt with at most
        # FIRST_CHUNK tokens left is not cut by time: prompts that arrive together are
        # prefilled in the same steps and decoded together from their first token.
        # With prefill_threads > 1, a step's chunks go in waves of that many jobs side by
        # side, each lane with its own prefill_chunk tokens and prefill_seconds.
        budget, left, served = self.prefill_chunk, self.prefill_seconds, set[int]()
        while budget > 0:
            wave: list[tuple[_Work, int]] = []
            while len(wave) < self.prefill_threads:
                w = self._next_prefill(served, short=bool(self.prefill_seconds) and left <= 0)
                if w is None:
                    break
                served.add(id(w))
                most = budget
                if self.prefill_seconds and w.left > FIRST_CHUNK:
                    most = chunk_tokens(w.rate if w.rate is not None else self._rate, left,
                                        budget)
                wave.append((w, most))
            if not wave:
                break
            t0 = time.perf_counter()
            done = self._prefill_wave(wave)
            if done is None:  # a job failed: the others go on next step
                break
            budget -= done
            left -= time.perf_counter() - t0
        if self._decoding:
            self._decode_step()

    def _take_cancels(self) -> None:
        with self._cond:
            gone = [w for w in self._queue if w.handle.cancelled is not None]
            for w in gone:
                self._queue.remove(w)
        for w in gone:
            why = w.handle.cancelled or "cancelled"
            # no request line will come (it never reached the cache's lookup): say it here
            logger.info("kvstore: a request left while queued: prompt=%d outcome=%s",
                        len(w.job.prompt), why)
            self._finish(w, why)
        for w in list(self._active):
            reason = w.handle.cancelled
            if reason is not None:
                try:
                    self._cancel(w, reason)
                except Exception as e:  # noqa: BLE001
                    self._fail(w, e)

    def _admit(self) -> None:
        while len(self._active) < self.max_concurrency:
            with self._cond:
                if not self._queue:
                    return
                w = self._queue.popleft()
                self._active.append(w)
            try:
                leader, at = self._leader_for(w)
                if leader is not None:
                    w.state, w.leader, w.wait_at = "waiting", leader, at
                    kind = leader.cuts.get(at)
                    if kind is None or parse_checkpoint_type(kind) is not None:
                        leader.cuts[at] = "system"  # into memory, where the fetch looks first
                    self._count("shared_waits")
                else:
                    self._share_passed(w)
                    self._fetch(w)
            except Exception as e:  # noqa: BLE001
                self._fail(w, e)

    def _leader_for(self, w: _Work) -> tuple[_Work | None, int]:
        """A job whose prefill will pass a prefix of ``w``'s prompt that it has not
        reached yet (at least ``share_min`` tokens), and that prefix's length."""
        best, at = None, 0
        for other in self._active:
            if other.state != "prefill" or other.job.salt != w.job.salt:
                continue
            n = min(common_prefix(other.job.prompt, w.job.prompt),
                    len(other.job.prompt) - 1, len(w.job.prompt) - 1)
            if n >= self.share_min and n > other.pos and n > at:
                best, at = other, n
        return best, at

    def _share_passed(self, w: _Work) -> None:
        """When a job being prefilled has computed a prefix of ``w``'s prompt already (at
        least ``share_min`` tokens, beyond what its own fetch gave) and its cache can be
        trimmed, insert a copy of that cache trimmed to the prefix: ``w``'s fetch finds it."""
        for other in self._active:
            if other.state != "prefill" or other.job.salt != w.job.salt or other.cache is None:
                continue
            n = min(common_prefix(other.job.prompt, w.job.prompt), len(w.job.prompt) - 1)
            if n < self.share_min or not other.start < n <= other.pos or n in other.shared:
                continue
            if not _cache.can_trim_prompt_cache(other.cache):
                continue
            snapshot = copy.deepcopy(other.cache)
            if other.pos > n:
                _cache.trim_prompt_cache(snapshot, other.pos - n)
            self._insert(other, other.job.prompt[:n], snapshot, "system")
            other.shared.add(n)
            self._count("shared_copies")
            return

    def _release(self, leader: _Work, ended: bool = False) -> None:
        """Let the jobs waiting for ``leader`` fetch: it passed their prefix, or ended."""
        for w in list(self._active):
            if w.leader is leader and (ended or leader.pos >= w.wait_at):
                w.leader = None
                try:
                    self._fetch(w)
                except Exception as e:  # noqa: BLE001
                    self._fail(w, e)

    def _fetch(self, w: _Work) -> None:
        job, pc = w.job, self.cache
        pc.set_tenant(job.salt)
        pc.set_request(job.context)
        pc.set_breakpoints(job.breakpoints)
        cache, rest = pc.fetch_nearest_cache(self.model_key, list(job.prompt))
        w.record = getattr(pc, "last_record", None)
        n = len(job.prompt) - len(rest) if cache is not None else 0
        if cache is None:
            cache = _cache.make_prompt_cache(self.model)
        end = len(job.prompt) - 1  # the last token goes to the decoder
        if n > end:
            if _cache.can_trim_prompt_cache(cache):
                _cache.trim_prompt_cache(cache, n - end)
                n = end
            else:
                cache, n = _cache.make_prompt_cache(self.model), 0
        w.cache, w.pos, w.start = list(cache), n, n
        w.cuts = self._cuts(w)
        w.state = "prefill"
        if self.prompt_cache_bytes is not None:  # the running jobs' caches count too
            held = sum(int(c.nbytes) for x in self._active if x.cache is not None
                       for c in x.cache)
            if self._bg is not None:
                held += int(self._bg.prompt_cache_nbytes)
            if self._solo is not None:
                held += self._solo.nbytes
            pc.trim_to(n_bytes=max(0, self.prompt_cache_bytes - held))

    def _cuts(self, w: _Work) -> dict[int, str]:
        job, end = w.job, len(w.job.prompt) - 1
        cuts = {p: t for p, t in job.cuts.items() if w.pos < p <= end}
        for p, ttl in job.breakpoints.items():
            if w.pos < p <= end and p not in cuts:
                cuts[p] = pin_type(ttl, "user")
        if self.checkpoint_every:
            kind = checkpoint_type(conversation_id(job.prompt), len(job.prompt),
                                   self.checkpoint_every)
            for p in checkpoint_positions(w.pos, end, self.checkpoint_every):
                cuts.setdefault(p, kind)
        return cuts

    def _next_prefill(self, served: set[int], short: bool = False) -> _Work | None:
        """The next job to prefill, in turn, among those not ``served`` this step (``short``:
        among those with at most :data:`FIRST_CHUNK` prompt tokens left)."""
        ready = [w for w in self._active if w.state == "prefill" and id(w) not in served
                 and (not short or w.left <= FIRST_CHUNK)]
        if not ready:
            return None
        self._turn = (self._turn + 1) % len(ready)
        return ready[self._turn]

    def _prefill_wave(self, wave: list[tuple[_Work, int]]) -> int | None:
        """Prefill each job's next chunk (at most its ``most`` tokens, up to its next cut),
        side by side on the lanes when there are several; the most tokens one of them
        computed, or None when one failed (that one is ended)."""
        fns = [functools.partial(self._compute, w, most) for w, most in wave]
        if self._lanes is None:
            outs = [_outcome(fn) for fn in fns]
        else:
            for w, _ in wave[1:]:  # what the fetch left lazy: evaluated on this thread's stream
                assert w.cache is not None
                mx.eval([c.state for c in w.cache])
            outs = self._lanes.run(fns)
        most, failed = 0, False
        for (w, _), out in zip(wave, outs, strict=True):
            try:
                if isinstance(out, BaseException):
                    raise out
                most = max(most, self._advance(w, *out))
            except Exception as e:  # noqa: BLE001 - one job's failure ends that job
                self._fail(w, e)
                failed = True
        return None if failed else most

    def _compute(self, w: _Work, most: int) -> tuple[int, float]:
        """Run the model on ``w``'s next chunk into its cache (on any lane): where the chunk
        ends and the seconds it took."""
        prompt, end = w.job.prompt, len(w.job.prompt) - 1
        assert w.cache is not None
        stop = min([w.pos + most, end, *(p for p in w.cuts if p > w.pos)])
        if stop <= w.pos:
            return w.pos, 0.0
        t0 = time.perf_counter()
        self.model(mx.array(prompt[w.pos:stop])[None], cache=w.cache)
        mx.eval([c.state for c in w.cache])
        mx.clear_cache()
        return stop, time.perf_counter() - t0

    def _advance(self, w: _Work, stop: int, seconds: float) -> int:
        """``w``'s cache holds its prompt up to ``stop`` now: its cut there is inserted, and
        it goes on to decode when its prompt is done; the tokens the chunk computed."""
        prompt, end = w.job.prompt, len(w.job.prompt) - 1
        start = w.pos
        if stop > w.pos:
            self._timed(w, stop - w.pos, seconds)
            self._count("prefill_tokens", stop - w.pos)
            self._count("prefill_chunks")
            w.pos = stop
        kind = w.cuts.pop(w.pos, None)
        if kind is not None:
            assert w.cache is not None
            self._insert(w, prompt[:w.pos], copy.deepcopy(w.cache), kind)
            self._release(w)
        if w.pos >= end:
            self._to_decode(w)
        else:
            w.handle._put(Prefill(w.pos - w.start, len(prompt) - w.start))
        return w.pos - start

    def _timed(self, w: _Work, n: int, seconds: float) -> None:
        """A chunk of ``n`` tokens of ``w`` took ``seconds``: the rate its next chunk is
        sized by, and the engine's, for a job's first (half this chunk's, half what it
        was: a new model shows within a few chunks)."""
        if seconds <= 0:
            return
        w.rate = rate = n / seconds
        self._rate = rate if self._rate is None else (self._rate + rate) / 2

    def _insert(self, w: _Work, tokens: Sequence[int], cache: list[Any], kind: str) -> None:
        try:
            self.cache.set_tenant(w.job.salt)
            self.cache.insert_cache(self.model_key, list(tokens), cache, cache_type=kind)
        except Exception:  # noqa: BLE001 - a save never fails a request
            logger.warning("kvstore: the cache of %d tokens was not kept", len(tokens),
                           exc_info=True)

    def _sampling(self, job: Job) -> tuple[Any, list[Any]]:
        s = job.sampling
        sampler = make_sampler(s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
                               xtc_probability=s.xtc_probability,
                               xtc_threshold=s.xtc_threshold,
                               xtc_special_tokens=self._xtc_special)
        if s.seed is not None and s.temperature != 0:
            sampler = _seeded(sampler, s.seed)
        processors = make_logits_processors(
            dict(s.logit_bias) or None, s.repetition_penalty, s.repetition_context_size,
            s.presence_penalty, s.presence_context_size, s.frequency_penalty,
            s.frequency_context_size)
        if self.sampling_hook is not None:
            sampler, processors = self.sampling_hook(job, sampler, processors)
        return sampler, processors

    def _to_decode(self, w: _Work) -> None:
        prompt = w.job.prompt
        total = len(prompt) - w.start
        sampler, processors = w.guarded(*self._sampling(w.job))
        w.detok = self.tokenizer.detokenizer
        assert self._bg is not None
        assert w.cache is not None
        if self._solo is not None:
            self._handover()
        alone = _Solo(self.model, next(self._solo_uids), prompt[-1], w.cache, prompt[:-1],
                      sampler, processors, self._eos, w.job.max_tokens)
        if self.solo and not self._decoding:
            self._solo, uid = alone, alone.uid
        else:
            (uid,) = self._bg.insert(**alone.insert_args())
        w.cache, w.uid, w.state = None, uid, "decode"
        self._decoding[uid] = w
        self._release(w, ended=True)
        w.handle._put(Prefill(total, total))

    def _handover(self) -> None:
        """Another job is ready to decode: the one decoded alone goes into the batch, after
        the token its last step computed (which may end it)."""
        solo = self._solo
        assert solo is not None and self._bg is not None
        self._solo = None
        w = self._decoding[solo.uid]
        try:
            out = solo.handover()
            if out is not None and w.failed is None:
                self._emit(w, out)
            if w.failed is not None:
                raise w.failed
            if out is None or out.finish_reason is None:
                del self._decoding[solo.uid]
                (w.uid,) = self._bg.insert(**solo.insert_args())
                self._decoding[w.uid] = w
        except Exception as e:  # noqa: BLE001 - that job ends, the other goes on
            self._fail(w, e, in_batch=False)  # not in the batch: insert is the last step

    def _solo_step(self, solo: _Solo) -> None:
        w = self._decoding[solo.uid]
        try:
            r = solo.next()
            self._count("decode_steps")
            if w.failed is None:
                self._emit(w, r)
            if w.failed is not None:
                raise w.failed
        except Exception as e:  # noqa: BLE001 - its job ends, the loop goes on
            self._fail(w, e)
        if w.state == "done":
            self._solo = None

    def _decode_step(self) -> None:
        if self._solo is not None:
            self._solo_step(self._solo)
            return
        assert self._bg is not None
        try:
            _, responses = self._bg.next()
        except Exception as e:  # noqa: BLE001 - the batch's jobs end, the loop goes on
            logger.warning("kvstore serve: a decode step failed", exc_info=True)
            for w in list(self._decoding.values()):
                self._fail(w, e, in_batch=False)
            self._reset_batch()
            return
        self._count("decode_steps")
        for r in responses:
            got = self._decoding.get(r.uid)
            if got is None or got.failed is not None:
                continue
            try:
                self._emit(got, r)
            except Exception as e:  # noqa: BLE001
                self._fail(got, e)
        for bad in [w for w in self._decoding.values() if w.failed is not None]:
            assert bad.failed is not None
            self._fail(bad, bad.failed)

    def _emit(self, w: _Work, r: Any) -> None:
        detok = w.detok
        if r.finish_reason == "stop":  # an EOS token: not detokenized
            detok.finalize()
        else:
            detok.add_token(r.token)
            if r.finish_reason is not None:
                detok.finalize()
        text = detok.last_segment
        job = w.job
        logprob = top = None
        if job.logprobs or job.top_logprobs:
            logprob = float(r.logprobs[r.token].item())
        if job.top_logprobs:
            k = min(job.top_logprobs, int(r.logprobs.shape[-1]))
            idx = mx.argpartition(-r.logprobs, kth=k - 1)[:k]
            got: list[Any] = idx.tolist()  # type: ignore[assignment]
            vals: list[Any] = r.logprobs[idx].tolist()
            top = sorted(((int(i), float(v)) for i, v in zip(got, vals, strict=True)),
                         key=lambda p: -p[1])
        w.generated += 1
        self._count("generated_tokens")
        w.handle._put(Token(int(r.token), text, logprob, top))
        if r.finish_reason is not None:
            self._decoding.pop(r.uid, None)
            if w.record is not None:
                w.record.outcome = r.finish_reason
            self._insert(w, r.all_tokens[:], r.prompt_cache, "assistant")
            self._finish(w, r.finish_reason)

    def _cancel(self, w: _Work, reason: str) -> None:
        """End an admitted job, keeping what its cache holds. Its record's outcome is the
        reason when that is ``stop`` (a stop string) or ``error``, else ``cancelled``."""
        outcome = reason if reason in ("stop", "error") else "cancelled"
        solo = self._solo
        if w.state == "decode" and solo is not None and w.uid == solo.uid:
            self._solo = None
            self._decoding.pop(w.uid, None)
            if w.record is not None:
                w.record.outcome = outcome
            self._insert(w, solo.tokens[:], solo.cache, "assistant")
        elif w.state == "decode" and w.uid is not None and self._bg is not None:
            self._decoding.pop(w.uid, None)
            caches = self._bg.remove([w.uid], return_prompt_caches=True)
            if w.record is not None:
                w.record.outcome = outcome
            if w.uid in caches:
                cache, tokens = caches[w.uid]
                self._insert(w, list(tokens), cache, "assistant")
        elif w.state == "prefill" and w.cache is not None:
            if w.pos > w.start:
                self._insert(w, w.job.prompt[:w.pos], w.cache, "user")
            w.cache = None
            self._release(w, ended=True)
        self._end_record(w, outcome)
        self._finish(w, reason)

    def _end_record(self, w: _Work, outcome: str) -> None:
        """Finish the job's request record now if no insert has (its log line)."""
        rec = w.record
        end = getattr(self.cache, "end_request", None)
        if rec is not None and end is not None:
            try:
                end(rec, outcome)
            except Exception:  # noqa: BLE001 - a log line never fails the loop
                logger.warning("kvstore: a request's record was not finished", exc_info=True)

    def _fail(self, w: _Work, e: BaseException, *, in_batch: bool = True) -> None:
        logger.warning("kvstore serve: a request failed: %s: %s", type(e).__name__, e,
                       exc_info=e)
        try:
            if w.uid is not None and w.uid in self._decoding:
                self._decoding.pop(w.uid, None)
                if self._solo is not None and self._solo.uid == w.uid:
                    self._solo = None
                elif in_batch and self._bg is not None:
                    self._bg.remove([w.uid])
            w.cache = None
            if w.state == "prefill":
                self._release(w, ended=True)
            self._end_record(w, "error")
        except Exception:  # noqa: BLE001
            logger.warning("kvstore serve: cleaning up after a failed request",
                           exc_info=True)
        self._finish(w, "error", error=f"{type(e).__name__}: {e}")

    def _finish(self, w: _Work, finish: str, *, error: str | None = None) -> None:
        if finish == "error":
            kind = "errors"
        elif finish == "cancelled" or (finish == w.handle.cancelled and finish != "stop"):
            kind = "cancelled"  # the client's reason: cancelled, disconnected, shutdown...
        else:
            kind = "completed"
        with self._cond:
            if w in self._active:
                self._active.remove(w)
            self._counts[kind] += 1
        record = w.record
        w.state = "done"
        w.handle._put(Done(finish, len(w.job.prompt), w.start, w.generated, record, error))

    def _reset_batch(self) -> None:
        if self._bg is not None:
            try:
                self._bg.close()
            except Exception:  # noqa: BLE001
                logger.warning("kvstore serve: closing a batch", exc_info=True)
        self._bg = None
        self._solo = None
        self._decoding.clear()
        self._bg = self._new_batch()

    def _new_batch(self) -> Any:
        return BatchGenerator(self.model, completion_batch_size=self.max_concurrency,
                              prefill_batch_size=self.max_concurrency,
                              prefill_step_size=self.prefill_chunk, stream=self._stream)

    def _end_all(self, reason: str) -> None:
        with self._cond:
            queued = list(self._queue)
            self._queue.clear()
        for w in queued:
            self._finish(w, reason)
        for w in list(self._active):
            try:
                self._cancel(w, reason)
            except Exception as e:  # noqa: BLE001
                self._fail(w, e)
        if self._bg is not None:
            self._bg.close()
            self._bg = None

