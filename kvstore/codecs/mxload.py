"""Bytes into MLX in one copy: a synthetic safetensors stream for ``mx.load``.

``mx.load`` accepts a file-like object and fills its own freshly allocated
arrays through ``readinto``. :class:`TensorStream` serves a small safetensors
header and then each tensor's bytes from :meth:`TensorStream.fill`, which a
subclass implements (from block files, from a v3 file…), straight into the
array's memory.

Two hazards are handled here, once. An exception must not cross into MLX's
C++ (it would abort the process): ``readinto`` records it, fills zeros, and
:func:`load_tensors` raises it after the load. And MLX drops its reader on a
worker thread, taking the GIL to release the Python object; if the
interpreter starts finalizing while that thread waits for the GIL, the thread
is torn down inside a C++ destructor and the process aborts ("terminate called
without an active exception"). So the stream is built inside
:func:`load_tensors` (the caller keeps no reference) and the load returns only
once the last reference is gone.
"""

from __future__ import annotations

import bisect
import io
import json
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO, cast

import mlx.core as mx

from .forksafe import mlx_guard
from .layout import SAFETENSORS_DTYPES, itemsize

_RELEASE_TIMEOUT = 5.0  # seconds; in practice the reader is gone in microseconds


class TensorStream(io.RawIOBase):
    """A read-only safetensors file: a header, then tensor ``i``'s bytes from ``fill``.

    ``tensors`` are (mlx dtype name, shape as allocated), in order.
    """

    def __init__(
        self, tensors: Sequence[tuple[str, Sequence[int]]], errors: list[BaseException]
    ) -> None:
        super().__init__()
        header: dict[str, object] = {}
        self._starts: list[int] = []
        offset = 0
        for i, (dtype, shape) in enumerate(tensors):
            n = itemsize(dtype)
            for d in shape:
                n *= d
            header[_name(i)] = {
                "dtype": SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + n],
            }
            self._starts.append(offset)
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._head = len(raw).to_bytes(8, "little") + raw
        self._data = offset
        self._size = len(self._head) + offset
        self._pos = 0
        self._errors = errors

    def fill(self, index: int, offset: int, out: memoryview) -> None:
        """Bytes ``[offset, offset + len(out))`` of tensor ``index`` into ``out``."""
        raise NotImplementedError

    def finish(self) -> None:
        """Complete what ``fill`` left for later; :func:`load_tensors` calls it once MLX
        has allocated every array (and holds them), before it returns them.

        A stream whose ``fill`` only notes where each tensor's bytes go can read every
        tensor here at once, over all its threads, instead of one tensor at a time as
        MLX asks for them. The default has nothing left to do.

        This relies on MLX handing ``readinto`` the array's own buffer (mlx 0.32's
        ``Load::eval_cpu`` reads straight into ``out.data``) and on nothing reading the
        arrays before this returns: only :func:`load_tensors` holds them until then.
        An MLX that read through a temporary buffer would break it, and every bit-exact
        restore test would fail. Nothing is read when ``mx.load`` raises, so no write
        can outlive an array MLX has already freed.
        """

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buf: Any) -> int:
        dst = memoryview(buf).cast("B")
        n = max(0, min(len(dst), self._size - self._pos))
        try:
            self._serve(dst[:n], self._pos)
        except BaseException as e:  # never let an error cross into MLX's C++
            if not self._errors:
                self._errors.append(e)
            dst[:n] = bytes(n)
        self._pos += n
        return n

    def _serve(self, dst: memoryview, pos: int) -> None:
        head = len(self._head)
        if pos < head:
            k = min(len(dst), head - pos)
            dst[:k] = self._head[pos : pos + k]
            dst, pos = dst[k:], pos + k
        while len(dst):
            rel = pos - head
            i = bisect.bisect_right(self._starts, rel) - 1
            end = self._starts[i + 1] if i + 1 < len(self._starts) else self._data
            k = min(len(dst), end - rel)
            self.fill(i, rel - self._starts[i], dst[:k])
            dst, pos = dst[k:], pos + k


def _name(i: int) -> str:
    return f"{i:06d}"


def load_tensors(make: Callable[[list[BaseException]], TensorStream], count: int) -> list[mx.array]:
    """The ``count`` tensors of the stream ``make(errors)`` builds, evaluated.

    Raises the first error ``fill`` raised; returns only once MLX let go of the
    stream (see the module docstring).
    """
    if count == 0:
        return []
    mlx_guard()
    errors: list[BaseException] = []
    released = threading.Event()
    stream = make(errors)
    ref = weakref.ref(stream, lambda _: released.set())
    try:
        # on the CPU stream, whatever the default device: its load reads straight into the
        # arrays' memory, which ``finish`` relies on (a GPU's load may stage the bytes
        # elsewhere: every verified restore failed its digests on MLX's CUDA backend)
        loaded = mx.load(cast(BinaryIO, stream), format="safetensors", stream=mx.cpu)
        assert isinstance(loaded, dict)
        arrays = [loaded[_name(i)] for i in range(count)]
        mx.eval(*arrays)
        stream.finish()  # the arrays are alive: their memory may now be written
    except Exception as e:
        if errors:  # what went wrong in fill, not MLX's view of it
            raise errors[0] from e
        raise
    finally:
        del stream
        if ref() is not None:  # MLX's thread still holds it: let it finish first
            released.wait(_RELEASE_TIMEOUT)
    if errors:
        raise errors[0]
    return arrays
