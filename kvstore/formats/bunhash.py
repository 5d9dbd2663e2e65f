"""Bun.hash: Zig's ``std.hash.Wyhash`` with seed 0, as mlx-bun's v3 files use it.

The work is done by the C extension :mod:`kvstore._wyhash` (it releases the GIL
on large buffers); where it could not be built (no C compiler at install time:
``setup.py`` marks it optional), by its pure-Python port
(:mod:`kvstore.formats.wyhash_python`: the same values, about 16 MB/s against the
extension's GB/s). ``IMPLEMENTATION`` says which. Inputs are any contiguous buffer:
``bytes``, ``bytearray``, ``memoryview``, or an evaluated MLX array (through its
buffer protocol).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol, TypeAlias

try:
    from .. import _wyhash
except ImportError:  # built without a C compiler: the pure-Python port, same values
    from . import wyhash_python as _wyhash  # type: ignore[no-redef]

if TYPE_CHECKING:
    import mlx.core as mx

__all__ = ["IMPLEMENTATION", "Buffer", "BunHasher", "bun_hash", "bun_hash_hex", "hex64"]

#: "C" (the extension) or "python" (the fallback).
IMPLEMENTATION = "python" if _wyhash.__name__.endswith("_python") else "C"


class _Buffer(Protocol):
    def __buffer__(self, flags: int, /) -> memoryview: ...


Buffer: TypeAlias = "_Buffer | bytes | bytearray | memoryview | mx.array"


def hex64(value: int) -> str:
    """A u64 as mlx-bun writes it: 16 lowercase hex chars, zero-padded."""
    return f"{value:016x}"


def bun_hash(data: Buffer) -> int:
    """The u64 Bun.hash of ``data`` (one contiguous buffer)."""
    return int(_wyhash.hash(data))


def bun_hash_hex(data: Buffer) -> str:
    """Bun.hash of ``data`` as 16 lowercase hex chars."""
    return hex64(_wyhash.hash(data))


class BunHasher:
    """Streaming Bun.hash: ``update`` piece by piece, same value as one call.

    >>> h = BunHasher(); h.update(b"ab"); h.update(b"c"); h.hexdigest() == bun_hash_hex(b"abc")
    True
    """

    __slots__ = ("_state",)

    def __init__(self, data: Buffer | None = None) -> None:
        self._state = _wyhash.Wyhash(data)

    def update(self, data: Buffer) -> None:
        """Feed the next piece (any contiguous buffer)."""
        self._state.update(data)

    def intdigest(self) -> int:
        """The u64 hash of everything fed so far; the hasher stays usable."""
        return int(self._state.intdigest())

    def hexdigest(self) -> str:
        """:meth:`intdigest` as 16 lowercase hex chars."""
        return hex64(self._state.intdigest())

    def copy(self) -> BunHasher:
        """An independent hasher with the same state."""
        other = BunHasher.__new__(BunHasher)
        other._state = self._state.copy()
        return other

    @property
    def total_len(self) -> int:
        """Bytes fed so far."""
        return int(self._state.total_len)


def bun_hash_pieces_hex(pieces: Iterable[Buffer]) -> str:
    """Bun.hash of the concatenation of ``pieces`` (16 hex chars), without joining them."""
    h = BunHasher()
    for p in pieces:
        h.update(p)
    return h.hexdigest()
