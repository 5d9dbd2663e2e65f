"""The body of a save: place the cache in blocks, write the new ones, make the manifest
and the index plan that :meth:`Index.commit_save` commits in one transaction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from ..blocks import new_hasher
from ..codecs import AttachmentData, RawCache, snapshot, stored_snapshot
from ..codecs.layout import in_token_blocks
from ..errors import CacheMismatchError
from ..index import EntryRecord, SavePlan, now_ms
from ..schema import (
    Attachment,
    Layer,
    Manifest,
    Namespace,
    decode_manifest,
    encode_manifest,
    iter_tensor_specs,
)
from . import keys as P
from .lookup import find, prefix_items, trimmable
from .root import Root
from .writer import place, write_blocks

CODEC_PROVIDER = "kvstore-mlx/1"
Priority = Literal["checkpoint", "assistant", "user", "system"]
# "checkpoint": a state saved part-way through a prefill (kvstore.mlx_lm.prefill)
PRIORITIES: dict[str, int] = {"checkpoint": -1, "assistant": 0, "user": 1, "system": 2}
_ns_json = msgspec.json.Encoder()


class PrefixGone(Exception):
    """A reused prefix block vanished before the commit (its entry was collected)."""


@dataclass(frozen=True)
class Draft:
    """A save ready to commit: its blocks are written, its manifest encoded."""

    plan: SavePlan
    digest: bytes
    logical_bytes: int
    new_bytes: int
    created_at: int


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
    bisect: bool,
) -> Draft:
    """Write the blocks of ``cache`` that are not stored yet and plan its index records.

    With ``reuse_prefix`` the leading full token blocks a stored entry holds for the
    same tokens are referenced instead of hashed (their bytes must then be there at
    the commit: :class:`PrefixGone` when they went meanwhile).
    """
    s = root.settings
    n, T = len(tk), s.block_tokens
    snaps = [stored_snapshot(c, n) for c in cache]
    snaps += [_attachment_snapshot(a) for a in attachments]
    n_layers = len(cache)
    layers, blockset = place(snaps, n, T, s.state_block_bytes)
    known = reusable_prefix(root, tk, layers[:n_layers], bisect=bisect) if reuse_prefix else []
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
        metadata=meta,
    )
    encoded = encode_manifest(manifest)
    h = new_hasher(s.hash)
    h.update(encoded)
    digest = h.digest()
    pieces = blockset.by_digest()
    reused = set(known)

    def ensure(d: bytes) -> None:  # called in the commit's transaction, for each block
        if not root.blocks.exists(d):
            if d in reused:  # its entry was deleted and collected meanwhile
                raise PrefixGone
            root.blocks.put(d, pieces[d])

    logical = blockset.logical_bytes()
    plan = SavePlan(
        digest=digest,
        manifest=encoded,
        blocks=blockset.sizes(),
        prefix_items=prefix_items(tk.chain, tk.tokens, T, trimmable(manifest.layers), digest),
        exact_key=tk.exact_key(),
        entry=EntryRecord(
            namespace=_ns_json.encode(ns).decode(),
            n_tokens=n,
            logical_bytes=logical,
            created_at=manifest.created_at,
            last_access=now_ms(),
            priority=PRIORITIES[priority],
        ),
        ensure_block=ensure,
    )
    return Draft(plan, digest, logical, new_bytes, manifest.created_at)


def reusable_prefix(
    root: Root, tk: P.TokenKeys, layers: tuple[Layer, ...], *, bisect: bool
) -> list[bytes]:
    """Digests of the leading full token blocks a stored entry holds for these tokens.

    Resolves the match and its manifest in one read transaction.
    """
    T = root.settings.block_tokens
    with root.index.read() as txn:
        match = find(root.index, txn, tk, bisect=bisect)
        if match is None or match.length < T:
            return []
        raw = root.index.get_manifest(match.digest, txn)
    if raw is None:
        return []
    m = decode_manifest(raw)
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
