"""The index's records: what one entry, one block and the whole root count, and the plans
that change them. Plain values, encoded here, stored by :class:`~kvstore.index.Index`.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

_REF = struct.Struct("<QQQ")  # refcount, size, zero_since_ms


def now_ms() -> int:
    return int(time.time() * 1000)


class EntryRecord(msgspec.Struct, kw_only=True):
    """Per-entry bookkeeping used for listing and eviction."""

    namespace: str
    n_tokens: int
    logical_bytes: int
    created_at: int
    last_access: int
    hits: int = 0
    priority: int = 0  # -1 checkpoint (evicted first), 0 assistant, 1 user, 2 system
    #: Pulled from a remote by a reader without the signing key (nothing checked who wrote
    #: it): a keyed push does not sign it unless told to (``kvstore push --sign-pulled``).
    #: False: saved here, pulled with the key, or recorded before this field existed.
    pulled_unsigned: bool = False
    #: a cache breakpoint's pin (ms; 0: none): kept from eviction while ``now`` is before
    #: ``last_access + pin_ttl`` (kvstore.local.gc caps what pins may hold)
    pin_ttl: int = 0

    def pinned(self, now: int) -> bool:
        """Whether the entry's pin still holds at ``now`` (ms since the epoch)."""
        return self.pin_ttl > 0 and now < self.last_access + self.pin_ttl


class Totals(msgspec.Struct, kw_only=True):
    """Running totals, updated in the transaction that changes what they count.

    ``physical_bytes`` is the size of every block with a refs record, referenced
    or not; ``zero_bytes`` the part of it held by blocks whose refcount is zero
    (garbage waiting for its grace period), so live bytes are the difference.
    """

    entries: int = 0
    blocks: int = 0
    logical_bytes: int = 0
    physical_bytes: int = 0
    hits: int = 0
    lookups: int = 0
    zero_bytes: int = 0

    @property
    def live_bytes(self) -> int:
        """Bytes of the blocks some manifest references."""
        return self.physical_bytes - self.zero_bytes


@dataclass(frozen=True)
class RefInfo:
    refcount: int
    size: int
    zero_since: int


@dataclass
class SavePlan:
    """Everything one save commits, computed before the transaction."""

    digest: bytes
    manifest: bytes
    blocks: dict[bytes, int]  # distinct digest -> size
    prefix_items: list[tuple[bytes, bytes]]
    exact_key: bytes
    entry: EntryRecord
    # called inside the write transaction for a block with no refs record:
    # must make sure the file is on disk (rewrite it when a GC removed it)
    ensure_block: Callable[[bytes], None] = field(default=lambda d: None)


@dataclass
class DeletePlan:
    """What removing one entry takes away (derived from its manifest)."""

    blocks: list[bytes]
    prefix_items: list[tuple[bytes, bytes]]
    exact_key: bytes

_enc = msgspec.msgpack.Encoder()
_entry_dec = msgspec.msgpack.Decoder(EntryRecord)
_totals_dec = msgspec.msgpack.Decoder(Totals)


def encode(rec: EntryRecord | Totals) -> bytes:
    return _enc.encode(rec)


def decode_entry(raw: bytes | memoryview) -> EntryRecord:
    return _entry_dec.decode(raw)


def decode_totals(raw: bytes | memoryview) -> Totals:
    return _totals_dec.decode(raw)


def pack_ref(r: RefInfo) -> bytes:
    return _REF.pack(r.refcount, r.size, r.zero_since)


def unpack_ref(b: bytes) -> RefInfo:
    return RefInfo(*_REF.unpack(b))
