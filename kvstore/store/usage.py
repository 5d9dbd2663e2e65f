"""Per-request reuse by tier: the figures ``kvstore stats`` reports as tokens saved.

A request is one prompt served: by :class:`~kvstore.mlx_lm.PersistentPromptCache` (and so
``kvstore serve`` and ``kvstore demo``), by :meth:`Store.restore`, or reported by a caller
through :meth:`Store.note_request`. It counts its prompt tokens, the tokens it reused and
the tier that gave them (``memory``: the process's in-memory LRU; ``local``: this root;
``remote``: the shared bucket, pulled into this root), the rest as computed, and the
reason it reused less than it might have (:data:`MISS_REASONS`).

The root keeps two sets of counts in its index (the ``usage`` meta record): over its
lifetime and since the last reset (``kvstore stats --reset``). Like access stamps they
are advisory and written in batches (:mod:`kvstore.store.access`): a process adds its
pending counts within a second, at close and at exit.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

import msgspec

from ..errors import KVStoreError
from ..local import Root, now_ms

__all__ = ["MISS_REASONS", "TIERS", "Counts", "Usage", "add_usage", "read_usage", "reset_usage"]

_log = logging.getLogger("kvstore")

USAGE_META = b"usage"

#: Where a request's reused tokens came from.
TIERS = ("memory", "local", "remote")

#: Why a request reused nothing, or less than the stored entries hold for it.
MISS_REASONS = (
    "no_entry",  # no tier holds a prefix of the prompt for this model
    "other_model",  # only entries of another model (fingerprint, tokenizer) hold a prefix of it
    "shallow",  # this model's entries share more of it, but cannot be cut back to it (hybrid
    # and sliding-window caches serve their exact length): the deepest checkpoint is too short
    "verify_failed",  # the entry found had a block that failed its digest check (quarantined)
    "remote_timeout",  # the remote tier did not answer in time (or failed just before)
    "gone",  # the entry found was evicted or removed before it could be read
    "error",  # reading the entry failed otherwise (logged)
    "too_short",  # a prompt of one token: mlx-lm computes at least the last one, so none
    # of it can be reused
    "recompute_faster",  # the process predicted that computing the prefix beats restoring it
)

_N = Annotated[int, msgspec.Meta(ge=0)]


class Counts(msgspec.Struct, kw_only=True):
    """Requests and their tokens, by the tier that gave the reused ones (since ``since``)."""

    since: _N = 0  # ms since the epoch: when these counts began
    requests: _N = 0
    prompt_tokens: _N = 0
    memory_requests: _N = 0
    memory_tokens: _N = 0
    local_requests: _N = 0
    local_tokens: _N = 0
    remote_requests: _N = 0
    remote_tokens: _N = 0
    # why: of the requests that reused nothing (they add up to ``misses``), and of those
    # that reused some tokens but less than the store shares with them
    miss_reasons: dict[str, _N] = msgspec.field(default_factory=dict)
    partial_reasons: dict[str, _N] = msgspec.field(default_factory=dict)

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens that came from a cache, any tier."""
        return self.memory_tokens + self.local_tokens + self.remote_tokens

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens that had to be computed."""
        return max(self.prompt_tokens - self.reused_tokens, 0)

    @property
    def hits(self) -> int:
        """Requests that reused at least one token."""
        return self.memory_requests + self.local_requests + self.remote_requests

    @property
    def misses(self) -> int:
        """Requests that reused nothing."""
        return max(self.requests - self.hits, 0)

    @property
    def tokens_saved_share(self) -> float | None:
        """Reused tokens over prompt tokens: the headline; None before any request."""
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else None

    def add(self, other: Counts) -> None:
        """Add ``other``'s counts to these (``since`` stays)."""
        for name in self.__struct_fields__:
            if name not in ("since", "miss_reasons", "partial_reasons"):
                setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.miss_reasons, other.miss_reasons),
                             (self.partial_reasons, other.partial_reasons)):
            for reason, n in theirs.items():
                mine[reason] = mine.get(reason, 0) + n

    def note(self, prompt_tokens: int, reused_tokens: int, tier: str | None,
             miss: str | None) -> None:
        """Count one request (arguments as :func:`check_request` accepts them)."""
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        if reused_tokens and tier is not None:
            setattr(self, f"{tier}_requests", getattr(self, f"{tier}_requests") + 1)
            setattr(self, f"{tier}_tokens", getattr(self, f"{tier}_tokens") + reused_tokens)
        if miss is not None:
            why = self.partial_reasons if reused_tokens else self.miss_reasons
            why[miss] = why.get(miss, 0) + 1

    def copy(self) -> Counts:
        """A copy that shares no dict with these counts."""
        return msgspec.structs.replace(self, miss_reasons=dict(self.miss_reasons),
                                       partial_reasons=dict(self.partial_reasons))

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape (docs/CLI.md, ``stats --json``: ``requests``)."""
        return {
            "since": self.since or None,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "computed_tokens": self.computed_tokens,
            "tokens_saved_share": self.tokens_saved_share,
            "hits": self.hits,
            "misses": self.misses,
            "tiers": {t: {"requests": getattr(self, f"{t}_requests"),
                          "tokens": getattr(self, f"{t}_tokens")} for t in TIERS},
            "miss_reasons": {r: self.miss_reasons.get(r, 0) for r in MISS_REASONS},
            "partial_reasons": {r: self.partial_reasons.get(r, 0) for r in MISS_REASONS},
        }


class Usage(msgspec.Struct, kw_only=True):
    """The root's request counts: over its lifetime and since the last reset."""

    lifetime: Counts = msgspec.field(default_factory=Counts)
    since_reset: Counts = msgspec.field(default_factory=Counts)
    reset_at: _N = 0  # ms since the epoch of the last reset; 0: never reset

    def to_dict(self) -> dict[str, Any]:
        return {"lifetime": self.lifetime.to_dict(), "since_reset": self.since_reset.to_dict(),
                "reset_at": self.reset_at or None}


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Usage)


