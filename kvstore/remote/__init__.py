"""The remote tier: a bucket on S3-compatible object storage that many local roots share.

``Store.open(root, remote="s3://BUCKET/PREFIX")`` attaches one; ``store.remote`` is
the :class:`Remote`, a :class:`~kvstore.catalog.base.Tier` (compaction, verification,
stats, listing). The protocol and the
argument for its safety are in docs/FORMAT.md ("The remote tier").
"""

from __future__ import annotations

from ..catalog.base import PushStats
from .gc import DEFAULT_GRACE, RemoteCompactReport, compact
from .lease import DEFAULT_LEASE, DEFAULT_MARGIN
from .tier import DEFAULT_TIMEOUT, RemoteEntry, RemoteStats, RemoteTier
from .verify import RemoteVerifyReport, verify


class Remote(RemoteTier):
    """:class:`RemoteTier` with its maintenance: compact and verify (under the GC lease)."""

    def compact(self, *, max_bytes: int | None = None, grace: float | None = None,
                dry_run: bool = False) -> RemoteCompactReport:
        """Evict least-recently-used entries above ``max_bytes`` (None: no budget), then
        delete blocks no manifest references that are older than ``grace`` seconds."""
        return compact(self, max_bytes=max_bytes,
                       grace=DEFAULT_GRACE if grace is None else grace, dry_run=dry_run)

    def verify(self, *, read_data: bool = False, repair: bool = False, dry_run: bool = False
               ) -> RemoteVerifyReport:
        """Check the remote (``read_data``: every block's bytes); ``repair`` drops what is bad."""
        return verify(self, read_data=read_data, repair=repair, dry_run=dry_run)


__all__ = [
    "DEFAULT_GRACE",
    "DEFAULT_LEASE",
    "DEFAULT_MARGIN",
    "DEFAULT_TIMEOUT",
    "PushStats",
    "Remote",
    "RemoteCompactReport",
    "RemoteEntry",
    "RemoteStats",
    "RemoteVerifyReport",
]
