"""The body of a save: place the cache in blocks, write the new ones, make the manifest
and the records (:func:`~kvstore.catalog.records.records_of`) the local catalog commits
in one transaction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...catalog import keys as P
from ...catalog.base import Ensure
from ...catalog.find import find
from ...catalog.records import PRIORITIES, Records, encoded, records_of
from ...codecs import AttachmentData, RawCache, snapshot, stored_snapshot
from ...codecs.layout import in_token_blocks
from ...errors import CacheMismatchError, ManifestError
from ...index import now_ms
from ...schema import (
    FORMAT_VERSION,
    MAX_TOKENS,
    SALT_KEY,
    SALTED_FORMAT_VERSION,
    Attachment,
    Layer,
    Manifest,
    Namespace,
    block_salt,
    iter_tensor_specs,
    validate_manifest,
)
from ..local.root import Root
from .writer import place, write_blocks

CODEC_PROVIDER = "kvstore-mlx/1"


class PrefixGone(Exception):
    """A reused prefix block vanished before the commit (its entry was collected)."""


@dataclass(frozen=True)
class Draft:
    """A save ready to commit: its blocks are written, its records made."""

    records: Records
    ensure: Ensure  # the commit's: rewrite a block a GC took meanwhile
    new_bytes: int

    @property
    def digest(self) -> bytes:
        return self.records.digest


def check_args(cache: Sequence[Any], metadata: dict[str, str] | None, priority: str
               ) -> dict[str, str]:
    """The save's metadata, after checking what the caller passed."""
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {sorted(PRIORITIES)}, got {priority!r}")
    if isinstance(cache, (str, bytes)) or not isinstance(cache, Sequence) or len(cache) == 0:
        raise CacheMismatchError("cache must be a non-empty list of cache objects")
    meta = dict(metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise TypeError("metadata must map str to str")
    if SALT_KEY in meta:
        raise ValueError(f"metadata key {SALT_KEY!r} is the store's own")
    return meta


def draft(
    root: Root,
    ns: Namespace,
    tk: P.TokenKeys,
    cache: Sequence[Any],
    attachments: Sequence[AttachmentData],
    meta: dict[str, str],
    priority: str,
    created_at: int | None,
    *,
    reuse_prefix: bool,
    pin_ttl: int = 0,
) -> Draft:
    """Write the blocks of ``cache`` that are not stored yet and make its records.

    With ``reuse_prefix`` the leading full token blocks a stored entry holds for the
    same tokens are referenced instead of hashed (their bytes must then be there at
    the commit: :class:`PrefixGone` when they went meanwhile).
    """
    s = root.settings
    n, T = len(tk), s.block_tokens
    if n > MAX_TOKENS:  # no reader would take its manifest (kvstore.schema's bounds)
        raise ManifestError(f"an entry of {n} tokens: at most {MAX_TOKENS} are stored")
    snaps = [stored_snapshot(c, n) for c in cache]
    snaps += [_attachment_snapshot(a) for a in attachments]
    n_layers = len(cache)
    layers, blockset = place(snaps, n, T, s.state_block_bytes)
    salt = block_salt(ns)
    if salt:  # a tenant's: every block ends with its salt, so its names are the tenant's
        for block in (*blockset.token_pieces, *blockset.window_pieces,
                      *blockset.state_pieces):
            block.append(memoryview(salt))
    known = reusable_prefix(root, tk, layers[:n_layers]) if reuse_prefix else []
    new_bytes = write_blocks(root.blocks, blockset, known)
    manifest = Manifest(
        namespace=ns,
        codec=CODEC_PROVIDER,
        hash=s.hash,
        block_tokens=T,
        state_block_bytes=s.state_block_bytes,
        created_at=now_ms() if created_at is None else created_at,
        n_tokens=n,
        tokens=tk.le,
        layers=layers[:n_layers],
        token_blocks=tuple(blockset.token_digests),
        window_blocks=tuple(blockset.window_digests),
        state_blocks=tuple(blockset.state_digests),
        state_bytes=blockset.state_bytes,
        attachments=tuple(
            Attachment(schema=a.schema, metadata=a.metadata, tensors=layer.tensors)
            for a, layer in zip(attachments, layers[n_layers:], strict=True)
        ),
        metadata={**meta, SALT_KEY: salt.hex()} if salt else meta,
        format=SALTED_FORMAT_VERSION if salt else FORMAT_VERSION,
    )
    # what every reader will check (an import's file included): refused now, not at restore
    validate_manifest(manifest, hash=s.hash, block_tokens=T,
                      state_block_bytes=s.state_block_bytes)
    raw, digest = encoded(manifest)
    pieces = blockset.by_digest()
    reused = set(known)

    def ensure(digests: Sequence[bytes]) -> None:  # in the commit's transaction
        for d in digests:
            if not root.blocks.exists(d):
                if d in reused:  # its entry was deleted and collected meanwhile
                    raise PrefixGone
                root.blocks.put(d, pieces[d])

    rec = records_of(manifest, raw, digest, priority=PRIORITIES[priority], pin_ttl=pin_ttl)
    return Draft(rec, ensure, new_bytes)


def reusable_prefix(root: Root, tk: P.TokenKeys, layers: tuple[Layer, ...]) -> list[bytes]:
    """Digests of the leading full token blocks a stored entry holds for these tokens.

    Resolves the match and its manifest in one read transaction.
    """
    T = root.settings.block_tokens
    with root.catalog.reader() as r:
        match = find(r, tk)
        if match is None or match.length < T:
            return []
        m = r.manifest(match.digest)
    if m is None:
        return []
    if _token_layout(m.layers) != _token_layout(layers):
        return []
    return list(m.token_blocks[: match.length // T])


def _token_layout(layers: Sequence[Layer]) -> list[tuple[str, int, tuple[int, ...]]]:
    """What fixes a token block's bytes per token: each token tensor's dtype and other dims."""
    return [
        (s.dtype, s.token_axis, s.shape[: s.token_axis] + s.shape[s.token_axis + 1 :])
        for s in iter_tensor_specs(tuple(layers))
        if in_token_blocks(s) and s.token_axis is not None
    ]


def _attachment_snapshot(a: AttachmentData) -> Any:
    """Attachments are stored like a raw layer: state tensors, kept whole."""
    return snapshot(RawCache(source_kind=f"attachment:{a.schema}", tensors=list(a.tensors)))
