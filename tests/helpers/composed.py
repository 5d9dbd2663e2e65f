"""Roots and the composed tier (``Tiers``) over them, for the shared suites run on it
(tests/catalog/test_composed_catalog.py, tests/blocks/test_composed_blocks.py,
tests/remote/test_composed_remote.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvstore.blocks import LocalBlockStore
from kvstore.catalog.base import Tier
from kvstore.index import Index
from kvstore.store.local.root import Root, open_root
from kvstore.store.tiers import Tiers

BELOW = "below"  # the name of a root below the composed tier's own


class Opened:
    """What a test opened: closed in reverse order at its end."""

    def __init__(self) -> None:
        self.opened: list[Tiers] = []
        self.indexes: list[Index] = []

    def root(self, path: Path, *, name: str = "local", hash: str = "blake3",
             block_tokens: int = 4) -> Root:
        """A fresh root at ``path`` (named ``name``: another than "local" below the top)."""
        index, settings, _ = open_root(path, hash=hash, block_tokens=block_tokens,
                                       state_block_bytes=None, durable=False, create=True,
                                       map_size=1 << 26)
        self.indexes.append(index)
        return Root(path, settings, index, LocalBlockStore(path, hash, durable=False),
                    name=name)

    def read_only(self, root: Root) -> Root:
        """``root`` opened again, read-only."""
        index = Index(root.path / "index", readonly=True)
        self.indexes.append(index)
        blocks = LocalBlockStore(root.path, root.blocks.algo, durable=False, read_only=True)
        return Root(root.path, root.settings, index, blocks, name=root.name)

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
        for i in reversed(self.indexes):
            i.close()
