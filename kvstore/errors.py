"""Every error kvstore raises derives from :class:`KVStoreError`.

Subclasses also inherit the builtin that fits, so ``except KeyError`` and
``except ValueError`` keep working for callers that do not know kvstore.
"""

from __future__ import annotations

from typing import Any


class KVStoreError(Exception):
    """Root of every error raised by kvstore."""


# --- roots -------------------------------------------------------------------


class NotAStoreError(KVStoreError, FileNotFoundError):
    """The path is not a kvstore root (or does not exist)."""


class RootSettingsError(KVStoreError, ValueError):
    """A root was opened with settings (hash, block size) other than its own."""


class UnsupportedFilesystemError(KVStoreError, OSError):
    """The root lies on a filesystem where LMDB locking is unsafe (NFS, CIFS)."""


class ReadOnlyStoreError(KVStoreError, PermissionError):
    """A write was attempted on a root that cannot be written."""


class UnsafeRootError(KVStoreError, OSError):
    """One of the root's own directories is a symlink or not a directory.

    kvstore never follows such a path: a sweep through it could delete, or a
    repair move, files outside the root.
    """


class IndexLockLostError(KVStoreError, RuntimeError):
    """``index/lock.mdb`` was deleted or replaced while this process had the index open.

    Writing through the old lock would corrupt the index, so this process refuses
    to write until every store of the root in it is closed and opened again.
    """


class ForkedProcessError(KVStoreError, RuntimeError):
    """MLX was used by kvstore on this thread before a ``fork``: it would hang here."""


class StoreFullError(KVStoreError, OSError):
    """The disk or the index map is full; nothing partial was made visible."""


class IndexStoreError(KVStoreError):
    """An LMDB operation failed (wraps :class:`lmdb.Error`)."""


# --- input -------------------------------------------------------------------


class NamespaceRequiredError(KVStoreError, ValueError):
    """A call had no namespace: neither its own nor the store's default."""


class InvalidNamespaceError(KVStoreError, TypeError):
    """A :class:`~kvstore.Namespace` field is not a str."""


class InvalidTokensError(KVStoreError, ValueError):
    """Tokens must be a sequence of non-negative ints below 2**32 - 1 (bools are not)."""


class CacheMismatchError(KVStoreError, ValueError):
    """The cache list is empty, or disagrees with the tokens or with itself."""


class SizeError(KVStoreError, ValueError):
    """A byte count that cannot be parsed (``10G``, ``500MiB``…)."""


class UnsupportedDtypeError(KVStoreError, TypeError):
    """A tensor's dtype is one kvstore could not restore (float64, complex64)."""


class UnknownCacheTypeError(KVStoreError, TypeError):
    """No codec handles this cache class."""

    def __init__(self, cls_name: str) -> None:
        super().__init__(f"no codec for cache class {cls_name!r}")
        self.cls_name = cls_name


class UnknownKindError(KVStoreError, KeyError):
    """A manifest names a layer kind that no codec is registered for."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown kind"


class InvalidDigestError(KVStoreError, ValueError):
    """A digest is not 64 lowercase hex characters (or 32 raw bytes)."""


# --- blocks and entries ------------------------------------------------------


class BlockNotFoundError(KVStoreError, KeyError):
    """A block file is missing (evicted, or never written)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "block not found"


class CorruptBlockError(KVStoreError, ValueError):
    """A block's bytes do not match its digest or its expected size (or its file is
    not a regular file). ``digest`` is the block's name (hex) when known."""

    def __init__(self, path: str, expected: str, actual: str, *, digest: str = "") -> None:
        super().__init__(f"{path}: expected {expected}, got {actual}")
        self.path = path
        self.expected = expected
        self.actual = actual
        self.digest = digest

    def __reduce__(self) -> tuple[Any, ...]:
        return (_corrupt_block, (self.path, self.expected, self.actual, self.digest))


def _corrupt_block(path: str, expected: str, actual: str, digest: str) -> CorruptBlockError:
    return CorruptBlockError(path, expected, actual, digest=digest)


