"""mlx-bun files in and out of a store: ``import_file`` and ``export`` (mixed into
:class:`~kvstore.store.Store`; the formats themselves are :mod:`kvstore.store.bridge`'s)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from ..schema import Namespace
from .entries import EntryInfo


class FileBridge:
    """``import_file`` and ``export``; ``self`` is the :class:`~kvstore.store.Store`."""

    def import_file(
        self: Any,
        path: str | os.PathLike[str],
        *,
        verify: bool = True,
        namespace: Namespace | None = None,
    ) -> EntryInfo:
        """Store an mlx-bun v3/v4/v5 file as one entry.

        The whole file is read (and, with ``verify``, every tensor or v5 block hash
        checked) before anything is written, so a malformed file raises its
        :class:`~kvstore.errors.FileFormatError` and leaves the store unchanged.
        The entry's namespace is ``namespace``, else the header's identity, else
        the store's default (:class:`NamespaceRequiredError` when there is none).
        """
        from .bridge import read_file  # the formats: imported by the calls that use them

        self._check_writable("import")
        f = read_file(path, verify=verify)
        info: EntryInfo = self.save(
            f.tokens,
            f.cache,
            namespace=namespace or f.namespace,
            metadata=f.metadata,
            attachments=f.attachments,
            priority=f.priority,
            created_at=f.created_at,
        )
        return info

    def export(
        self: Any,
        entry_id: str | bytes,
        path: str | os.PathLike[str],
        *,
        format: Literal["v3", "v5"] = "v3",
        verify: bool = True,
    ) -> Path:
        """Write one entry as an mlx-bun file (see :func:`kvstore.store.bridge.write_file`)
        and return its path; ``entry_id`` may be a unique hex prefix.

        Every block's digest is checked over the bytes read (whatever the store's
        ``verify_reads``: a file written from damaged bytes would carry fresh hashes
        of them); a bad block is a :class:`CorruptBlockError` naming it,
        quarantined as a restore would, and no file is written. ``verify=False``
        skips the check.
        """
        if format not in ("v3", "v5"):
            raise ValueError(f"format must be 'v3' or 'v5', not {format!r}")
        eid = self.resolve(entry_id) if isinstance(entry_id, str) else entry_id
        m = self.manifest(eid)
        tokens, cache, attachments = self.load_entry(eid, verify=verify)
        from .bridge import write_file

        return write_file(m, tokens, cache, attachments, path, format=format)
