"""A root and the tiers below it presented as one tier: :class:`~.tiers.Tiers` is a
:class:`~kvstore.catalog.base.Tier` whose catalog and block store are these two
(dulwich's ``OverlayObjectStore``, which is an object store and runs its suite).

Reads answer from the root, else from the first tier below that holds what is asked;
lookups run the one search :meth:`Tiers.search <.tiers.Tiers.search>` runs. Writes go to
the root: a commit is written behind to the tiers below as a save is. Removing an entry
or deleting a block does so in every tier, so that it is gone from the composed view. A
block read from a tier below is written back into the root, verified, by the code a pull
writes its blocks with (:meth:`Root.copy_blocks
<kvstore.local.root.Root.copy_blocks>`). Both pass the shared suites
(tests/catalog/test_composed_catalog.py, tests/blocks/test_composed_blocks.py,
tests/remote/test_composed_remote.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol, TypeVar

from ..blocks import BlockStat, BlockStore, Digest
from ..blocks.base import Buffer, Staged
from ..catalog.base import Catalog, Ensure, Tier
from ..catalog.find import DepthReader, Match
from ..catalog.keys import TokenKeys
from ..catalog.records import Records
from ..errors import BlockNotFoundError
from ..local import Root
from ..schema import Manifest

_T = TypeVar("_T")
_I = TypeVar("_I")


class Layers(Protocol):
    """What the composed catalog and block store use of the tiers they present."""

    @property
    def root(self) -> Root: ...

    def below(self, *, writing: bool = False) -> list[Tier]:
        """The tiers below the root, in order: to read, those lookups ask now; to write,
        every one."""
        ...

    def search(self, tk: TokenKeys) -> Match | None:
        """The best match of ``tk`` across the tiers (the store's own lookup)."""
        ...

    def written(self, digest: bytes) -> None:
        """An entry was committed to the root: write it behind, as a save is."""
        ...

    def pushed(self, digest: bytes) -> bool:
        """Wait (bounded) until no copy of ``digest`` to the tiers below is queued or
        running (False: it still is)."""
        ...


def _first(asked: Iterable[_I], ask: Callable[[_I], _T | None]) -> _T | None:
    """The first answer that is not None, asking each in order (the root first)."""
    for t in asked:
        got = ask(t)
        if got is not None:
            return got
    return None


def _union(parts: Sequence[Sequence[bytes]], asked: Sequence[bytes]) -> list[bytes]:
    """Those of ``asked`` (each once, in its order) that any part names."""
    there = {d for p in parts for d in p}
    return [d for d in dict.fromkeys(asked) if d in there]


class ComposedReader(DepthReader):
    """A lookup's view of the composed tier. It has no depths of its own: the one call
    :func:`~kvstore.catalog.find.find` makes first (:meth:`exact_later`) answers the whole
    query through the tiers' search (the root's bisection, then each tier below asked for
    more), so :meth:`reaches` never holds and ``find`` keeps that answer."""

    def __init__(self, search: Callable[[TokenKeys], Match | None]) -> None:
        self._search = search

    def reaches(self, k: int, chain_key: bytes) -> bool:
        return False

    def best_at(self, tk: TokenKeys, k: int) -> Match | None:
        return None

    def exact_later(self, tk: TokenKeys) -> Callable[[], Match | None]:
        return lambda: self._search(tk)


class ComposedCatalog(Catalog):
    """The entries of the root and the tiers below it, as one catalog (named as the root:
    ``Match.where`` says which tier holds a match)."""

    def __init__(self, layers: Layers, blocks: ComposedBlocks) -> None:
        self.layers = layers
        self.blocks = blocks  # the composed tier's, which a commit's blocks are ensured in
        root = layers.root.catalog
        self.name = root.name
        self.read_only = root.read_only

    def _catalogs(self) -> Iterator[Catalog]:
        """The root's catalog, then (asked for only when it does not answer) those below."""
        yield self.layers.root.catalog
        for t in self.layers.below():
            yield t.catalog

    def _holder(self, digest: bytes) -> Catalog | None:
        return _first(self._catalogs(),
                      lambda c: c if c.manifest_bytes(digest) is not None else None)

    def reader(self) -> AbstractContextManager[DepthReader]:
        return nullcontext(ComposedReader(self.layers.search))

    def exact(self, exact_key: bytes) -> bytes | None:
        return _first(self._catalogs(), lambda c: c.exact(exact_key))

    def manifest_bytes(self, digest: bytes) -> bytes | None:
        return _first(self._catalogs(), lambda c: c.manifest_bytes(digest))

    def manifest(self, digest: bytes) -> tuple[bytes, Manifest] | None:
        """As the tier that holds it reads it (its own check of the manifest's name and
        signature)."""
        return _first(self._catalogs(), lambda c: c.manifest(digest))

    def where(self, digest: bytes) -> str:
        held = self._holder(digest)
        return (held or self.layers.root.catalog).where(digest)

    def trusts(self, digest: bytes) -> bool:
        held = self._holder(digest)
        return held is None or held.trusts(digest)

    def records(self, digest: bytes) -> Records | None:
        return _first(self._catalogs(), lambda c: c.records(digest))

    def __iter__(self) -> Iterator[bytes]:
        """Every entry of every tier, once (the root's first)."""
        seen: set[bytes] = set()
        for c in self._catalogs():
            for d in c:
                if d not in seen:
                    seen.add(d)
                    yield d

    def _commit(self, rec: Records, ensure: Ensure) -> bool:
        """Commit to the root, then write the entry behind to the tiers below. A block the
        caller's ``ensure`` finds in a tier below (the composed store holds it) is written
        back into the root before the entry is visible there."""
        root = self.layers.root.blocks

        def ensured(digests: Sequence[bytes]) -> None:
            ensure(digests)
            self.blocks.hold([d for d in digests if not root.exists(d)], rec.blocks)

        created = self.layers.root.catalog.commit(rec, ensured)
        if created:
            self.layers.written(rec.digest)
        return created

    def _remove(self, digest: bytes) -> bool:
        return bool(self.remove_many([digest]))

    def remove_many(self, digests: Sequence[bytes]) -> list[bytes]:
        """Remove each entry from every tier: the root's first, then, once no copy of it to
        the tiers below is under way, theirs; those some tier held."""
        self.check_writable()
        parts = [self.layers.root.catalog.remove_many(digests)]
        for d in parts[0]:
            self.layers.pushed(d)
        parts += [t.catalog.remove_many(digests) for t in self.layers.below(writing=True)]
        return _union(parts, digests)


class ComposedBlocks(BlockStore):
    """The blocks of the root and the tiers below it, as one block store: reads from the
    root, else a tier below (the block written back into the root, verified, unless the
    root is read-only); writes to the root; deletions from every tier."""

    def __init__(self, layers: Layers) -> None:
        self.layers = layers
        root = layers.root.blocks
        self.algo = root.algo
        self.read_only = root.read_only
        self.durable = root.durable

    @property
    def _root(self) -> BlockStore:
        return self.layers.root.blocks

    # --- reads: the root, else a tier below ---------------------------------------------

    def hold(self, digests: Sequence[bytes], sizes: Mapping[bytes, int] | None = None) -> None:
        """Leave each block in the root: those only a tier below holds are written back
        (a BlockNotFoundError names one no tier holds)."""
        for d in digests:
            self._written_back(d, sizes)

    def _written_back(self, digest: bytes, sizes: Mapping[bytes, int] | None) -> None:
        """Copy ``digest`` from the first tier below that holds it into the root, verified
        (:meth:`Root.copy_blocks <kvstore.local.root.Root.copy_blocks>`)."""
        for t in self.layers.below():
            try:
                self.layers.root.copy_blocks(t.blocks, [digest], sizes)
                return
            except BlockNotFoundError:
                continue
        raise BlockNotFoundError(f"{self._root.where(digest)}: no block on any tier")

    def _below(self, digest: bytes) -> BlockStore:
        """The first tier below that holds ``digest`` (for a root that is read-only)."""
        got = _first(self.layers.below(),
                     lambda t: t.blocks if t.blocks.exists(digest) else None)
        if got is None:
            raise BlockNotFoundError(f"{self._root.where(digest)}: no block on any tier")
        return got

    def _read(self, read: Callable[[BlockStore, bytes], _T], digest: bytes,
              sizes: Mapping[bytes, int] | None = None) -> _T:
        """``read`` of the root; of a block the root lacks, once it is written back (of the
        tier below, for a read-only root). ``sizes``: what the block should hold, bounding
        what is read of a tier below."""
        try:
            return read(self._root, digest)
        except BlockNotFoundError:
            if self.read_only:
                return read(self._below(digest), digest)
        self._written_back(digest, sizes)
        return read(self._root, digest)

    def get(self, digest: bytes, *, verify: bool = True) -> bytes:
        return self._read(lambda s, d: s.get(d, verify=verify), digest)

    def get_many(self, digests: Sequence[bytes], sizes: Mapping[bytes, int] | None = None
                 ) -> Iterator[tuple[bytes, bytes]]:
        def one(s: BlockStore, d: bytes) -> bytes:
            return next(iter(s.get_many([d], sizes)))[1]

        for d in digests:
            yield d, self._read(one, d, sizes)

    def open(self, digest: bytes, size: int | None = None) -> int:
        sizes = None if size is None else {digest: size}
        return self._read(lambda blocks, d: blocks.open(d, size), digest, sizes)

    def read_into(self, digest: bytes, offset: int, out: memoryview) -> None:
        self._read(lambda s, d: s.read_into(d, offset, out), digest)

    def hash_stored(self, digest: bytes) -> bytes:
        return self._read(lambda s, d: s.hash_stored(d), digest)

    def exists(self, digest: bytes) -> bool:
        return self._root.exists(digest) or any(t.blocks.exists(digest)
                                                for t in self.layers.below())

    def stat(self, digest: bytes) -> BlockStat | None:
        here = self._root.stat(digest)
        return here if here is not None else _first(self.layers.below(),
                                                    lambda t: t.blocks.stat(digest))

    def iter(self) -> Iterator[Digest]:
        """Every block of every tier, once (the root's first)."""
        seen: set[bytes] = set()
        for s in [self._root] + [t.blocks for t in self.layers.below()]:
            for d in s.iter():
                if d not in seen:
                    seen.add(d)
                    yield d

    def where(self, digest: bytes) -> str:
        if self._root.exists(digest):
            return self._root.where(digest)
        held = _first(self.layers.below(),
                      lambda t: t.blocks if t.blocks.exists(digest) else None)
        return (held or self._root).where(digest)

    def where_all(self) -> str:
        return self._root.where_all()

    # --- writes: the root; deletions: every tier ----------------------------------------

    def _put(self, digest: bytes, pieces: Sequence[Buffer]) -> bool:
        return self._root.put(digest, pieces)

    def put_many(self, blocks: Iterable[tuple[bytes, Sequence[Buffer]]]) -> list[bool]:
        return self._root.put_many(blocks)

    def _delete(self, digest: bytes) -> bool:
        return bool(self._from_every_tier([digest]))

    def delete_many(self, digests: Sequence[bytes]) -> list[bytes]:
        """Delete each block from every tier; those some tier held."""
        self.check_writable()
        return self._from_every_tier(digests)

    def _from_every_tier(self, digests: Sequence[bytes]) -> list[bytes]:
        tiers = [self.layers.root, *self.layers.below(writing=True)]
        return _union([t.blocks.delete_many(digests) for t in tiers], digests)

    def freshen(self, digest: bytes) -> bool:
        return self._root.freshen(digest)

    def stage(self, pieces: Sequence[Buffer], *, sync: bool = False) -> Staged:
        return self._root.stage(pieces, sync=sync)

    def sync_staged(self, staged: Staged) -> None:
        self._root.sync_staged(staged)

    def publish(self, staged: Staged, digest: bytes) -> bool:
        return self._root.publish(staged, digest)

    def discard(self, staged: Staged) -> None:
        self._root.discard(staged)

    def sync_published(self, digests: Iterable[bytes]) -> None:
        self._root.sync_published(digests)

    def quarantine(self, digest: bytes) -> str | None:
        return self._root.quarantine(digest)

    def inspect(self, digest: bytes, size: int, *, read_data: bool) -> tuple[str, str, int]:
        return self._root.inspect(digest, size, read_data=read_data)


__all__ = ["ComposedBlocks", "ComposedCatalog", "ComposedReader", "Layers"]
