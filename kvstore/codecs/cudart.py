"""The few CUDA runtime calls a restore onto an NVIDIA GPU makes, through ``ctypes``.

MLX's CUDA backend gives Python no device pointer, but the arrays it makes on the CPU
stream are CUDA managed memory (``cudaMallocManaged``), whose address is the same on the
host and on the device. A restore fills those arrays with the card's copy engines from
pinned host memory (:mod:`kvstore.codecs.staging`), after moving their pages to the card
(``cudaMemPrefetchAsync``), so the first kernel that reads them finds them there instead
of pulling every page across as a demand fault.

Only the runtime that MLX itself loaded is used (``libcudart.so.13`` for the
``mlx-cuda-13`` wheel, ``.12`` for ``mlx-cuda-12``): ``dlopen`` of its name returns the
library already in the process, so both share one CUDA context. Nothing here runs unless
MLX's default device is a CUDA GPU; on a CPU and on Apple silicon this module is never
loaded by a restore.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from dataclasses import dataclass

from ..errors import KVStoreError

__all__ = ["CudaError", "Runtime", "runtime"]

_NAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")
_HOST_TO_DEVICE = 1
_DEFAULT_KIND = 4  # cudaMemcpyDefault: the pointers say where each side lives
_STREAM_NON_BLOCKING = 1
_EVENT_DISABLE_TIMING = 2
_ATTR_CONCURRENT_MANAGED = 89  # cudaDevAttrConcurrentManagedAccess
_MEMORY_MANAGED = 3  # cudaMemoryTypeManaged
_LOCATION_DEVICE = 1  # cudaMemLocationTypeDevice
_NOT_READY = 600  # cudaErrorNotReady (an event not yet reached)


class CudaError(KVStoreError, RuntimeError):
    """A CUDA runtime call failed: ``call`` names it, ``code`` is its ``cudaError_t``."""

    def __init__(self, call: str, code: int, text: str) -> None:
        super().__init__(f"{call} failed: CUDA error {code} ({text})")
        self.call, self.code = call, code


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _PointerAttributes(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int),
                ("devicePointer", ctypes.c_void_p), ("hostPointer", ctypes.c_void_p),
                ("reserved", ctypes.c_byte * 256)]  # room for fields later runtimes add


_P = ctypes.c_void_p
_N = ctypes.c_size_t
_SIGNATURES: dict[str, list[type]] = {
    "cudaGetErrorString": [ctypes.c_int],
    "cudaRuntimeGetVersion": [ctypes.POINTER(ctypes.c_int)],
    "cudaGetDevice": [ctypes.POINTER(ctypes.c_int)],
    "cudaDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
    "cudaPointerGetAttributes": [ctypes.POINTER(_PointerAttributes), _P],
    "cudaHostAlloc": [ctypes.POINTER(_P), _N, ctypes.c_uint],
    "cudaFreeHost": [_P],
    "cudaMalloc": [ctypes.POINTER(_P), _N],
    "cudaFree": [_P],
    "cudaStreamCreateWithFlags": [ctypes.POINTER(_P), ctypes.c_uint],
    "cudaStreamSynchronize": [_P],
    "cudaStreamDestroy": [_P],
    "cudaEventCreateWithFlags": [ctypes.POINTER(_P), ctypes.c_uint],
    "cudaEventRecord": [_P, _P],
    "cudaEventSynchronize": [_P],
    "cudaEventQuery": [_P],
    "cudaEventDestroy": [_P],
    "cudaMemcpyAsync": [_P, _P, _N, ctypes.c_int, _P],
    "cudaMemcpy2DAsync": [_P, _N, _P, _N, _N, _N, ctypes.c_int, _P],
    "cudaMemsetAsync": [_P, ctypes.c_int, _N, _P],
    "cudaMemset2DAsync": [_P, _N, ctypes.c_int, _N, _N, _P],
}


@dataclass(frozen=True)
class DeviceInfo:
    """What a restore needs to know of the card: its ordinal and whether the host and the
    card may use managed memory at once (without it MLX's arrays are pinned host memory,
    and there is nothing to copy)."""

    device: int
    concurrent_managed: bool
    version: int  # cudaRuntimeGetVersion: 13000 for CUDA 13.0


class Runtime:
    """The loaded CUDA runtime: each method one call, its error raised as :class:`CudaError`.

    ``ctypes`` releases the GIL around every call, so the read threads issue their copies
    in parallel and a wait blocks only its own thread.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        for name, args in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = ctypes.c_char_p if name == "cudaGetErrorString" else ctypes.c_int
        v = ctypes.c_int()
        self._check("cudaRuntimeGetVersion", lib.cudaRuntimeGetVersion(ctypes.byref(v)))
        self.version = v.value
        self._prefetch = lib.cudaMemPrefetchAsync
        self._prefetch.restype = ctypes.c_int
        if self.version >= 13000:  # the location form (CUDA 13 removed the device form)
            self._prefetch.argtypes = [_P, _N, _Location, ctypes.c_uint, _P]
        else:
            self._prefetch.argtypes = [_P, _N, ctypes.c_int, _P]

    def _check(self, call: str, code: int) -> None:
        if code:
            text = self._lib.cudaGetErrorString(code)
            raise CudaError(call, code, text.decode("ascii", "replace") if text else "?")

    # --- the device ---------------------------------------------------------------------

    def device_info(self) -> DeviceInfo:
        dev, val = ctypes.c_int(), ctypes.c_int()
        self._check("cudaGetDevice", self._lib.cudaGetDevice(ctypes.byref(dev)))
        self._check("cudaDeviceGetAttribute", self._lib.cudaDeviceGetAttribute(
            ctypes.byref(val), _ATTR_CONCURRENT_MANAGED, dev.value))
        return DeviceInfo(dev.value, bool(val.value), self.version)

    def is_managed(self, ptr: int) -> bool:
        """Whether ``ptr`` is CUDA managed memory (what MLX's CPU-stream arrays are)."""
        attrs = _PointerAttributes()
        self._check("cudaPointerGetAttributes",
                    self._lib.cudaPointerGetAttributes(ctypes.byref(attrs), ptr))
        return int(attrs.type) == _MEMORY_MANAGED

    # --- memory ----------------------------------------------------------------------------

    def host_alloc(self, nbytes: int) -> int:
        """Pinned (page-locked) host memory: the copy engines read it at the link's speed."""
        p = _P()
        self._check("cudaHostAlloc", self._lib.cudaHostAlloc(ctypes.byref(p), nbytes, 0))
        assert p.value is not None
        return p.value

    def free_host(self, ptr: int) -> None:
        self._check("cudaFreeHost", self._lib.cudaFreeHost(ptr))

    def malloc(self, nbytes: int) -> int:
        """Plain device memory (the bench's limit rows copy into it)."""
        p = _P()
        self._check("cudaMalloc", self._lib.cudaMalloc(ctypes.byref(p), nbytes))
        assert p.value is not None
        return p.value

    def free(self, ptr: int) -> None:
        self._check("cudaFree", self._lib.cudaFree(ptr))

    # --- streams and events -------------------------------------------------------------

    def stream(self) -> int:
        s = _P()
        self._check("cudaStreamCreateWithFlags",
                    self._lib.cudaStreamCreateWithFlags(ctypes.byref(s), _STREAM_NON_BLOCKING))
        return s.value or 0

    def sync_stream(self, stream: int) -> None:
        self._check("cudaStreamSynchronize", self._lib.cudaStreamSynchronize(stream))

    def destroy_stream(self, stream: int) -> None:
        self._check("cudaStreamDestroy", self._lib.cudaStreamDestroy(stream))

    def event(self) -> int:
        e = _P()
        self._check("cudaEventCreateWithFlags",
                    self._lib.cudaEventCreateWithFlags(ctypes.byref(e), _EVENT_DISABLE_TIMING))
        return e.value or 0

    def record(self, event: int, stream: int) -> None:
        self._check("cudaEventRecord", self._lib.cudaEventRecord(event, stream))

    def wait_event(self, event: int) -> None:
        self._check("cudaEventSynchronize", self._lib.cudaEventSynchronize(event))

    def event_done(self, event: int) -> bool:
        code = self._lib.cudaEventQuery(event)
        if code == _NOT_READY:
            return False
        self._check("cudaEventQuery", code)
        return True

    def destroy_event(self, event: int) -> None:
        self._check("cudaEventDestroy", self._lib.cudaEventDestroy(event))

    # --- copies -------------------------------------------------------------------------

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """``nbytes`` from ``src`` to ``dst``, queued on ``stream``."""
        self._check("cudaMemcpyAsync",
                    self._lib.cudaMemcpyAsync(dst, src, nbytes, _DEFAULT_KIND, stream))

    def copy_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int,
                stream: int) -> None:
        """``height`` rows of ``width`` bytes, ``spitch`` apart at ``src``, ``dpitch`` at
        ``dst``."""
        self._check("cudaMemcpy2DAsync", self._lib.cudaMemcpy2DAsync(
            dst, dpitch, src, spitch, width, height, _DEFAULT_KIND, stream))

    def zero_2d(self, dst: int, pitch: int, width: int, height: int, stream: int) -> None:
        if height == 1 or pitch == width:
            self._check("cudaMemsetAsync",
                        self._lib.cudaMemsetAsync(dst, 0, width * height, stream))
            return
        self._check("cudaMemset2DAsync",
                    self._lib.cudaMemset2DAsync(dst, pitch, 0, width, height, stream))

    def prefetch(self, ptr: int, nbytes: int, device: int, stream: int) -> None:
        """Move the pages of managed memory ``[ptr, ptr + nbytes)`` to ``device``."""
        if self.version >= 13000:
            code = self._prefetch(ptr, nbytes, _Location(_LOCATION_DEVICE, device), 0, stream)
        else:
            code = self._prefetch(ptr, nbytes, device, stream)
        self._check("cudaMemPrefetchAsync", code)


_LOCK = threading.Lock()
_LOADED: dict[str, Runtime | None] = {}


def _candidates() -> list[str]:
    """The runtime's names: MLX's own, already in the process when MLX links it (``dlopen``
    of its name returns it), then the copies pip's ``nvidia-cuda-runtime`` wheels install."""
    out = list(_NAMES)
    for base in sys.path:
        for sub, name in (("cu13", "libcudart.so.13"), ("cuda_runtime", "libcudart.so.12")):
            p = os.path.join(base or ".", "nvidia", sub, "lib", name)
            if os.path.exists(p):
                out.append(p)
    return out


def _load() -> Runtime | None:
    for name in _candidates():
        try:
            return Runtime(ctypes.CDLL(name))
        except (OSError, AttributeError, CudaError):
            continue
    return None


def runtime() -> Runtime | None:
    """The CUDA runtime MLX loaded, once per process; None where there is none."""
    with _LOCK:
        if "rt" not in _LOADED:
            _LOADED["rt"] = _load()
        return _LOADED["rt"]