def check_request(prompt_tokens: int, reused_tokens: int, tier: str | None,
                  miss: str | None) -> None:
    """Refuse a request whose figures contradict each other (a ValueError naming them)."""
    for name, v in (("prompt_tokens", prompt_tokens), ("reused_tokens", reused_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    if reused_tokens > prompt_tokens:
        raise ValueError(f"reused_tokens {reused_tokens} > prompt_tokens {prompt_tokens}")
    if reused_tokens and tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS} when tokens were reused, got {tier!r}")
    if miss is not None and miss not in MISS_REASONS:
        raise ValueError(f"miss must be one of {MISS_REASONS} or None, got {miss!r}")
    if not reused_tokens and miss is None:  # every miss has its reason: they add up
        raise ValueError(f"a request that reused nothing needs its miss reason, one of "
                         f"{MISS_REASONS}")


def _decode(raw: bytes | None) -> Usage:
    """The stored record, validated; a damaged one is replaced (the counts are advisory)."""
    if raw is None:
        return Usage()
    try:
        u = _dec.decode(raw)
    except msgspec.DecodeError as e:
        _log.warning("kvstore: the root's request counts are unreadable, starting afresh: %s", e)
        return Usage()
    for c in (u.lifetime, u.since_reset):  # only the reasons this version knows
        c.miss_reasons = {k: v for k, v in c.miss_reasons.items() if k in MISS_REASONS}
        c.partial_reasons = {k: v for k, v in c.partial_reasons.items() if k in MISS_REASONS}
    return u


def read_usage(root: Root) -> Usage:
    """The root's request counts as stored."""
    return _decode(root.meta(USAGE_META))


def add_usage(root: Root, delta: Counts) -> None:
    """Add a batch of request counts to both sets, in one write transaction (best effort:
    a root that cannot be written drops them with a log line)."""
    if not delta.requests:
        return

    def added(raw: bytes | None) -> bytes:
        u = _decode(raw)
        now = now_ms()
        for c in (u.lifetime, u.since_reset):
            c.since = c.since or now
            c.add(delta)
        return _enc.encode(u)

    try:
        root.update_meta(USAGE_META, added)
    except KVStoreError as e:
        _log.warning("kvstore: request counts not recorded: %s", e)


def reset_usage(root: Root) -> Usage:
    """Start the since-reset counts anew; returns the counts as they were."""
    was: list[Usage] = []

    def fresh(raw: bytes | None) -> bytes:
        u = _decode(raw)
        was.append(u)
        now = now_ms()
        return _enc.encode(Usage(lifetime=u.lifetime, since_reset=Counts(since=now),
                                 reset_at=now))

    root.update_meta(USAGE_META, fresh)
    return was[-1]


def failure_reason(e: BaseException) -> str:
    """The miss reason of a load that raised ``e``."""
    from ..errors import BlockNotFoundError, DigestMismatchError, EntryNotFoundError
    from ..remote.errors import RemoteError  # here: only a failed load asks
    from .errors import TierTimeoutError

    if isinstance(e, DigestMismatchError):
        return "verify_failed"
    if isinstance(e, (BlockNotFoundError, EntryNotFoundError)):
        return "gone"
    if isinstance(e, (TierTimeoutError, RemoteError)):
        return "remote_timeout"
    return "error"
