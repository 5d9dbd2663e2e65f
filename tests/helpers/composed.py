"""Roots and the composed tier (``Tiers``) over them, for the shared suites run on it
(tests/catalog/test_composed_catalog.py, tests/blocks/test_composed_blocks.py,
tests/remote/test_composed_remote.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from kvstore.blocks.base import BlockStore
from kvstore.catalog.base import Catalog, Tier
from kvstore.local import LocalBlockStore, Root
from kvstore.store.composed import ComposedBlocks
from kvstore.store.tiers import Tiers

BELOW = "below"  # the name of a root below the composed tier's own


class Opened:
    """What a test opened: closed in reverse order at its end."""

    def __init__(self) -> None:
        self.opened: list[Tiers] = []
        self.roots: list[Root] = []

    def root(self, path: Path, *, name: str = "local", hash: str = "blake3",
             block_tokens: int = 4, read_only: bool | None = None) -> Root:
        """The root at ``path``, made when new (named ``name``: another than "local" below
        the top)."""
        r = Root.open(path, hash=hash, block_tokens=block_tokens, durable=False,
                      map_size=1 << 26, read_only=read_only, create=not read_only,
                      name=name)
        self.roots.append(r)
        return r

    def read_only(self, root: Root) -> Root:
        """``root`` opened again, read-only."""
        return self.root(root.path, name=root.name, hash=root.settings.hash,
                         block_tokens=root.settings.block_tokens, read_only=True)

    def tiers(self, root: Root, lower: Sequence[Tier]) -> Tiers:
        t = Tiers(root, lower)
        self.opened.append(t)
        return t

    def read_only_tiers(self, tiers: Tiers) -> Tiers:
        """The same tiers, their root opened read-only. Not closed: closing it would close
        the tiers below, which ``tiers`` owns (its idle threads go with it)."""
        return Tiers(self.read_only(tiers.root), tiers.lower)

    def close(self) -> None:
        for t in reversed(self.opened):
            t.close(5)
        for r in reversed(self.roots):
            r.close()


class ComposedCatalogCase:
    """The shared catalog suite's hooks over a composed tier (the module's ``tiers``
    fixture): mix in before ``CatalogTests``."""

    opened: Opened

    @pytest.fixture
    def tier(self, tiers: Tiers, opened: Opened) -> Tier:
        self.opened = opened  # the test's own instance: read_only opens through it
        return tiers

    def read_only(self, tier: Tier) -> Catalog:
        assert isinstance(tier, Tiers)
        return self.opened.read_only_tiers(tier).catalog


class ComposedBlocksCase:
    """The shared block-store suite's hooks over a composed tier's blocks (the subclass's
    ``store`` fixture sets ``opened``): mix in before ``BlockStoreTests``."""

    opened: Opened

    def corrupt(self, store: BlockStore, digest: bytes, data: bytes) -> None:
        assert isinstance(store, ComposedBlocks)
        root = store.layers.root.blocks
        assert isinstance(root, LocalBlockStore)
        root.path(digest).write_bytes(data)

    def read_only(self, store: BlockStore) -> BlockStore:
        assert isinstance(store, ComposedBlocks) and isinstance(store.layers, Tiers)
        return self.opened.read_only_tiers(store.layers).blocks