class EntryNotFoundError(KVStoreError, KeyError):
    """No entry has this id (or the id prefix is ambiguous)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "entry not found"


class ManifestError(KVStoreError, ValueError):
    """A manifest could not be decoded or is inconsistent."""


class ShortReadError(KVStoreError, EOFError):
    """A positioned read ended at the end of the file before filling its buffers.

    ``offset`` is where the read began, ``want`` the bytes asked for, ``got``
    the bytes read before the end of the file.
    """

    def __init__(self, fd: int, offset: int, want: int, got: int) -> None:
        super().__init__(
            f"fd {fd}: {got} of {want} bytes read at offset {offset}: the file ends at "
            f"byte {offset + got}"
        )
        self.fd, self.offset, self.want, self.got = fd, offset, want, got


# --- files (mlx-bun v3/v4/v5) ------------------------------------------------


class FileFormatError(KVStoreError, ValueError):
    """A cache file is malformed; the message names the file and the problem."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class LayerError(KVStoreError, ValueError):
    """An mlx-bun layer entry that cannot be loaded; the caller adds the file name."""


class BadMagicError(FileFormatError):
    """The file does not start with mlx-bun's magic ``MLXBUNKV2\\n``."""


class TruncatedFileError(FileFormatError):
    """The file ends before its prefix, its header or one of its tensors does."""


class HeaderHashMismatchError(FileFormatError):
    """The JSON header's Bun.hash differs from the one in the file's prefix."""


class UnsupportedVersionError(FileFormatError):
    """The header's ``formatVersion`` is not one kvstore reads (3, 4, 5)."""


class CodecProviderMismatchError(FileFormatError):
    """The header's ``codecProvider`` is not ``mlx-cache-v3``."""


class NamespaceMismatchError(FileFormatError):
    """The file belongs to another model, config, tokenizer or namespace."""


class TensorOutOfBoundsError(FileFormatError):
    """A tensor's byte range lies outside the file's data region."""


class TensorShapeMismatchError(FileFormatError):
    """A tensor's byte count disagrees with its shape and dtype (or its layer)."""


class TensorHashMismatchError(FileFormatError):
    """A tensor's (or a v5 block's) bytes do not match the hash the header lists."""

    def __init__(self, path: str, reason: str, expected: str = "", actual: str = "") -> None:
        super().__init__(path, reason)
        self.expected = expected
        self.actual = actual


class BlockReferenceError(FileFormatError):
    """A v5 tensor names a block that is malformed, missing or of the wrong size."""


class CorruptFileBlockError(TensorHashMismatchError, CorruptBlockError):
    """A v5 file's block does not hash to its name (also a :class:`CorruptBlockError`).

    ``path`` is the v5 file, ``block_path`` the block file, ``digest`` its name.
    """

    def __init__(self, path: str, reason: str, expected: str, actual: str, *,
                 block_path: str) -> None:
        Exception.__init__(self, f"{path}: {reason}")  # both bases' messages in one
        self.path, self.reason = path, reason
        self.expected, self.actual = expected, actual
        self.digest = expected
        self.block_path = block_path

    def __reduce__(self) -> tuple[Any, ...]:
        return (_corrupt_file_block,
                (self.path, self.reason, self.expected, self.actual, self.block_path))


def _corrupt_file_block(
    path: str, reason: str, expected: str, actual: str, block_path: str
) -> CorruptFileBlockError:
    return CorruptFileBlockError(path, reason, expected, actual, block_path=block_path)


# --- files: header fields and bounds (mlx-bun's reader, mirrored) -------------


class MalformedHeaderError(FileFormatError):
    """The JSON header is not UTF-8 JSON (or is nested too deeply, or is not an object)."""


class HeaderFieldError(FileFormatError):
    """A header field has the wrong type or range, or disagrees with another field."""


class TensorShapeError(TensorShapeMismatchError):
    """A shape MLX cannot hold exactly: over 64 dims, a dim >= 2**31, zero-size with 2+ dims."""


class TensorOverlapError(FileFormatError):
    """Two tensors of a v3/v4 file claim overlapping byte ranges."""


class AllocationBoundError(FileFormatError):
    """Restoring the file would allocate more than its stored bytes plus the stated margin."""


class BlockFileTypeError(BlockReferenceError):
    """A v5 block is not a regular file (a symlink, a FIFO, a directory, …)."""


# --- the remote tier (S3-compatible object storage) --------------------------


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


class RemoteURLError(KVStoreError, ValueError):
    """A remote URL is not of the form ``s3://BUCKET[/PREFIX]``."""


class RemoteLeaseError(RemoteError):
    """The remote's GC lease is held by another compactor, or was lost during a compaction."""
