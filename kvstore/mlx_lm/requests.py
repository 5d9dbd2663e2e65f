"""One record per request served through `PersistentPromptCache`, and its log line.

mlx-lm's server calls ``fetch_nearest_cache`` once per request, then ``insert_cache`` at
the end of each prompt segment it wants kept (the system prompt, …) and once more with
the prompt and the reply when the reply is done. A request's record is opened by the
fetch (its prompt tokens, what each tier gave, the restore time, why it missed), counts
the snapshots its segment ends produced, and is finished by the insert that extends its
prompt: then the ``kvstore request …`` line is logged (docs/CLI.md lists its fields). A
request that never inserts (a client that went away) is finished, ``reply=none``, when
:data:`OPEN_MAX` newer ones are open or after :data:`OPEN_MAX_AGE` seconds.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["CacheObserver", "Parting", "RequestContext", "RequestLog", "RequestRecord",
           "RequestTracker", "logfmt"]

OPEN_MAX = 256  # requests waiting for their reply's insert
OPEN_MAX_AGE = 600.0  # seconds


EXCERPT_CHARS = 40  # of each side of a parting, with ``--log-excerpts``


@dataclass(frozen=True)
class Parting:
    """Where a prompt parted from the deepest stored sequence that shares its start: the
    stored one goes on with another token at ``position``. ``message``, ``role``,
    ``block`` and ``matched`` place it among the request's messages
    (:mod:`kvstore.mlx_lm.partings`); None and ``-`` when the request had none (a text
    completion). ``ours``/``theirs``: a few dozen characters of each side from there,
    only with ``--log-excerpts`` (prompts are private)."""

    position: int
    message: int | None = None
    role: str = "-"
    block: str = "-"
    matched: int | None = None
    ours: str | None = None
    theirs: str | None = None


@dataclass
class RequestContext:
    """What the server knows of a request that its prompt cache does not, handed over just
    before the request's lookup (:meth:`PersistentPromptCache.set_request`): the rewrites
    that fired (:mod:`kvstore.serving.rules`), how to place a token position among the
    request's messages (``(index, role, block, tokens of that message before it)``) and,
    with ``--log-excerpts``, how to turn tokens back into text."""

    rewrites: dict[str, int] = field(default_factory=dict)
    locate: Callable[[Sequence[int], int], tuple[int, str, str, int]] | None = None
    decode: Callable[[Sequence[int]], str] | None = None


def _counts(d: dict[str, int]) -> str:
    return ",".join(f"{k}:{v}" for k, v in d.items()) or "-"


def _opt(v: object) -> object:
    return "-" if v is None else v


@dataclass(eq=False)
class RequestRecord:
    """What one request got from the cache, and what it left for the store."""

    id: int
    model: str  # the namespace's model id; "-" for a model kept in memory only
    prompt_tokens: int
    tier: str | None  # "memory", "local", "remote"; None when nothing was reused
    reused_tokens: int
    restore_seconds: float  # the fetch: memory copy, store lookup and load
    miss: str | None  # kvstore.store.usage.MISS_REASONS, or None
    prompt: list[int] = field(repr=False, default_factory=list)
    started: float = field(repr=False, default_factory=time.monotonic)
    saves_queued: int = 0  # snapshots of this request written at once
    saves_deferred: int = 0  # snapshots kept in memory until replaced or flushed
    reply: str = "none"  # what became of the reply's snapshot: queued, deferred, short, …
    shared: int = 0  # leading tokens the deepest stored sequence (any tier) shares
    parting: Parting | None = None  # where it goes on otherwise; None: it ends there
    #: how to place ``parting`` among the request's messages, run when the request has
    #: finished (:meth:`placed`), not before its prefill: it renders the chat template
    place: Callable[[], Parting] | None = field(repr=False, default=None)
    rewrites: dict[str, int] = field(default_factory=dict)  # rule name: places rewritten
    #: how the request ended, when its server says (``kvstore serve``'s engine): ``stop``,
    #: ``length``, ``cancelled``, ``error``, or the reason its client gave; None: not said
    outcome: str | None = None

    def placed(self) -> None:
        """Place the parting among the request's messages (once; never raises)."""
        place, self.place = self.place, None
        if place is not None:
            try:
                self.parting = place()
            except Exception:  # noqa: BLE001 - a diagnosis never fails a request
                logging.getLogger("kvstore.serve").warning(
                    "kvstore: the parting of a request was not placed", exc_info=True)

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.reused_tokens

    def tokens_from(self, tier: str) -> int:
        return self.reused_tokens if self.tier == tier else 0

    def line(self) -> str:
        """``kvstore request id=7 model=… prompt=571 reused=570 source=local …``."""
        return "kvstore request " + logfmt([
            ("id", self.id),
            ("model", self.model),
            ("prompt", self.prompt_tokens),
            ("reused", self.reused_tokens),
            ("source", self.tier or "none"),
            ("memory", self.tokens_from("memory")),
            ("local", self.tokens_from("local")),
            ("remote", self.tokens_from("remote")),
            ("computed", self.computed_tokens),
            ("restore_ms", f"{self.restore_seconds * 1e3:.1f}"),
            ("miss", self.miss or "-"),
            ("saves_queued", self.saves_queued),
            ("saves_deferred", self.saves_deferred),
            ("reply", self.reply),
            *([("outcome", self.outcome)] if self.outcome is not None else []),
            ("rewrites", _counts(self.rewrites)),
            ("shared", self.shared),
            *self._parting_fields(),
        ])

    def _parting_fields(self) -> list[tuple[str, object]]:
        p = self.parting
        if p is None:
            return [("part", "-"), ("part_msg", "-"), ("part_role", "-"), ("part_block", "-"),
                    ("part_matched", "-")]
        fields: list[tuple[str, object]] = [
            ("part", p.position), ("part_msg", _opt(p.message)), ("part_role", p.role),
            ("part_block", p.block), ("part_matched", _opt(p.matched))]
        if p.ours is not None or p.theirs is not None:
            fields += [("part_ours", p.ours or ""), ("part_theirs", p.theirs or "")]
        return fields


