"""The local-files backend passes the shared block-store suite."""

from __future__ import annotations

from pathlib import Path

import pytest
from blocks.blockstore_suite import BlockStoreTests

from kvstore.blocks.base import BlockStore
from kvstore.local.blocks import LocalBlockStore


class TestLocalBlockStore(BlockStoreTests):
    @pytest.fixture(params=["blake3", "sha256"])
    def store(self, tmp_path: Path, request: pytest.FixtureRequest) -> BlockStore:
        for sub in ("blocks", "tmp"):
            (tmp_path / sub).mkdir()
        return LocalBlockStore(tmp_path, request.param, durable=False)

    def corrupt(self, store: BlockStore, digest: bytes, data: bytes) -> None:
        assert isinstance(store, LocalBlockStore)
        store.path(digest).write_bytes(data)

    def read_only(self, store: BlockStore) -> BlockStore:
        assert isinstance(store, LocalBlockStore)
        return LocalBlockStore(store.root, store.algo, durable=False, read_only=True)
