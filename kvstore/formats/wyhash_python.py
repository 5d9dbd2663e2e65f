"""Bun.hash in pure Python: the fallback of the C extension :mod:`kvstore._wyhash`.

A line-for-line port of ``kvstore/_wyhash.c`` (Zig's ``std.hash.Wyhash``, final v4),
with the same interface (``hash`` and the streaming ``Wyhash``), used when the
extension could not be built (no C compiler at install time: ``setup.py`` marks it
optional). It gives the same values (tests/codecs/test_bunhash.py runs mlx-bun's
vectors through both) at a fraction of the speed: the README says how much.
"""

from __future__ import annotations

import struct
from typing import Any

__all__ = ["Wyhash", "hash"]

_M64 = (1 << 64) - 1
_S0, _S1, _S2, _S3 = (0xA0761D6478BD642F, 0xE7037ED1A0B428DB, 0x8EBC6AF09C88C6E3,
                      0x589965CC75374CC3)
_CHUNK = 48 * 4096  # rounds unpack this many bytes' words at a time (bounded memory)


def _mix(a: int, b: int) -> int:
    x = a * b
    return (x & _M64) ^ (x >> 64)


def _bytes(data: Any) -> memoryview:
    """``data`` (any contiguous buffer: bytes, memoryview, an evaluated MLX array) as bytes."""
    view = memoryview(data)
    if not view.contiguous:
        raise BufferError("Bun.hash needs one contiguous buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _rd64(b: memoryview | bytes, i: int) -> int:
    return int.from_bytes(b[i:i + 8], "little")


def _rd32(b: memoryview | bytes, i: int) -> int:
    return int.from_bytes(b[i:i + 4], "little")


def _rounds(state: list[int], data: memoryview, start: int, end: int) -> int:
    """Rounds over whole 48-byte blocks of ``data[start:end]``, always leaving a non-empty
    tail (the last block goes through final1 even when full); the bytes consumed."""
    s0, s1, s2 = state
    i = start
    while i + 48 < end:
        n = min((end - i - 1) // 48, _CHUNK // 48)
        w = struct.unpack_from(f"<{6 * n}Q", data, i)
        for k in range(0, 6 * n, 6):
            x = (w[k] ^ _S1) * (w[k + 1] ^ s0)
            s0 = (x & _M64) ^ (x >> 64)
            x = (w[k + 2] ^ _S2) * (w[k + 3] ^ s1)
            s1 = (x & _M64) ^ (x >> 64)
            x = (w[k + 4] ^ _S3) * (w[k + 5] ^ s2)
            s2 = (x & _M64) ^ (x >> 64)
        i += 48 * n
    state[:] = [s0, s1, s2]
    return i - start


def _small_key(b: memoryview | bytes, n: int) -> tuple[int, int]:
    if n >= 4:
        end, quarter = n - 4, (n >> 3) << 2
        return ((_rd32(b, 0) << 32) | _rd32(b, quarter),
                (_rd32(b, end) << 32) | _rd32(b, end - quarter))
    if n > 0:
        return (b[0] << 16) | (b[n >> 1] << 8) | b[n - 1], 0
    return 0, 0


def _final1(s0: int, b: memoryview | bytes, lb_len: int, start: int) -> tuple[int, int, int]:
    """``b[0:lb_len]`` with ``lb_len >= 16``, the input proper from ``start``:
    ``(state0, a, b)``."""
    i, n = 0, lb_len - start
    while i + 16 < n:
        s0 = _mix(_rd64(b, start + i) ^ _S1, _rd64(b, start + i + 8) ^ s0)
        i += 16
    return s0, _rd64(b, lb_len - 16), _rd64(b, lb_len - 8)


def _final2(s0: int, a: int, b: int, total: int) -> int:
    x = (a ^ _S1) * (b ^ s0)
    a, b = x & _M64, x >> 64
    return _mix(a ^ _S0 ^ total, b ^ _S1)


def _seeded(seed: int) -> int:
    return seed ^ _mix(seed ^ _S0, _S1)


def hash(data: Any, seed: int = 0) -> int:  # noqa: A001 - the extension's name
    """The u64 Wyhash of ``data`` (Bun.hash with ``seed=0``)."""
    b = _bytes(data)
    n = len(b)
    s = _seeded(seed)
    if n <= 16:
        a, c = _small_key(b, n)
        return _final2(s, a, c, n)
    i = 0
    if n >= 48:
        state = [s, s, s]
        i = _rounds(state, b, 0, n)
        s = state[0] ^ state[1] ^ state[2]
    s, a, c = _final1(s, b, n, i)
    return _final2(s, a, c, n)


class Wyhash:
    """Streaming Wyhash: ``update`` piece by piece gives :func:`hash` of the whole."""

    __slots__ = ("_buf", "_buf_len", "_state", "total_len")

    def __init__(self, data: Any = None, seed: int = 0) -> None:
        s = _seeded(seed)
        self._state = [s, s, s]
        self._buf = bytearray(48)
        self._buf_len = 0
        self.total_len = 0
        if data is not None:
            self.update(data)

    def update(self, data: Any, /) -> None:
        b = _bytes(data)
        n = len(b)
        self.total_len += n
        if n <= 48 - self._buf_len:
            self._buf[self._buf_len:self._buf_len + n] = b
            self._buf_len += n
            return
        i = 0
        if self._buf_len > 0:
            i = 48 - self._buf_len
            self._buf[self._buf_len:48] = b[:i]
            w = struct.unpack("<6Q", self._buf)  # the buffered block, whole: one round
            st = self._state
            st[:] = [_mix(w[0] ^ _S1, w[1] ^ st[0]), _mix(w[2] ^ _S2, w[3] ^ st[1]),
                     _mix(w[4] ^ _S3, w[5] ^ st[2])]
            self._buf_len = 0
        i += _rounds(self._state, b, i, n)
        rem = n - i
        if rem < 16 and i >= 48:  # keep the bytes before the tail: final reads 16
            back = 16 - rem
            self._buf[48 - back:48] = b[i - back:i]
        self._buf[:rem] = b[i:]
        self._buf_len = rem

    def intdigest(self) -> int:
        buf, n = bytes(self._buf), self._buf_len
        if self.total_len <= 16:
            a, c = _small_key(buf, n)
            return _final2(self._state[0], a, c, self.total_len)
        s = self._state[0] ^ self._state[1] ^ self._state[2]
        if n < 16:
            rem = 16 - n
            s, a, c = _final1(s, buf[48 - rem:] + buf[:n], 16, rem)
        else:
            s, a, c = _final1(s, buf, n, 0)
        return _final2(s, a, c, self.total_len)

    def copy(self) -> Wyhash:
        other = Wyhash.__new__(Wyhash)
        other._state = list(self._state)
        other._buf = bytearray(self._buf)
        other._buf_len = self._buf_len
        other.total_len = self.total_len
        return other
