"""Digest types and the two hash algorithms a root may use."""

from __future__ import annotations

import hashlib
import re
from typing import NewType, Protocol

import blake3 as _blake3

from ..errors import InvalidDigestError, RootSettingsError

Digest = NewType("Digest", bytes)  # 32 raw bytes
HexDigest = NewType("HexDigest", str)  # 64 lowercase hex chars

ALGORITHMS = ("blake3", "sha256")
_HEX = re.compile(r"[0-9a-f]{64}")


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...
    def digest(self) -> bytes: ...


def new_hasher(algo: str) -> Hasher:
    """A fresh incremental hasher for ``algo`` (``blake3`` or ``sha256``)."""
    if algo == "blake3":
        return _blake3.blake3()
    if algo == "sha256":
        return hashlib.sha256()
    raise RootSettingsError(f"unknown hash algorithm {algo!r} (choose from {ALGORITHMS})")


def chain_hashes(algo: str, seed: bytes, data: memoryview, width: int, count: int) -> list[bytes]:
    """``[seed, H(seed || run_1), H(that || run_2), …]`` over ``count`` runs of ``width`` bytes.

    One hasher call per run and no per-run dispatch: a 32k-token chain is 128 runs.
    """
    new_hasher(algo)  # validates the name
    ctor = _blake3.blake3 if algo == "blake3" else hashlib.sha256
    keys = [seed]
    key = seed
    for k in range(count):
        h = ctor(key)
        h.update(data[k * width : (k + 1) * width])
        key = h.digest()
        keys.append(key)
    return keys


def hash_bytes(algo: str, *parts: bytes | memoryview) -> Digest:
    """The digest of the concatenation of ``parts``."""
    h = new_hasher(algo)
    for p in parts:
        h.update(p)
    return Digest(h.digest())


def to_hex(d: Digest) -> HexDigest:
    return HexDigest(d.hex())


def from_hex(s: str) -> Digest:
    """Parse a 64-char lowercase hex digest; anything else is an InvalidDigestError."""
    if not isinstance(s, str) or not _HEX.fullmatch(s):
        raise InvalidDigestError(f"not a digest (64 lowercase hex chars): {s!r}")
    return Digest(bytes.fromhex(s))


def check_digest(d: bytes) -> Digest:
    """Validate a raw digest (32 bytes) before any path is built from it."""
    if not isinstance(d, bytes) or len(d) != 32:
        raise InvalidDigestError(f"not a 32-byte digest: {d!r}")
    return Digest(d)
