"""The composed tier's block store (``Tiers.blocks``: a root above a second root) passes the
shared block-store suite, and what only it does: a block only the tier below holds is read
through it and written back into the root, verified; a deletion reaches every tier."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from blocks.blockstore_suite import BlockStoreTests, block
from helpers.composed import BELOW, ComposedBlocksCase, Opened

from kvstore.blocks import hash_bytes
from kvstore.blocks.base import BlockStore
from kvstore.errors import BlockNotFoundError, CorruptBlockError
from kvstore.local import Root
from kvstore.store.tiers import Tiers


@pytest.fixture
def below(opened: Opened, tmp_path: Path) -> Root:
    return opened.root(tmp_path / "below", name=BELOW)


@pytest.fixture
def tiers(opened: Opened, tmp_path: Path, below: Root) -> Tiers:
    return opened.tiers(opened.root(tmp_path / "top"), [below])


class TestComposedBlocks(ComposedBlocksCase, BlockStoreTests):
    @pytest.fixture(params=["blake3", "sha256"])
    def store(self, opened: Opened, tmp_path: Path, request: pytest.FixtureRequest
              ) -> BlockStore:
        self.opened = opened  # the test's own instance: read_only opens through it
        algo = request.param
        below = opened.root(tmp_path / "below", name=BELOW, hash=algo)
        return opened.tiers(opened.root(tmp_path / "top", hash=algo), [below]).blocks


def _files(root: Root) -> dict[str, bytes]:
    """Every file under the root's blocks/ and tmp/, by its path there."""
    out = {}
    for sub in ("blocks", "tmp"):
        for dirpath, _, names in os.walk(root.path / sub):
            for n in names:
                p = Path(dirpath) / n
                out[str(p.relative_to(root.path))] = p.read_bytes()
    return out


def test_a_block_only_below_is_read_and_written_back(tiers: Tiers, below: Root) -> None:
    data, other = block(1), block(2)
    d, o = hash_bytes("blake3", data), hash_bytes("blake3", other)
    below.blocks.put(d, [data])
    below.blocks.put(o, [other])
    assert _files(tiers.root) == {}
    assert tiers.blocks.exists(d) and tiers.blocks.get(d) == data
    assert _files(tiers.root) == {f"blocks/{d.hex()[:2]}/{d.hex()}": data}  # that block only
    assert tiers.root.blocks.where(d) == tiers.blocks.where(d)
    assert sorted(tiers.blocks.iter()) == sorted([d, o])


def test_each_read_of_a_block_below_writes_it_back(tiers: Tiers, below: Root) -> None:
    blobs = [block(10 + i, 300) for i in range(4)]
    ds = [hash_bytes("blake3", b) for b in blobs]
    for d, b in zip(ds, blobs, strict=True):
        below.blocks.put(d, [b])
    assert list(tiers.blocks.get_many(ds[:2], {ds[0]: 300, ds[1]: 300})) == list(
        zip(ds[:2], blobs[:2], strict=True))
    fd = tiers.blocks.open(ds[2], 300)
    try:
        assert os.pread(fd, 301, 0) == blobs[2]
    finally:
        os.close(fd)
    out = bytearray(10)
    tiers.blocks.read_into(ds[3], 5, memoryview(out))
    assert bytes(out) == blobs[3][5:15]
    assert sorted(tiers.root.blocks.iter()) == sorted(ds)


def test_a_corrupt_block_below_is_never_written_back(tiers: Tiers, below: Root) -> None:
    data = block(21)
    d = hash_bytes("blake3", data)
    below.blocks.put(d, [data])
    below.blocks.path(d).write_bytes(data[:-1] + b"\x00")
    with pytest.raises(CorruptBlockError) as e:
        tiers.blocks.get(d)
    assert e.value.where == below.blocks.where(d)
    assert list(tiers.root.blocks.iter()) == []


def test_a_read_only_root_reads_below_without_writing_back(opened: Opened, tiers: Tiers,
                                                           below: Root) -> None:
    data = block(22)
    d = hash_bytes("blake3", data)
    below.blocks.put(d, [data])
    ro = opened.read_only_tiers(tiers).blocks
    assert ro.get(d) == data
    assert list(tiers.root.blocks.iter()) == []


def test_a_delete_reaches_every_tier(tiers: Tiers, below: Root) -> None:
    blobs = [block(30 + i, 200) for i in range(3)]
    ds = [hash_bytes("blake3", b) for b in blobs]
    tiers.root.blocks.put(ds[0], [blobs[0]])
    below.blocks.put(ds[0], [blobs[0]])
    below.blocks.put(ds[1], [blobs[1]])
    never = hash_bytes("blake3", b"never")
    assert tiers.blocks.delete_many([ds[1], never, ds[0]]) == [ds[1], ds[0]]
    assert tiers.blocks.delete(ds[0]) is False
    assert list(tiers.root.blocks.iter()) == [] and list(below.blocks.iter()) == []
    with pytest.raises(BlockNotFoundError):
        tiers.blocks.get(ds[1])
