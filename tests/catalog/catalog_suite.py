"""The shared catalog suite: every tier's catalog passes these tests (zarr-style).

A backend's test module subclasses :class:`CatalogTests` and provides the ``tier``
fixture (a fresh, empty tier whose blocks are cut at ``T`` tokens) and
:meth:`read_only` (the same tier's catalog, opened read-only). Entries are built here
from manifests alone (no MLX): a KV layer of 4 bytes a token, or an arrays layer of
32 bytes of state; each block's bytes are derived from its tokens, and its name is
their digest. The helpers never ask the catalog under test what they check.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import pytest

from kvstore.blocks import hash_bytes
from kvstore.catalog import keys as P
from kvstore.catalog.base import Catalog, Tier
from kvstore.catalog.find import Match, find
from kvstore.catalog.records import Records, records_of
from kvstore.errors import ReadOnlyStoreError
from kvstore.schema import ArraysLayer, KVLayer, Manifest, Namespace, TensorSpec

T = 4  # tokens per block of the suite's tiers
CODEC = "kvstore-mlx/1"
NS = Namespace(model_id="suite", config_fingerprint="c", tokenizer_hash="t")
OTHER = Namespace(model_id="suite", config_fingerprint="c", tokenizer_hash="t", ns="other")


def le(tokens: Sequence[int]) -> bytes:
    return array.array("I", tokens).tobytes()


class Entry:
    """One entry of the suite: its manifest, its records and its blocks' bytes."""

    def __init__(self, tokens: Sequence[int], *, trimmable: bool = True, algo: str = "blake3",
                 ns: Namespace = NS, priority: int | None = None, created_at: int = 1000,
                 metadata: dict[str, str] | None = None) -> None:
        n = len(tokens)
        raw = le(tokens)
        self.bytes: dict[bytes, bytes] = {}
        if trimmable:
            spec = TensorSpec(shape=(1, 1, n, 2), dtype="float16", token_axis=2)
            layers: tuple[KVLayer | ArraysLayer, ...] = (KVLayer(offset=n, tensors=(spec,)),)
            token_blocks = tuple(self._block(algo, raw[4 * i * T : 4 * min(n, (i + 1) * T)])
                                 for i in range(-(-n // T)))
            state_blocks: tuple[bytes, ...] = ()
            state_bytes = 0
        else:
            spec = TensorSpec(shape=(1, 8), dtype="float32", state_offset=0)
            layers = (ArraysLayer(size=1, present=(True,), tensors=(spec,)),)
            token_blocks = ()
            state_blocks = (self._block(algo, hash_bytes(algo, b"state", raw)),)
            state_bytes = 32
        self.manifest = Manifest(
            namespace=ns, codec=CODEC, hash=algo, block_tokens=T, state_block_bytes=4 << 20,
            created_at=created_at, n_tokens=n, tokens=raw, layers=layers,
            token_blocks=token_blocks, state_blocks=state_blocks, state_bytes=state_bytes,
            metadata=metadata or {},
        )
        self.records: Records = records_of(self.manifest, priority=priority)
        self.digest = self.records.digest

    def _block(self, algo: str, data: bytes) -> bytes:
        d = hash_bytes(algo, data)
        self.bytes[d] = data
        return d


def query(tokens: Sequence[int], *, algo: str = "blake3", ns: Namespace = NS) -> P.TokenKeys:
    return P.TokenKeys.of(list(tokens), P.root_key(ns, CODEC, T, algo), T, algo)


def lookup(cat: Catalog, tokens: Sequence[int], *, ns: Namespace = NS) -> Match | None:
    with cat.reader() as r:
        return find(r, query(tokens, ns=ns))


def commit(tier: Tier, e: Entry, asked: list[bytes] | None = None) -> bool:
    """Commit ``e``, putting the blocks the catalog asks for into the tier's block store."""

    def ensure(digests: Sequence[bytes]) -> None:
        for d in digests:
            if asked is not None:
                asked.append(d)
            if not tier.blocks.exists(d):
                tier.blocks.put(d, [e.bytes[d]])

    return tier.catalog.commit(e.records, ensure)


def same_records(a: Records, b: Records) -> None:
    """Everything an entry's records say but when it was last used."""
    for field in ("digest", "manifest", "blocks", "chain", "exact_key", "tokens", "n_tokens",
                  "block_tokens", "trimmable", "namespace", "logical_bytes", "created_at",
                  "priority"):
        assert getattr(a, field) == getattr(b, field), field


class CatalogTests:
    """Subclass me; provide the ``tier`` fixture and :meth:`read_only`."""

    @pytest.fixture
    def tier(self) -> Tier:
        raise NotImplementedError

    def read_only(self, tier: Tier) -> Catalog:
        raise NotImplementedError

    def test_a_committed_entry_is_found_by_every_key(self, tier: Tier) -> None:
        cat = tier.catalog
        toks = list(range(100, 110))
        e = Entry(toks, priority=2)
        assert commit(tier, e) is True
        assert cat.exact(e.records.exact_key) == e.digest
        assert cat.manifest(e.digest) == (e.records.manifest, e.manifest)
        got = cat.records(e.digest)
        assert got is not None
        same_records(got, e.records)
        assert list(cat) == [e.digest]
        assert all(tier.blocks.get(d) == e.bytes[d] for d in e.records.blocks)
        name = cat.name
        assert lookup(cat, toks + [7, 8]) == Match(e.digest, 10, False, True, 10, where=name)
        assert lookup(cat, toks) == Match(e.digest, 10, True, True, 10, where=name)
        assert lookup(cat, toks[:6]) == Match(e.digest, 6, False, True, 10, where=name)
        assert lookup(cat, [1, 2, 3, 4, 5, 6]) is None

    def test_a_second_commit_of_the_entry_or_its_tokens_is_refused(self, tier: Tier) -> None:
        toks = list(range(200, 209))
        e = Entry(toks)
        assert commit(tier, e) is True
        assert commit(tier, e) is False
        again = Entry(toks, created_at=2000)  # the same tokens, another manifest
        assert commit(tier, again) is False
        assert tier.catalog.exact(e.records.exact_key) == e.digest

    def test_a_non_trimmable_entry_serves_only_its_own_length(self, tier: Tier) -> None:
        cat = tier.catalog
        toks = list(range(300, 310))
        e = Entry(toks, trimmable=False)
        commit(tier, e)
        name = cat.name
        assert lookup(cat, toks + [1, 2]) == Match(e.digest, 10, False, False, 10, where=name)
        assert lookup(cat, toks) == Match(e.digest, 10, True, False, 10, where=name)
        assert lookup(cat, toks[:7]) is None
        assert lookup(cat, toks[:9] + [5, 6]) is None

    def test_an_entry_shorter_than_a_block_is_found_exactly(self, tier: Tier) -> None:
        e = Entry([7, 8, 9])
        commit(tier, e)
        assert lookup(tier.catalog, [7, 8, 9]) == Match(e.digest, 3, True, True, 3,
                                                         where=tier.catalog.name)

    def test_the_longest_of_several_entries_wins(self, tier: Tier) -> None:
        cat = tier.catalog
        a = Entry(list(range(400, 412)))
        b = Entry(list(range(400, 408)) + [50, 51])
        c = Entry(list(range(400, 405)), trimmable=False)
        for e in (a, b, c):
            commit(tier, e)
        got = lookup(cat, list(range(400, 410)) + [77])
        assert got is not None and (got.digest, got.length) == (a.digest, 10)
        got = lookup(cat, list(range(400, 408)) + [50, 51, 52])
        assert got is not None and (got.digest, got.length) == (b.digest, 10)
        got = lookup(cat, list(range(400, 406)))
        assert got is not None and got.length == 6 and got.digest in (a.digest, b.digest)
        assert sorted(cat) == sorted([a.digest, b.digest, c.digest])

    def test_namespaces_never_meet(self, tier: Tier) -> None:
        toks = list(range(500, 512))
        commit(tier, Entry(toks))
        assert lookup(tier.catalog, toks, ns=OTHER) is None
        other = Entry(toks, ns=OTHER)
        assert commit(tier, other) is True
        got = lookup(tier.catalog, toks, ns=OTHER)
        assert got is not None and got.digest == other.digest

    def test_a_removed_entry_is_gone_from_every_key(self, tier: Tier) -> None:
        cat = tier.catalog
        toks = list(range(600, 611))
        keep = Entry(list(range(600, 604)) + [1])
        e = Entry(toks)
        commit(tier, keep)
        commit(tier, e)
        assert cat.remove(e.digest) is True
        assert cat.exact(e.records.exact_key) is None
        assert cat.manifest(e.digest) is None and cat.records(e.digest) is None
        assert list(cat) == [keep.digest]
        got = lookup(cat, toks)
        assert got is not None and got.digest == keep.digest and got.length == 4
        assert cat.remove(e.digest) is False

    def test_remove_many_removes_each_and_says_which_were_there(self, tier: Tier) -> None:
        cat = tier.catalog
        keep = Entry(list(range(640, 652)))
        toks = {"a": list(range(660, 671)), "b": list(range(680, 683))}
        a, b = Entry(toks["a"]), Entry(toks["b"], trimmable=False)
        for e in (keep, a, b):
            commit(tier, e)
        assert cat.remove(b.digest) is True  # removed by another caller meanwhile
        assert cat.remove_many([a.digest, b.digest]) == [a.digest]
        for e, t in ((a, toks["a"]), (b, toks["b"])):
            assert cat.exact(e.records.exact_key) is None
            assert cat.manifest(e.digest) is None and cat.records(e.digest) is None
            assert lookup(cat, t) is None
        assert list(cat) == [keep.digest]
        got = lookup(cat, list(range(640, 652)))
        assert got is not None and got.digest == keep.digest and got.exact
        assert cat.remove_many([a.digest]) == [] and cat.remove_many([]) == []

    def test_the_blocks_are_ensured_before_the_entry_is_visible(self, tier: Tier) -> None:
        cat = tier.catalog
        e = Entry(list(range(700, 710)))
        asked: list[bytes] = []
        assert commit(tier, e, asked)
        assert set(asked) == set(e.records.blocks)  # a fresh tier vouches for none of them

        f = Entry(list(range(800, 806)))

        def fail(digests: Sequence[bytes]) -> None:
            raise OSError("no room for the blocks")

        with pytest.raises(OSError, match="no room"):
            cat.commit(f.records, fail)
        assert cat.exact(f.records.exact_key) is None
        assert lookup(cat, list(range(800, 806))) is None
        assert list(cat) == [e.digest]

    def test_priority_is_kept_or_read_from_the_manifest(self, tier: Tier) -> None:
        cat = tier.catalog
        system = Entry(list(range(900, 910)), priority=2)
        user = Entry(list(range(910, 920)), metadata={"cache_type": "user"})
        plain = Entry(list(range(920, 930)))
        for e in (system, user, plain):
            commit(tier, e)
        got = [cat.records(e.digest) for e in (system, user, plain)]
        assert [r.priority if r else None for r in got] == [2, 1, 0]

    def test_a_read_only_catalog_reads_and_refuses_every_write(self, tier: Tier) -> None:
        e = Entry(list(range(1000, 1010)))
        commit(tier, e)
        ro = self.read_only(tier)
        assert ro.read_only and list(ro) == [e.digest]
        assert ro.exact(e.records.exact_key) == e.digest
        assert ro.manifest(e.digest) == (e.records.manifest, e.manifest)
        got = lookup(ro, list(range(1000, 1010)))
        assert got is not None and got.exact
        with pytest.raises(ReadOnlyStoreError):
            ro.commit(Entry([1, 2, 3, 4, 5]).records, lambda ds: None)
        with pytest.raises(ReadOnlyStoreError):
            ro.remove(e.digest)
        with pytest.raises(ReadOnlyStoreError):
            ro.remove_many([e.digest])
        assert list(tier.catalog) == [e.digest]