class CacheObserver:
    """What a prompt cache tells its observers (``PersistentPromptCache.observers``); the
    methods run on the caller's thread (``saved``: the write-behind worker's) and must not
    block. Each does nothing here: subclass and override what you need."""

    def fetched(self, rec: RequestRecord) -> None:
        """A request's lookup is done (``rec`` is not finished yet)."""

    def finished(self, rec: RequestRecord) -> None:
        """A request's reply was inserted (or it was given up): ``rec`` is final."""

    def saved(self, done: object) -> None:
        """A background save ended (a :class:`~kvstore.mlx_lm.writebehind.SaveDone`)."""


class RequestLog(CacheObserver):
    """Logs each finished request's line at INFO (``kvstore serve`` uses one)."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log

    def finished(self, rec: RequestRecord) -> None:
        self.log.info("%s", rec.line())


def logfmt(pairs: list[tuple[str, object]]) -> str:
    """``key=value`` pairs; a value with a space, a quote, ``=`` or nothing is quoted."""
    out = []
    for k, v in pairs:
        s = str(v)
        if not s or any(c in s for c in ' "=\\\t\n'):
            s = '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
        out.append(f"{k}={s}")
    return " ".join(out)


class RequestTracker:
    """The open requests of one prompt cache; thread-safe."""

    def __init__(self, finished: Callable[[RequestRecord], None]) -> None:
        self._finished = finished
        self._lock = threading.Lock()
        self._open: list[RequestRecord] = []  # oldest first
        self._ids = itertools.count(1)

    def next_id(self) -> int:
        return next(self._ids)

    def opened(self, rec: RequestRecord) -> None:
        with self._lock:
            self._open.append(rec)
            done = self._expire()
        self._report(done)

    def owner(self, tokens: list[int]) -> tuple[RequestRecord | None, bool]:
        """Whose insert this is: ``(request, True)`` for the reply of the oldest open request
        whose prompt it extends; ``(request, False)`` for a segment end of the oldest open
        request whose prompt starts with it; ``(None, False)`` for neither."""
        with self._lock:
            reply = next((r for r in self._open if len(tokens) >= len(r.prompt)
                          and tokens[: len(r.prompt)] == r.prompt), None)
            if reply is not None:
                return reply, True
            seg = next((r for r in self._open if len(tokens) < len(r.prompt)
                        and r.prompt[: len(tokens)] == tokens), None)
            return seg, False

    def inserted(self, rec: RequestRecord | None, reply: bool, outcome: str) -> None:
        """Count an insert that :meth:`owner` attributed; a reply finishes its request."""
        done: list[RequestRecord] = []
        with self._lock:
            if rec is not None and any(r is rec for r in self._open):
                self._count(rec, outcome)
                if reply:
                    rec.reply = outcome
                    self._open.remove(rec)
                    done.append(rec)
            done += self._expire()
        self._report(done)

    def close(self, rec: RequestRecord) -> None:
        """Finish an open request that will insert no reply (cancelled, failed)."""
        with self._lock:
            found = any(r is rec for r in self._open)
            if found:
                self._open.remove(rec)
        if found:
            self._report([rec])

    def flush(self) -> None:
        """Finish every open request (at close)."""
        with self._lock:
            done, self._open = self._open, []
        self._report(done)

    @staticmethod
    def _count(rec: RequestRecord, outcome: str) -> None:
        if outcome == "queued":
            rec.saves_queued += 1
        elif outcome == "deferred":
            rec.saves_deferred += 1

    def _expire(self) -> list[RequestRecord]:
        now = time.monotonic()
        done = [r for i, r in enumerate(self._open)
                if now - r.started > OPEN_MAX_AGE or i < len(self._open) - OPEN_MAX]
        if done:
            gone = {id(r) for r in done}
            self._open = [r for r in self._open if id(r) not in gone]
        return done

    def _report(self, done: list[RequestRecord]) -> None:
        for rec in done:
            rec.prompt = []
            self._finished(rec)
