"""Never a hit slower than a miss (issue 37): restore a stored prefix only when the
process predicts that restoring it is faster than computing it.

A hit costs a restore of ``k`` tokens; the miss it replaces costs their prefill. On
a fast disk and a big model the restore wins by orders of magnitude, but not always:
a short prefix on a small model, a cold disk or a slow remote can make the restore
the slower of the two (peers report full hits at 2-5x the recompute). So
:class:`Throughputs` keeps what this process measured, each exponentially averaged
(weight :data:`ALPHA` for the newest sample):

- restore bytes/s per tier (``local``, ``remote``): every restore the cache makes;
- a namespace's bytes per restored token (its model's KV size);
- prefill tokens/s: the time from a request's fetch to the snapshot at the end of its
  prompt (``kvstore serve`` hands the cache over there), over the tokens computed.

It is seeded conservatively: until it has measured a prefill, and a restore of the
namespace, it predicts nothing and the store is used as before. Then a restore of
``k`` tokens beyond what memory gave is predicted to take
``k * bytes_per_token / restore_bps + overhead``, the prefill ``k / prefill_tps``;
when the prefill is predicted faster, the request computes them instead, and its
miss reason is ``recompute_faster``. One such decision in :data:`PROBE_EVERY`
restores anyway, so a disk that was cold once is measured again.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass

ALPHA = 0.3  # weight of the newest sample in each average
PROBE_EVERY = 16  # of the decisions to recompute, one restores anyway (and is measured)
MIN_PREFILL_TOKENS = 16  # shorter prefills are mostly fixed costs: not a rate
RESTORE_OVERHEAD = 0.0  # seconds; a restore's fixed costs show in its measured rate


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new


@dataclass(frozen=True)
class Prediction:
    """What restoring ``tokens`` would cost against computing what it saves, in seconds."""

    tokens: int
    restore_s: float
    prefill_s: float

    @property
    def recompute(self) -> bool:
        return self.prefill_s < self.restore_s


class Throughputs:
    """The rates this process measured (module docstring); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.restore_bps: dict[str, float] = {}
        self.bytes_per_token: dict[Hashable, float] = {}
        self.prefill_tps: float | None = None
        self.copy_bps: float | None = None
        self._skipped = 0

    def note_restore(self, tier: str, namespace: Hashable, nbytes: int, tokens: int,
                     seconds: float) -> None:
        """A restore of ``tokens`` tokens (``nbytes`` of arrays) from ``tier`` took ``seconds``."""
        if nbytes <= 0 or tokens <= 0 or seconds <= 0:
            return
        with self._lock:
            self.restore_bps[tier] = _ema(self.restore_bps.get(tier), nbytes / seconds)
            self.bytes_per_token[namespace] = _ema(self.bytes_per_token.get(namespace),
                                                   nbytes / tokens)

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill of ``tokens`` tokens took ``seconds`` (short ones are not counted)."""
        if tokens < MIN_PREFILL_TOKENS or seconds <= 0:
            return
        with self._lock:
            self.prefill_tps = _ema(self.prefill_tps, tokens / seconds)

    def predict(self, tier: str, namespace: Hashable, restored: int,
                computed: int) -> Prediction | None:
        """A restore of ``restored`` tokens from ``tier`` vs the prefill of the ``computed``
        of them that nothing else gave; None until both rates have been measured."""
        with self._lock:
            bps = self.restore_bps.get(tier)
            bpt = self.bytes_per_token.get(namespace)
            tps = self.prefill_tps
        if bps is None or bpt is None or tps is None or restored <= 0:
            return None
        return Prediction(restored, RESTORE_OVERHEAD + restored * bpt / bps,
                          max(computed, 0) / tps)

    def note_copy(self, nbytes: int, seconds: float) -> None:
        """A copy of ``nbytes`` in memory (the device's) took ``seconds``."""
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            self.copy_bps = _ema(self.copy_bps, nbytes / seconds)

    def predict_copy(self, nbytes: int, computed: int) -> Prediction | None:
        """A memory hit that copies ``nbytes`` (the whole entry it comes from) vs the prefill
        of the ``computed`` tokens it would save; None until both rates are known."""
        with self._lock:
            bps, tps = self.copy_bps, self.prefill_tps
        if bps is None or tps is None or computed <= 0:
            return None
        return Prediction(computed, RESTORE_OVERHEAD + nbytes / bps, computed / tps)

    def skip(self) -> bool:
        """Whether a restore predicted slower is skipped (False one time in PROBE_EVERY)."""
        with self._lock:
            self._skipped += 1
            return self._skipped % PROBE_EVERY != 0


def measure_copy(nbytes: int, *, cap: int = 64 << 20) -> tuple[int, float]:
    """(bytes, seconds) of one copy of ``min(nbytes, cap)`` bytes on MLX's default device:
    what a memory hit pays a byte, measured once a process."""
    import time

    import mlx.core as mx

    n = max(1 << 20, min(nbytes, cap))
    a = mx.zeros((n,), dtype=mx.uint8)
    mx.eval(a)
    t = time.perf_counter()
    b = a + 1  # a new buffer, every byte read and written
    mx.eval(b)
    return n, time.perf_counter() - t


def cache_nbytes(cache: list[object]) -> int:
    """Bytes of a restored cache's arrays (mlx-lm's ``nbytes`` of each layer)."""
    total = 0
    for c in cache:
        n = getattr(c, "nbytes", 0)
        total += n if isinstance(n, int) else 0
    return total
