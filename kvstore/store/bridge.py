"""The store bridge: mlx-bun v3/v4/v5 files in and out of a :class:`~kvstore.Store`.

An imported file becomes an ordinary entry: its tensors are cut into the
store's own blocks and deduplicated like any save, its attachments go into the
manifest's attachments, and its namespace is the header's identity (modelId,
configFingerprint, tokenizerHash, ns) unless the caller passes another.

What the manifest has no field for is kept in its string metadata, under keys
named ``mlx-bun.*``, so that exporting the entry back as v3 reproduces an
imported v3/v4 file byte for byte:

``mlx-bun.createdAt``
    the header's ``createdAt`` (ms since the epoch, decimal). An export writes
    it back; an entry saved from mlx-lm caches exports its manifest's
    ``created_at`` instead.
``mlx-bun.formatVersion``
    the file's ``formatVersion`` (informational: a v3 export is v4 exactly
    when the entry has attachments).
``mlx-bun.blockBytes``
    v5 files only: the largest block the file lists. Cutting every tensor at
    that size gives back the file's own blocks, so it is a v5 export's default.
``mlx-bun.identity``
    ``"none"`` when the header carried no modelId; an export then writes no
    identity fields either (otherwise it writes the entry's namespace).

Every other metadata pair (mlx-lm's ``cache_type``, a caller's own) is exported
in a header field ``metadata`` of its own, which mlx-bun's reader ignores, and
imported back from it; a ``cache_type`` that names a priority (``assistant``,
``user``, ``system``) is the imported entry's priority.

The store names an entry by (namespace, tokens): importing a file whose tokens
are already stored in that namespace returns the existing entry, as a second
save of the same tokens does. Import under another ``namespace`` to keep both.
The entry's creation time is the header's ``createdAt``, so importing the same
file again after removing its entry gives back the same entry id.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, NamedTuple

from ..catalog.records import PRIORITIES, Priority
from ..formats.errors import FileFormatError
from ..formats.v3 import load_v3, save_v3
from ..formats.v5file import DEFAULT_BLOCK_BYTES, save_v5
from ..schema import SALT_KEY, Manifest, Namespace

__all__ = [
    "BLOCK_BYTES_KEY",
    "CREATED_AT_KEY",
    "FORMAT_VERSION_KEY",
    "IDENTITY_KEY",
    "FileEntry",
    "read_file",
    "write_file",
]

CREATED_AT_KEY = "mlx-bun.createdAt"
FORMAT_VERSION_KEY = "mlx-bun.formatVersion"
BLOCK_BYTES_KEY = "mlx-bun.blockBytes"
IDENTITY_KEY = "mlx-bun.identity"
_OWN_PREFIX = "mlx-bun."  # keys derived from the header, not exported as metadata


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _largest_block(header: dict[str, Any]) -> int | None:
    """The largest block a v5 header lists (its writer's block size, or an upper bound)."""
    sizes = [
        int(b["bytes"])
        for group in (header.get("caches", []), header.get("attachments") or [])
        for entry in group
        for slot in entry.get("tensors", [])
        for b in slot.get("blocks") or []
    ]
    return max(sizes) if sizes else None


def _file_metadata(path: str, h: dict[str, Any], format_version: int) -> dict[str, str]:
    own = h.get("metadata", {})
    if not isinstance(own, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in own.items()
    ):
        raise FileFormatError(path, "header field 'metadata' is not an object of strings")
    meta = {k: v for k, v in own.items() if not k.startswith(_OWN_PREFIX)}
    meta[FORMAT_VERSION_KEY] = str(format_version)
    if _is_int(h.get("createdAt")):
        meta[CREATED_AT_KEY] = str(h["createdAt"])
    if format_version == 5:
        largest = _largest_block(h)
        if largest is not None:
            meta[BLOCK_BYTES_KEY] = str(largest)
    if not isinstance(h.get("modelId"), str):
        meta[IDENTITY_KEY] = "none"
    return meta


class FileEntry(NamedTuple):
    """What an mlx-bun file holds, as :meth:`Store.save` takes it."""

    tokens: Any
    cache: list[Any]
    namespace: Namespace | None
    metadata: dict[str, str]
    attachments: list[Any]
    priority: Priority
    created_at: int | None


def read_file(path: str | os.PathLike[str], *, verify: bool = True) -> FileEntry:
    """Read an mlx-bun v3/v4/v5 file whole (and, with ``verify``, check every tensor or
    v5 block hash): a malformed file raises its :class:`~kvstore.errors.FileFormatError`
    before anything is stored."""
    loaded = load_v3(path, verify=verify)
    h = loaded.header
    meta = _file_metadata(os.fspath(path), h, loaded.format_version)
    cache_type = meta.get("cache_type")
    return FileEntry(
        loaded.tokens,
        loaded.cache,
        loaded.namespace,
        meta,
        loaded.attachments,
        cache_type if cache_type in PRIORITIES else "assistant",  # type: ignore[arg-type]
        int(h["createdAt"]) if _is_int(h.get("createdAt")) else None,
    )


def _created_at(metadata: dict[str, str], default: int) -> int:
    raw = metadata.get(CREATED_AT_KEY, "")
    return int(raw) if raw.isdigit() else default


def write_file(
    m: Manifest,
    tokens: Any,
    cache: list[Any],
    attachments: list[Any],
    path: str | os.PathLike[str],
    *,
    format: Literal["v3", "v5"] = "v3",
    block_bytes: int | None = None,
) -> Path:
    """Write one entry (its manifest ``m`` and what it loads to) as an mlx-bun file.

    ``format="v3"`` writes a monolithic file (formatVersion 4 when the entry
    has attachments); ``"v5"`` writes a header file plus SHA-256 blocks in
    ``<dir of path>/blocks/``, cut at ``block_bytes`` (default: the imported
    file's block size, else mlx-bun's 32 KiB).
    """
    if format not in ("v3", "v5"):
        raise ValueError(f"format must be 'v3' or 'v5', not {format!r}")
    ns = None if m.metadata.get(IDENTITY_KEY) == "none" else m.namespace
    created_at = _created_at(m.metadata, m.created_at)
    meta = {k: v for k, v in m.metadata.items()  # the salt is the store's, not the file's
            if not k.startswith(_OWN_PREFIX) and k != SALT_KEY}
    out = Path(path)
    if format == "v3":
        save_v3(
            out,
            tokens,
            cache,
            namespace=ns,
            attachments=attachments or None,
            created_at=created_at,
            metadata=meta,
        )
    else:
        if block_bytes is None:
            raw = m.metadata.get(BLOCK_BYTES_KEY, "")
            block_bytes = int(raw) if raw.isdigit() else DEFAULT_BLOCK_BYTES
        save_v5(
            out,
            tokens,
            cache,
            namespace=ns,
            attachments=attachments or None,
            created_at=created_at,
            block_bytes=block_bytes,
            metadata=meta,
        )
    return out
