"""The body of a save: place the cache in blocks, write the new ones, make the manifest
and the records (:func:`~kvstore.catalog.records.records_of`) the local catalog commits
in one transaction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..catalog import keys as P
from ..catalog.base import Ensure
from ..catalog.find import Match, find
from ..catalog.records import PRIORITIES, Records, encoded, records_of
from ..codecs import AttachmentData, RawCache, snapshot, stored_snapshot
from ..codecs.layout import in_token_blocks
from ..errors import CacheMismatchError, ManifestError
from ..index import now_ms
from ..schema import (
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
from .root import Root
from .writer import place, write_blocks

CODEC_PROVIDER = "kvstore-mlx/1"


class PrefixGone(Exception):
    """A reused prefix block vanished before the commit (its entry was collected)."""


@dataclass(frozen=True)
class Known:
    """What a root held for one snapshot's tokens, asked once in one read transaction of
    its catalog (:func:`ask`) and then shared by everything a save decides: whether to
    write it now (the write-behind queue), how much of it was stored before, whether it
    is stored already, which leading token blocks it may reference.

    It may be stale when it is used (another writer, in this process or another, may
    have saved or removed entries since); each use is one a stale value cannot make
    wrong: :meth:`kvstore.Store.save` confirms an ``exact`` entry it did not ask for
    itself (``catalog.exact``, or the pin's own write transaction) and asks again when
    it is gone; a reused block that was collected meanwhile aborts the commit
    (:class:`PrefixGone`) and the save writes its own bytes; a save of the same tokens
    that won meanwhile makes the commit a no-op; ``stored`` is a figure and an
    advisory decision, as of when it was asked.
    """

    key: bytes  # the query's exact key (namespace, root settings, tokens): whose it is
    exact: tuple[bytes, int] | None  # the entry that is exactly the query: digest, bytes
    match: Match | None  # the longest local prefix (None: none, or not asked)
    blocks: tuple[bytes, ...] = ()  # the match's leading full token blocks
    layout: tuple[tuple[str, int, tuple[int, ...]], ...] = ()  # their token tensors

    @property
    def stored(self) -> int:
        """How many leading tokens of the query a local entry serves (0: none)."""
        return self.match.length if self.match is not None else 0


def ask(root: Root, tk: P.TokenKeys, *, prefix: bool = True) -> Known:
    """What ``root`` holds for the query ``tk``: its exact entry and (``prefix``) its
    longest local prefix with that entry's leading token blocks, in one read transaction
    of the root's catalog."""
    T = root.settings.block_tokens
    match, m = None, None
    with root.catalog.reader() as r:
        exact = r.exact(tk.exact_key())
        if prefix:
            match = find(r, tk)
            if match is not None and match.length >= T:
                m = r.manifest(match.digest)
    if m is None:
        return Known(tk.exact_key(), exact, match)
    assert match is not None
    return Known(tk.exact_key(), exact, match, tuple(m.token_blocks[: match.length // T]),
                 tuple(_token_layout(m.layers)))


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
    reuse: Known | None,
    pin_ttl: int = 0,
) -> Draft:
    """Write the blocks of ``cache`` that are not stored yet and make its records.

    With ``reuse`` (what the root held for these tokens, :func:`ask`) the leading full
    token blocks a stored entry holds for the same tokens are referenced instead of
    hashed (their bytes must then be there at the commit: :class:`PrefixGone` when they
    went meanwhile).
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
    known = reusable_prefix(reuse, layers[:n_layers]) if reuse is not None else []
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


def reusable_prefix(known: Known, layers: tuple[Layer, ...]) -> list[bytes]:
    """Digests of the leading full token blocks a stored entry holds for these tokens
    (``known``: its match), when its token tensors are laid out as ``layers``'."""
    if not known.blocks or known.layout != tuple(_token_layout(layers)):
        return []
    return list(known.blocks)


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
