"""The root of every error kvstore raises, :class:`KVStoreError`, and the errors that
several packages raise or that ``kvstore`` exports (so that ``import kvstore`` names them
without loading the package that raises them).

An error only one package raises lives next to the code that raises it:
``kvstore.formats.errors`` (mlx-bun files), ``kvstore.remote.errors`` (the bucket),
``kvstore.index.errors`` (LMDB), ``kvstore.codecs.errors``, ``kvstore.store.errors``;
``kvstore._vio.ShortReadError`` and ``kvstore._human.SizeError`` in their modules.
Subclasses also inherit the builtin that fits, so ``except KeyError`` and
``except ValueError`` keep working for callers that do not know kvstore.
"""

from __future__ import annotations

from typing import Any


class KVStoreError(Exception):
    """Root of every error raised by kvstore."""


# --- roots -------------------------------------------------------------------


class NotAStoreError(KVStoreError, FileNotFoundError):
    """The path is not a kvstore root (or does not exist); ``command``, when set, is the
    ``kvstore`` command that makes it one (``init``), for the command line to spell with
    the ``--root`` its user gave."""

    def __init__(self, message: str, *, command: str | None = None) -> None:
        super().__init__(message + (f"; run kvstore {command}" if command else ""))
        self.message = message
        self.command = command


class RootSettingsError(KVStoreError, ValueError):
    """A root was opened with settings (hash, block size) other than its own."""


class ReadOnlyStoreError(KVStoreError, PermissionError):
    """A write was attempted on a root that cannot be written."""


class UnsafeRootError(KVStoreError, OSError):
    """One of the root's own directories is a symlink or not a directory.

    kvstore never follows such a path: a sweep through it could delete, or a
    repair move, files outside the root.
    """


class RootPermissionError(KVStoreError, PermissionError):
    """A change in one of the root's directories was refused: which directory, whose, its
    mode and the fix are in the message (a shared root's directory without the group's
    write bit)."""


class IndexLockLostError(KVStoreError, RuntimeError):
    """``index/lock.mdb`` was deleted or replaced while this process had the index open.

    Writing through the old lock would corrupt the index, so this process refuses
    to write until every store of the root in it is closed and opened again.
    """


class ForkedProcessError(KVStoreError, RuntimeError):
    """MLX was used by kvstore on this thread before a ``fork``: it would hang here."""


class StoreFullError(KVStoreError, OSError):
    """The disk or the index map is full; nothing partial was made visible."""


# --- input -------------------------------------------------------------------


class NamespaceRequiredError(KVStoreError, ValueError):
    """A call had no namespace: neither its own nor the store's default."""


class InvalidNamespaceError(KVStoreError, TypeError):
    """A :class:`~kvstore.Namespace` field is not a str."""


class InvalidTokensError(KVStoreError, ValueError):
    """Tokens must be a sequence of non-negative ints below 2**32 - 1 (bools are not)."""


class CacheMismatchError(KVStoreError, ValueError):
    """The cache list is empty, or disagrees with the tokens or with itself."""


class UnsupportedDtypeError(KVStoreError, TypeError):
    """A tensor's dtype is one kvstore could not restore (float64, complex64)."""


class UnknownCacheTypeError(KVStoreError, TypeError):
    """No codec handles this cache class."""

    def __init__(self, cls_name: str) -> None:
        super().__init__(f"no codec for cache class {cls_name!r}")
        self.cls_name = cls_name


class InvalidDigestError(KVStoreError, ValueError):
    """A digest is not 64 lowercase hex characters (or 32 raw bytes)."""


# --- blocks and entries ------------------------------------------------------


class BlockNotFoundError(KVStoreError, KeyError):
    """A block file is missing (evicted, or never written)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "block not found"


class DigestMismatchError(KVStoreError, ValueError):
    """Bytes do not hash to the digest that names them (a block, a manifest, a file's tensor).

    ``where`` they were read (a path, a URL), the ``expected`` digest and the one they
    ``got`` (hex). The one error for this meaning: a stored block's is a
    :class:`CorruptBlockError`, a file's a ``formats.errors.FileDigestMismatchError``.
    """

    def __init__(self, where: str, expected: str, got: str) -> None:
        super().__init__(f"{where}: expected {expected}, got {got}")
        self.where = where
        self.expected = expected
        self.got = got

    @property
    def actual(self) -> str:
        """``got``, by its older name."""
        return self.got

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.where, self.expected, self.got))


class CorruptBlockError(DigestMismatchError):
    """A stored block is not the bytes its name says: they hash to another digest, or its
    file has the wrong size or is not a regular file (``expected`` and ``got`` say which).
    ``path`` (= ``where``) is the block's file or object, ``digest`` its name (hex) when known.
    """

    def __init__(self, path: str, expected: str, actual: str, *, digest: str = "") -> None:
        super().__init__(path, expected, actual)
        self.path = path
        self.digest = digest

    def __reduce__(self) -> tuple[Any, ...]:
        return (_corrupt_block, (self.path, self.expected, self.got, self.digest))


def _corrupt_block(path: str, expected: str, actual: str, digest: str) -> CorruptBlockError:
    return CorruptBlockError(path, expected, actual, digest=digest)


class EntryNotFoundError(KVStoreError, KeyError):
    """No entry has this id (or the id prefix is ambiguous)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "entry not found"


class ManifestError(KVStoreError, ValueError):
    """A manifest could not be decoded or is inconsistent."""
