"""What the store says of its entries: a save's result, a listed entry, the totals."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import msgspec

from ..blocks import from_hex
from ..catalog.records import PRIORITY_NAMES
from ..errors import EntryNotFoundError
from ..local import EntryRecord
from ..schema import Namespace

MIN_ID_PREFIX = 4  # hex chars of an entry id that resolve() accepts
_ns_dec = msgspec.json.Decoder(Namespace)
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class EntryInfo:
    """What a save produced: the entry id, its size, and the bytes newly written.

    ``created`` is False when the entry was already stored (the same tokens in the
    same namespace): the save returned it and wrote nothing.
    """

    id: str
    n_tokens: int
    logical_bytes: int
    new_bytes: int
    created: bool = True


@dataclass(frozen=True, slots=True)
class Entry:
    """One stored entry, as listed by :meth:`Store.entries` (slots: a root lists 100k)."""

    id: str
    namespace: Namespace
    n_tokens: int
    logical_bytes: int
    created_at: int
    last_access: int
    hits: int
    priority: str
    pin_ttl: int = 0  # ms: a cache breakpoint's pin (kept until last_access + pin_ttl); 0: none


@dataclass(frozen=True)
class Stats:
    entries: int
    blocks: int
    logical_bytes: int
    physical_bytes: int
    dedup_ratio: float
    lookups: int
    hits: int


def entries_of(
    rows: Iterable[tuple[bytes, EntryRecord]], namespace: Namespace | None = None,
    namespaces: dict[str, Namespace] | None = None,
) -> Iterator[Entry]:
    """The index's entry records as :class:`Entry` values (those of ``namespace``); the
    entries of one namespace share one :class:`Namespace` value (kept in ``namespaces``,
    when given, across calls)."""
    seen: dict[str, Namespace] = {} if namespaces is None else namespaces
    for digest, rec in rows:
        ns = seen.get(rec.namespace)
        if ns is None:
            ns = seen[rec.namespace] = _ns_dec.decode(rec.namespace)
        if namespace is not None and ns != namespace:
            continue
        yield Entry(
            id=digest.hex(),
            namespace=ns,
            n_tokens=rec.n_tokens,
            logical_bytes=rec.logical_bytes,
            created_at=rec.created_at,
            last_access=rec.last_access,
            hits=rec.hits,
            priority=PRIORITY_NAMES.get(rec.priority, "assistant"),
            pin_ttl=rec.pin_ttl,
        )


def resolve_id(entry_id: str, ids: Iterable[str]) -> str:
    """The one id of ``ids`` that ``entry_id`` names: itself (64 hex chars) or a unique
    prefix of at least ``MIN_ID_PREFIX`` hex chars."""
    s = entry_id.strip().lower()
    if len(s) == 64:
        from_hex(s)  # an InvalidDigestError unless it is one
        return s
    if not s or not set(s) <= _HEX:
        raise EntryNotFoundError(f"not an entry id or prefix: {entry_id!r}")
    if len(s) < MIN_ID_PREFIX:
        raise EntryNotFoundError(
            f"entry id prefix {entry_id!r} is too short: give at least {MIN_ID_PREFIX} hex chars"
        )
    hits = [i for i in ids if i.startswith(s)]
    if not hits:
        raise EntryNotFoundError(f"no entry matches {entry_id!r}")
    if len(hits) > 1:
        raise EntryNotFoundError(f"{len(hits)} entries match {entry_id!r}: give more hex chars")
    return hits[0]


@dataclass(frozen=True)
class Pulled:
    """An entry of a lower tier (or its prefix) written back into the root."""

    digest: bytes  # the local entry (the tier's, or its cut-back prefix)
    n_tokens: int
    blocks: int  # copied
    bytes: int
    fresh: bool = False  # every block it needs was copied (and checked) just now


@dataclass
class PullReport:
    """What a pull did: the entries written back, and those it could not copy (id -> why)."""

    pulled: list[Pulled] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
