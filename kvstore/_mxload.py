"""``mx.load`` of a Python file-like object, made safe to exit right after.

MLX reads a file-like object from its own worker thread and, once the load is
done, drops its reader there too, which takes the GIL to release the Python
object. If the interpreter starts finalizing while that thread still waits for
the GIL, the thread is torn down inside a C++ destructor and the process
aborts ("terminate called without an active exception"). So the caller keeps
no reference to the stream and waits until the last one is gone: after that,
MLX holds nothing that needs the GIL.
"""

from __future__ import annotations

import io
import threading
import weakref
from typing import BinaryIO, cast

import mlx.core as mx

_RELEASE_TIMEOUT = 5.0  # seconds; in practice the reader is gone in microseconds


def load_safetensors(stream: io.RawIOBase) -> dict[str, mx.array]:
    """``mx.load(stream, format="safetensors")`` that returns only once MLX let go of it.

    The caller must hold no other reference to ``stream`` (pass it as a
    temporary); the arrays come back evaluated.
    """
    released = threading.Event()
    ref = weakref.ref(stream, lambda _: released.set())
    try:
        loaded = mx.load(cast(BinaryIO, stream), format="safetensors")
        assert isinstance(loaded, dict)
        mx.eval(*loaded.values())
    finally:
        del stream
        if ref() is not None:  # MLX's thread still holds it: let it finish first
            released.wait(_RELEASE_TIMEOUT)
    return loaded
