"""What every tier keeps of one entry, derived in one place: :func:`records_of`.

A save, a pull from another tier, a cut of an entry back to its intact prefix, a
repair, the verify rebuild of a lost record, the reach-marker migration and the
developer tools all record an entry from its manifest through :func:`records_of`, so
the records of one entry cannot differ with the path that made them. What the
manifest cannot say is passed in by the caller who knows it: the entry's priority
(the saver's, or the one the source tier kept) and its last access.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec

from ..blocks import hash_bytes
from ..codecs import codec_for_record
from ..codecs.layout import manifest_blocks
from ..schema import Layer, Manifest, encode_manifest
from . import keys as P

Priority = Literal["checkpoint", "assistant", "user", "system"]
#: mlx-lm's ``LRUPromptCache`` cache types, in eviction order (assistant goes first), after
#: "checkpoint": a state saved part-way through a prefill (kvstore.mlx_lm.prefill), which
#: compaction thins first (kvstore.catalog.thinning).
PRIORITIES: dict[str, int] = {"checkpoint": -1, "assistant": 0, "user": 1, "system": 2}
PRIORITY_NAMES = {v: k for k, v in PRIORITIES.items()}
#: The manifest metadata key mlx-lm's cache type is kept under (``PersistentPromptCache``
#: and the mlx-bun bridge write it): the priority of an entry whose tier kept none.
CACHE_TYPE = "cache_type"
_ns_json = msgspec.json.Encoder()


@dataclass(frozen=True)
class Records:
    """One entry as every tier records it: its manifest and blocks, its keys (the chain
    ``c_0 .. c_K`` and the exact key), and the bookkeeping eviction orders by."""

    digest: bytes  # the manifest's digest: the entry's id
    manifest: bytes  # the encoded manifest
    blocks: dict[bytes, int]  # distinct block digest -> size, in manifest order
    chain: list[bytes]  # c_0 .. c_K: the entry holds K = n_tokens // block_tokens full blocks
    exact_key: bytes
    tokens: bytes  # u32 little-endian
    n_tokens: int
    block_tokens: int
    trimmable: bool  # every layer can serve a shorter prefix
    namespace: str  # the namespace as JSON (how the local index lists it)
    logical_bytes: int  # the bytes the entry's blocks hold, counted per use
    created_at: int  # ms since the epoch
    last_access: int  # ms since the epoch
    priority: int  # PRIORITIES' value
    hits: int = 0
    #: Pulled from a lower tier that checks no signature (no signing key): nothing vouches
    #: for who wrote it, and a keyed push does not sign it unless told to.
    pulled_unsigned: bool = False
    pin_ttl: int = 0  # ms: a cache breakpoint's pin (EntryRecord.pin_ttl); 0: none

    @property
    def depth_keys(self) -> list[bytes]:
        """``c_1 .. c_K``: one per full block the entry holds."""
        return self.chain[1:]


def trimmable(layers: Sequence[Layer]) -> bool:
    """Whether every layer of an entry can serve a shorter prefix."""
    return all(codec_for_record(layer).trimmable(layer) for layer in layers)


def encoded(m: Manifest) -> tuple[bytes, bytes]:
    """``(encoded manifest, its digest)``: what names an entry."""
    raw = encode_manifest(m)
    return raw, hash_bytes(m.hash, raw)


def chain_of(m: Manifest) -> list[bytes]:
    """The chain keys ``c_0 .. c_{n//T}`` of an entry's tokens."""
    T = m.block_tokens
    c0 = P.root_key(m.namespace, m.codec, T, m.hash)
    return P.chain(c0, m.tokens, T, m.hash, m.n_tokens // T)


def namespace_of(m: Manifest) -> str:
    """The entry's namespace as its records keep it (canonical JSON of the manifest's)."""
    return _ns_json.encode(m.namespace).decode()


def priority_of(m: Manifest) -> int:
    """The priority the manifest names (its mlx-lm cache type), else assistant's."""
    return PRIORITIES.get(m.metadata.get(CACHE_TYPE, ""), 0)


def records_of(
    m: Manifest,
    raw: bytes | None = None,
    digest: bytes | None = None,
    *,
    priority: int | None = None,
    last_access: int | None = None,
    hits: int = 0,
    pulled_unsigned: bool = False,
    pin_ttl: int = 0,
) -> Records:
    """The records of the entry with manifest ``m`` (encoded ``raw``, named ``digest``:
    computed when not given).

    ``priority``: the entry's, as its saver gave it or the tier it comes from kept it;
    None when nobody knows it (a record lost and rebuilt, an entry from a tier that keeps
    none): then the manifest's cache type says it (:func:`priority_of`). ``last_access``
    (ms since the epoch): None is now. ``pulled_unsigned``: the entry came from a tier
    whose signatures nobody checked (:attr:`Records.pulled_unsigned`). ``pin_ttl`` (ms):
    the pin of a cache breakpoint, which only the root keeps (a tier below it records none).
    """
    if raw is None:
        raw = encode_manifest(m)
    if digest is None:
        digest = hash_bytes(m.hash, raw)
    chain = chain_of(m)
    sizes = manifest_blocks(m)
    return Records(
        digest=digest,
        manifest=raw,
        blocks=sizes,
        chain=chain,
        exact_key=P.exact_key_for(chain, m.tokens, m.n_tokens, m.block_tokens, m.hash),
        tokens=m.tokens,
        n_tokens=m.n_tokens,
        block_tokens=m.block_tokens,
        trimmable=trimmable(m.layers),
        namespace=namespace_of(m),
        logical_bytes=sum(sizes[bytes(b)] for b in m.all_blocks()),
        created_at=m.created_at,
        last_access=int(time.time() * 1000) if last_access is None else last_access,
        priority=priority_of(m) if priority is None else priority,
        hits=hits,
        pulled_unsigned=pulled_unsigned,
        pin_ttl=pin_ttl,
    )


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


__all__ = [
    "CACHE_TYPE",
    "PRIORITIES",
    "PRIORITY_NAMES",
    "Priority",
    "Records",
    "chain_of",
    "cut_layers",
    "cut_manifest",
    "encoded",
    "priority_of",
    "records_of",
    "trimmable",
]
