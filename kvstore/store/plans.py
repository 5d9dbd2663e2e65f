"""An entry's index records from its manifest alone: for a manifest that arrives whole
(a pull from the remote) or is cut back to its first blocks (a pull of a prefix, a
repair), and the keys a remote publication of a local entry carries."""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from ..blocks import hash_bytes
from ..codecs import codec_for_record
from ..codecs.layout import manifest_blocks
from ..index import EntryRecord, SavePlan, now_ms
from ..remote import Publication
from ..schema import Layer, Manifest, encode_manifest
from . import keys as P
from .lookup import prefix_items, trimmable
from .saving import PRIORITIES

_ns_json = msgspec.json.Encoder()


def cut_layers(layers: tuple[Layer, ...], n_tokens: int) -> tuple[Layer, ...] | None:
    """The layer records of the first ``n_tokens`` of the same token blocks, or None."""
    out = []
    for layer in layers:
        c = codec_for_record(layer).cut(layer, n_tokens)
        if c is None:
            return None
        out.append(c)
    return tuple(out)


def cut_manifest(m: Manifest, k: int) -> Manifest | None:
    """``m`` cut back to its first ``k`` token blocks (``k * T`` tokens), or None when it
    cannot serve a shorter prefix (a state block, a layer that does not trim)."""
    n = k * m.block_tokens
    if k <= 0 or n >= m.n_tokens or not trimmable(m.layers):
        return None
    layers = cut_layers(m.layers, n)
    if layers is None:
        return None
    return msgspec.structs.replace(m, n_tokens=n, tokens=m.tokens[: 4 * n], layers=layers,
                                   token_blocks=m.token_blocks[:k])


def record_priority(m: Manifest) -> int:
    """The eviction priority of an entry known by its manifest alone (pulled, or its record
    rebuilt): a checkpoint's own (it is thinned first), else 0 as before."""
    return PRIORITIES["checkpoint"] if m.metadata.get("cache_type") == "checkpoint" else 0


def encoded(m: Manifest) -> tuple[bytes, bytes]:
    """``(encoded manifest, its digest)``: what names an entry."""
    raw = encode_manifest(m)
    return raw, hash_bytes(m.hash, raw)


def chain_of(m: Manifest) -> list[bytes]:
    """The chain keys ``c_0 .. c_{n//T}`` of an entry's tokens."""
    T = m.block_tokens
    c0 = P.root_key(m.namespace, m.codec, T, m.hash)
    return P.chain(c0, m.tokens, T, m.hash, m.n_tokens // T)


def entry_plan(
    m: Manifest,
    raw: bytes,
    digest: bytes,
    *,
    entry: EntryRecord | None = None,
    ensure_block: Callable[[bytes], None] | None = None,
) -> SavePlan:
    """The :class:`SavePlan` that commits manifest ``m`` (encoded ``raw``, named ``digest``)."""
    T = m.block_tokens
    keys = chain_of(m)
    sizes = manifest_blocks(m)
    if entry is None:
        entry = EntryRecord(
            namespace=_ns_json.encode(m.namespace).decode(),
            n_tokens=m.n_tokens,
            logical_bytes=sum(sizes[bytes(b)] for b in m.all_blocks()),
            created_at=m.created_at,
            last_access=now_ms(),
            priority=record_priority(m),
        )
    plan = SavePlan(
        digest=digest,
        manifest=raw,
        blocks=sizes,
        prefix_items=prefix_items(keys, P.tokens_from_le(m.tokens), T, trimmable(m.layers),
                                  digest),
        exact_key=P.exact_key_for(keys, m.tokens, m.n_tokens, T, m.hash),
        entry=entry,
    )
    if ensure_block is not None:
        plan.ensure_block = ensure_block
    return plan


def publication(m: Manifest, raw: bytes, digest: bytes) -> Publication:
    """What the remote needs to publish a local entry."""
    keys = chain_of(m)
    return Publication(
        digest=digest,
        manifest=raw,
        blocks=manifest_blocks(m),
        depth_keys=keys[1:],
        exact_key=P.exact_key_for(keys, m.tokens, m.n_tokens, m.block_tokens, m.hash),
        n_tokens=m.n_tokens,
        trimmable=trimmable(m.layers),
    )
