"""The errors of reading and writing mlx-bun files: every one a :class:`FileFormatError`
naming the file and what is wrong with it (mlx-bun's reader's checks, mirrored)."""

from __future__ import annotations

from typing import Any

from ..errors import CorruptBlockError, DigestMismatchError, KVStoreError


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


class FileDigestMismatchError(DigestMismatchError, FileFormatError):
    """Bytes of a file do not hash to what names them: the header's Bun.hash in the prefix, a
    tensor's hash in the header, a v5 block's SHA-256 name. ``where`` is the file (the
    block file, for a v5 block), ``expected`` and ``got`` the two hashes."""

    def __init__(self, path: str, reason: str, expected: str = "", got: str = "", *,
                 block_path: str = "") -> None:
        Exception.__init__(self, f"{path}: {reason}")  # one message for both bases
        self.path, self.reason = path, reason
        self.where = block_path or path
        self.expected, self.got = expected, got
        self.block_path = block_path

    def __reduce__(self) -> tuple[Any, ...]:
        return (_file_digest_mismatch,
                (self.path, self.reason, self.expected, self.got, self.block_path))


def _file_digest_mismatch(
    path: str, reason: str, expected: str, got: str, block_path: str
) -> FileDigestMismatchError:
    return FileDigestMismatchError(path, reason, expected, got, block_path=block_path)


#: The names the header's and a tensor's case had before they were one error.
HeaderHashMismatchError = FileDigestMismatchError
TensorHashMismatchError = FileDigestMismatchError


class CorruptFileBlockError(FileDigestMismatchError, CorruptBlockError):
    """A v5 file's block does not hash to its name: a file's digest mismatch that is also a
    block's (a :class:`CorruptBlockError`, ``digest`` its name, ``path`` the v5 file)."""

    def __init__(self, path: str, reason: str, expected: str = "", got: str = "", *,
                 block_path: str = "") -> None:
        super().__init__(path, reason, expected, got, block_path=block_path)
        self.digest = expected

    def __reduce__(self) -> tuple[Any, ...]:
        return (_corrupt_file_block,
                (self.path, self.reason, self.expected, self.got, self.block_path))


def _corrupt_file_block(
    path: str, reason: str, expected: str, got: str, block_path: str
) -> CorruptFileBlockError:
    return CorruptFileBlockError(path, reason, expected, got, block_path=block_path)


class BlockReferenceError(FileFormatError):
    """A v5 tensor names a block that is malformed, missing or of the wrong size."""


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
