"""The errors of the remote tier: a request that failed names the bucket, the key and the
HTTP status."""

from __future__ import annotations

from ..errors import KVStoreError


class RemoteError(KVStoreError, OSError):
    """An object-store request failed; the message names the bucket, the key and the status."""

    def __init__(
        self, message: str, *, bucket: str = "", key: str = "", status: int | None = None
    ) -> None:
        where = f"s3://{bucket}/{key}" if bucket else key
        status_s = f" (HTTP {status})" if status is not None else ""
        super().__init__(f"{where}: {message}{status_s}" if where else f"{message}{status_s}")
        self.bucket = bucket
        self.key = key
        self.status = status


class RemoteUnavailableError(RemoteError, ConnectionError):
    """The object store could not be reached, or kept failing after the retries."""


class RemoteAuthError(RemoteError, PermissionError):
    """The object store refused the credentials (HTTP 403, or a bad signature)."""


class RemoteNotFoundError(RemoteError, FileNotFoundError):
    """The bucket (or a required object) does not exist on the object store."""


class RemoteTooLargeError(RemoteError):
    """An object is larger than what its kind may be: refused before its body is read."""

    def __init__(self, message: str, *, size: int, limit: int, bucket: str = "",
                 key: str = "") -> None:
        super().__init__(message, bucket=bucket, key=key)
        self.size = size
        self.limit = limit


class RemoteURLError(KVStoreError, ValueError):
    """A remote URL is not of the form ``s3://BUCKET[/PREFIX]``."""


class RemoteLeaseError(RemoteError):
    """The remote's GC lease is held by another compactor, or was lost during a compaction."""
