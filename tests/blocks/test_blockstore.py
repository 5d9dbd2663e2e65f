"""BlockStore alone: content addressing, immutability, validation, corruption, listing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstore.blocks import from_hex, hash_bytes
from kvstore.errors import BlockNotFoundError, CorruptBlockError, InvalidDigestError
from kvstore.local.blocks import LocalBlockStore


@pytest.fixture(params=["blake3", "sha256"])
def blocks(tmp_path: Path, request: pytest.FixtureRequest) -> LocalBlockStore:
    for sub in ("blocks", "tmp"):
        (tmp_path / sub).mkdir()
    return LocalBlockStore(tmp_path, request.param, durable=True)


def test_put_get_and_layout(blocks: LocalBlockStore) -> None:
    data = [b"hello ", memoryview(b"world")]
    d = hash_bytes(blocks.algo, *data)
    assert blocks.put(d, data) is True
    path = blocks.path(d)
    assert path == blocks.root / "blocks" / d.hex()[:2] / d.hex()
    assert blocks.get(d) == b"hello world"
    assert blocks.size(d) == 11 and blocks.exists(d)
    assert list(blocks) == [d]
    assert not any(blocks.tmp_dir.iterdir())


def test_an_existing_block_is_never_rewritten(blocks: LocalBlockStore) -> None:
    d = hash_bytes(blocks.algo, b"x" * 100)
    blocks.put(d, [b"x" * 100])
    ino = blocks.path(d).stat().st_ino
    assert blocks.put(d, [b"x" * 100]) is False
    # even a racing writer that got past the existence check links nothing over it
    created = blocks.publish(blocks.stage([b"other bytes"]), d)
    assert created is False
    assert blocks.path(d).stat().st_ino == ino and blocks.get(d) == b"x" * 100
    assert not any(blocks.tmp_dir.iterdir())


def test_corruption_carries_both_digests(blocks: LocalBlockStore) -> None:
    d = hash_bytes(blocks.algo, b"payload")
    blocks.put(d, [b"payload"])
    p = blocks.path(d)
    os.chmod(p, 0o644)
    p.write_bytes(b"paYload")
    with pytest.raises(CorruptBlockError) as e:
        blocks.get(d)
    assert e.value.expected == d.hex()
    assert e.value.actual == hash_bytes(blocks.algo, b"paYload").hex()
    assert blocks.get(d, verify=False) == b"paYload"
    assert blocks.quarantine(d) == str(blocks.root / "quarantine" / d.hex())
    with pytest.raises(BlockNotFoundError):
        blocks.get(d)


@pytest.mark.parametrize(
    "bad", ["../../config", "ab" * 31, "AB" * 32, "g" * 64, "ab" * 32 + "\n", ""]
)
def test_hex_is_validated_before_any_path_is_built(bad: str) -> None:
    with pytest.raises(InvalidDigestError):
        from_hex(bad)


def test_raw_digests_are_validated(blocks: LocalBlockStore) -> None:
    for bad in (b"../../config", b"", b"x" * 31, b"x" * 33):
        with pytest.raises(InvalidDigestError):
            blocks.path(bad)


def test_listing_skips_foreign_files(blocks: LocalBlockStore) -> None:
    d = hash_bytes(blocks.algo, b"a")
    blocks.put(d, [b"a"])
    (blocks.blocks_dir / "README").write_text("not a block")
    fan = blocks.blocks_dir / d.hex()[:2]
    (fan / "notes.txt").write_text("x")
    (blocks.blocks_dir / "zz").mkdir()
    assert list(blocks) == [d]


def test_delete(blocks: LocalBlockStore) -> None:
    d = hash_bytes(blocks.algo, b"gone")
    blocks.put(d, [b"gone"])
    assert blocks.delete(d) is True and blocks.delete(d) is False
    with pytest.raises(BlockNotFoundError):
        blocks.open(d)
