"""`PersistStats`: the counters of `PersistentPromptCache`'s disk tier, and its exit line."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PersistStats"]


@dataclass(frozen=True)
class PersistStats:
    """Counters of the disk tier (a snapshot; all counts since construction)."""

    pending: int
    pending_bytes: int
    saved: int
    dropped: int
    failed: int
    skipped: int
    bytes_written: int
    logical_bytes_saved: int
    memory_hits: int
    store_hits: int
    misses: int
    tokens_from_store: int
    deferred: int = 0  # snapshots waiting in memory (see kvstore.mlx_lm.writebehind)
    deferred_bytes: int = 0
    superseded: int = 0  # deferred snapshots replaced by a later one of their conversation
    kv_bytes_added: int = 0  # the saves' logical bytes beyond what the root held before each
    recomputed: int = 0  # store hits computed instead: predicted faster (miss recompute_faster)

    @property
    def write_amplification(self) -> float | None:
        """Bytes written over the KV bytes they added to the root (None before a save)."""
        return self.bytes_written / self.kv_bytes_added if self.kv_bytes_added else None

    def summary(self) -> str:
        """One line for a log: ``saved 3 entries (… new of …), 5 hits (…), …``."""
        text = (
            f"saved {self.saved} {'entry' if self.saved == 1 else 'entries'} "
            f"({_mib(self.bytes_written)} new of {_mib(self.logical_bytes_saved)}); "
            f"{self.store_hits} {'hit' if self.store_hits == 1 else 'hits'} from the store "
            f"({self.tokens_from_store:,} tokens), {self.memory_hits} from memory, "
            f"{self.misses} {'miss' if self.misses == 1 else 'misses'}"
        )
        lost = [
            f"{n} {what}"
            for n, what in (
                (self.pending, "not written"),
                (self.dropped, "dropped"),
                (self.failed, "failed"),
            )
            if n
        ]
        return text + (f"; snapshots {', '.join(lost)}" if lost else "")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
