"""Where everything lives in a bucket, and the small records the remote tier keeps there.

Every object is immutable and, but for the GC lease, named by what it holds::

    <prefix>kvstore.json                         the settings (format, hash, block size)
    <prefix>blocks/ab/<hex>                      block bytes (the local file's bytes)
    <prefix>manifests/<hex>                      an encoded manifest, named by its digest;
                                                 metadata ``priority``: the entry's
    <prefix>markers/<c_k>/<entry>.<n>.<t|x>      the entry reaches depth k (empty body)
    <prefix>exact/<exact key>/<entry>.<t|x>      the entry is complete (put last)
    <prefix>access/<ms>-<random>                 a batch of access times (msgpack)
    <prefix>gc/lease                             the compactor's lease (JSON)

``c_k`` is the local index's chain key of the entry's first ``k`` blocks (so a
marker is namespaced by ``c_0``), ``n`` the entry's tokens and ``t``/``x`` whether
it can serve a shorter prefix (docs/FORMAT.md, "The remote tier").
"""

from __future__ import annotations

import time
import uuid
from typing import NamedTuple

SETTINGS = "kvstore.json"
BLOCKS = "blocks/"
MANIFESTS = "manifests/"
MARKERS = "markers/"
EXACT = "exact/"
ACCESS = "access/"
LEASE = "gc/lease"


class Marker(NamedTuple):
    """A parsed depth marker: which entry, how long, whether it trims."""

    entry: bytes
    n_tokens: int
    trimmable: bool


def access_key(prefix: str) -> str:
    """A new access-times object: named by the time it is written, and a random suffix."""
    return f"{prefix}{ACCESS}{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:12]}"


def manifest_key(prefix: str, digest: bytes) -> str:
    return f"{prefix}{MANIFESTS}{digest.hex()}"


def marker_dir(prefix: str, chain_key: bytes) -> str:
    return f"{prefix}{MARKERS}{chain_key.hex()}/"


def marker_key(prefix: str, chain_key: bytes, entry: bytes, n_tokens: int, trim: bool) -> str:
    return f"{marker_dir(prefix, chain_key)}{entry.hex()}.{n_tokens}.{'t' if trim else 'x'}"


def exact_dir(prefix: str, exact_key: bytes) -> str:
    return f"{prefix}{EXACT}{exact_key.hex()}/"


def exact_marker(prefix: str, exact_key: bytes, entry: bytes, trim: bool) -> str:
    return f"{exact_dir(prefix, exact_key)}{entry.hex()}.{'t' if trim else 'x'}"


def parse_exact(key: str) -> tuple[bytes, bool] | None:
    """(entry, trimmable) of an ``exact/`` key, or None for a stray object."""
    name = key.rsplit("/", 1)[-1]
    head, _, flag = name.partition(".")
    entry = hex32(head)
    return None if entry is None or flag not in ("t", "x") else (entry, flag == "t")


def hex32(s: object) -> bytes | None:
    """The 32 bytes that ``s`` names in 64 lowercase hex characters (an entry or a block
    in an object's name or an access record), or None for anything else."""
    if not isinstance(s, str) or len(s) != 64:
        return None
    try:
        b = bytes.fromhex(s)
    except ValueError:
        return None
    return b if b.hex() == s else None


def parse_marker(key: str) -> Marker | None:
    """The marker a ``markers/`` key names, or None for a stray object."""
    name = key.rsplit("/", 1)[-1]
    parts = name.split(".")
    if len(parts) != 3 or parts[2] not in ("t", "x") or not parts[1].isdigit():
        return None
    entry = hex32(parts[0])
    return None if entry is None else Marker(entry, int(parts[1]), parts[2] == "t")


def entry_of_key(key: str) -> bytes | None:
    """The entry digest a marker, exact marker or manifest key ends in (None: a stray)."""
    name = key.rsplit("/", 1)[-1]
    return hex32(name.split(".", 1)[0])


