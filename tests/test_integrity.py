"""Verified reads: a block whose bytes do not match its digest is never returned (issue 12).

A flipped byte, a truncated block, a block swapped for another block's bytes and
a block file that is not a regular file (a symlink, a FIFO, a directory: issue
17) are each caught by the default ``restore``, ``load``, ``load_entry`` and
``export``: the block is quarantined, the entries that need it are dropped (or
cut back to their intact prefix), one warning names them, and the caller gets
the longest intact prefix still stored or a miss, never wrong bytes.

Only the public API and the root layout of docs/FORMAT.md (§1) are used here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from helpers.kv import make_cache, matches

import kvstore
from kvstore.errors import CorruptBlockError

NS = kvstore.Namespace(model_id="integrity", config_fingerprint="cfg", tokenizer_hash="tok")
T = 16  # block_tokens of every root here
DAMAGES = ["flip", "truncate", "swap", "symlink", "fifo", "directory"]


# --- helpers ----------------------------------------------------------------------------


def holds(cache: list[Any] | None, tokens: Sequence[int], length: int) -> bool:
    """True when ``cache`` holds exactly the rows of ``tokens[:length]``."""
    return cache is not None and matches(cache, tokens, length)


def toks(n: int, seed: int = 1) -> list[int]:
    return [(seed * 7919 + i * 104729) % 30000 + 1 for i in range(n)]


def open_store(root: Path, **kw: Any) -> kvstore.Store:
    return kvstore.Store.open(root, namespace=NS, block_tokens=T, durable=False, **kw)


def block_file(root: Path, digest: bytes) -> Path:
    hx = digest.hex()
    return root / "blocks" / hx[:2] / hx


def damage(root: Path, digest: bytes, how: str, other: bytes, outside: Path) -> None:
    """Spoil block ``digest`` in place; ``other`` is another block of the same size."""
    path = block_file(root, digest)
    data = path.read_bytes()
    if how == "flip":
        spoiled = bytearray(data)
        spoiled[len(spoiled) // 2] ^= 0x10
        path.write_bytes(bytes(spoiled))
    elif how == "truncate":
        path.write_bytes(data[:-7])
    elif how == "swap":
        swapped = block_file(root, other).read_bytes()
        assert len(swapped) == len(data) and swapped != data
        path.write_bytes(swapped)
    elif how == "symlink":  # to a file outside the root, of the right size, other bytes
        outside.write_bytes(block_file(root, other).read_bytes())
        path.unlink()
        path.symlink_to(outside)
    elif how == "fifo":
        path.unlink()
        os.mkfifo(path)
    elif how == "directory":
        path.unlink()
        path.mkdir()
        (path / "x").write_bytes(data)
    else:  # pragma: no cover
        raise AssertionError(how)


def quarantined(root: Path, digest: bytes) -> bool:
    """The block's name is gone from blocks/ and sits in quarantine/."""
    q = root / "quarantine" / digest.hex()
    return os.path.lexists(q) and not os.path.lexists(block_file(root, digest))


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("kvstore") and r.levelno >= 30]


def exact_refcounts(s: kvstore.Store) -> None:
    """verify --read-data is sound: refcounts, keys and totals agree with the manifests."""
    r = s.verify(read_data=True)
    assert r.sound, r


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A file outside the root that a symlinked block points at; must stay untouched."""
    d = tmp_path / "outside"
    d.mkdir()
    return d / "target"


@pytest.fixture
def two(tmp_path: Path) -> tuple[Path, list[int], str, str]:
    """A root holding ``long`` (80 tokens, 5 blocks) and ``short`` (its first 32 tokens)."""
    root = tmp_path / "root"
    long = toks(80)
    with open_store(root) as s:
        long_id = s.save(long, make_cache(long)).id
        short_id = s.save(long[:32], make_cache(long[:32])).id
    return root, long, long_id, short_id


def blocks_of(root: Path, entry_id: str) -> list[bytes]:
    with open_store(root) as s:
        return [bytes(d) for d in s.manifest(entry_id).token_blocks]


# --- the default restore --------------------------------------------------------------------

CHILD_RESTORE = textwrap.dedent(
    """
    import json, logging, sys
    sys.path.insert(0, sys.argv[1])
    import test_integrity as t
    logging.basicConfig(level=logging.WARNING)
    root = t.Path(sys.argv[2])
    tokens = json.loads(sys.argv[3])
    with t.open_store(root) as s:
        cache, n = s.restore(tokens)
        print(json.dumps({"n": n, "holds": t.holds(cache, tokens, n)}))
    """
)


def restore_in_child(root: Path, tokens: Sequence[int]) -> tuple[dict[str, Any], str]:
    """Restore in a fresh process (a hang is a failure, not a stuck suite)."""
    here = str(Path(__file__).resolve().parent)
    try:
        p = subprocess.run(
            [sys.executable, "-c", CHILD_RESTORE, here, str(root), json.dumps(list(tokens))],
            capture_output=True, text=True, timeout=30, cwd=root.parent,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("restore hung (a FIFO in place of a block must be a miss, not a hang)")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


@pytest.mark.parametrize("how", DAMAGES)
def test_default_restore_returns_the_intact_prefix_and_quarantines(
    two: tuple[Path, list[int], str, str],
    how: str,
    outside: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    root, long, long_id, short_id = two
    blocks = blocks_of(root, long_id)
    bad = blocks[2]
    damage(root, bad, how, blocks[3], outside)
    before = outside.read_bytes() if outside.exists() else None
    if how == "fifo":
        got, err = restore_in_child(root, long)
        n, ok = got["n"], got["holds"]
        assert err.count("WARNING") == 1 and bad.hex() in err
    else:
        caplog.set_level(logging.WARNING, logger="kvstore")
        with open_store(root) as s:  # a fresh open: nothing cached from the save
            cache, n = s.restore(long)
            ok = holds(cache, long, n)
        warned = warnings_of(caplog)
        assert len(warned) == 1, [r.getMessage() for r in warned]
        assert bad.hex() in warned[0].getMessage() and long_id in warned[0].getMessage()
    # the longest intact prefix still stored: ``short``; never the damaged rows
    assert n == 32 and ok
    assert quarantined(root, bad)
    with open_store(root) as s:
        ids = {e.id for e in s.entries()}
        assert long_id not in ids and short_id in ids
        exact_refcounts(s)
        cache, n = s.restore(long)  # now a plain hit on the intact prefix, no warning
        assert n == 32 and holds(cache, long, 32)
    if before is not None:
        assert outside.read_bytes() == before  # the symlink's target was never touched


def test_a_restore_that_retries_past_a_bad_block_counts_one_lookup_and_one_hit(
    two: tuple[Path, list[int], str, str], outside: Path
) -> None:
    root, long, long_id, _ = two
    blocks = blocks_of(root, long_id)
    damage(root, blocks[2], "flip", blocks[3], outside)
    with open_store(root) as s:
        cache, n = s.restore(long)  # finds long, loses it to the bad block, finds short
        assert n == 32 and holds(cache, long, n)
    with open_store(root) as s:
        st = s.stats()
        assert (st.lookups, st.hits) == (1, 1)


def test_a_lone_entry_is_cut_back_to_its_intact_blocks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "root"
    long = toks(80)
    with open_store(root) as s:
        long_id = s.save(long, make_cache(long)).id
        bad = bytes(s.manifest(long_id).token_blocks[3])
    damage(root, bad, "flip", b"", tmp_path / "unused")
    caplog.set_level(logging.WARNING, logger="kvstore")
    with open_store(root) as s:
        cache, n = s.restore(long)
        assert n == 48 and holds(cache, long, 48)
        (entry,) = list(s.entries())
        assert entry.n_tokens == 48 and entry.id != long_id
        exact_refcounts(s)
    assert len(warnings_of(caplog)) == 1 and quarantined(root, bad)


def test_a_bad_first_block_is_a_miss(tmp_path: Path) -> None:
    root = tmp_path / "root"
    long = toks(40)
    with open_store(root) as s:
        long_id = s.save(long, make_cache(long)).id
        bad = bytes(s.manifest(long_id).token_blocks[0])
    damage(root, bad, "flip", b"", tmp_path / "unused")
    with open_store(root) as s:
        assert s.restore(long) == (None, 0)
        assert list(s.entries()) == []
        exact_refcounts(s)
    assert quarantined(root, bad)


def test_one_warning_names_every_entry_that_needed_the_block(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Three entries share block 1; after it goes bad each is cut to its first block."""
    root = tmp_path / "root"
    base = toks(32)
    a, b, c = base + toks(20, 2), base + toks(30, 3), base + toks(40, 4)
    with open_store(root) as s:
        ids = [s.save(x, make_cache(x)).id for x in (a, b, c)]
        bad = bytes(s.manifest(ids[0]).token_blocks[1])
        assert all(bytes(s.manifest(i).token_blocks[1]) == bad for i in ids)
    damage(root, bad, "flip", b"", tmp_path / "unused")
    caplog.set_level(logging.WARNING, logger="kvstore")
    with open_store(root) as s:
        cache, n = s.restore(b)
        assert n == 16 and holds(cache, b, 16)
        msg = [r.getMessage() for r in warnings_of(caplog)]
        assert len(msg) == 1 and bad.hex() in msg[0] and all(i in msg[0] for i in ids), msg
        # the three entries share one intact prefix: one entry keeps it, the others go
        assert [e.n_tokens for e in s.entries()] == [16]
        for x in (a, c):
            cache, n = s.restore(x)
            assert n == 16 and holds(cache, x, 16)
        exact_refcounts(s)


# --- load, load_entry, export ---------------------------------------------------------------


@pytest.mark.parametrize("how", ["flip", "truncate", "swap", "symlink", "directory"])
def test_default_load_raises_corrupt_block_error_naming_the_block(
    two: tuple[Path, list[int], str, str], how: str, outside: Path
) -> None:
    root, long, long_id, _ = two
    blocks = blocks_of(root, long_id)
    with open_store(root) as s:
        match = s.lookup(long)
        assert match is not None and match.entry_id == long_id
        damage(root, blocks[4], how, blocks[3], outside)
        with pytest.raises(CorruptBlockError) as e:
            s.load(match)
        assert blocks[4].hex() in str(e.value)
        assert quarantined(root, blocks[4])
        m = s.lookup(long)  # the entry was cut back: blocks 0-3 still serve
        assert m is not None and m.length == 64
        assert holds(s.load(m), long, 64)
        exact_refcounts(s)


@pytest.mark.parametrize("how", ["flip", "truncate", "swap", "symlink", "directory"])
def test_load_entry_and_export_fail_naming_the_block(
    two: tuple[Path, list[int], str, str], how: str, outside: Path, tmp_path: Path
) -> None:
    root, long, long_id, _ = two
    blocks = blocks_of(root, long_id)
    damage(root, blocks[1], how, blocks[3], outside)
    out = tmp_path / "out.kv"
    with open_store(root) as s:
        with pytest.raises(CorruptBlockError) as e:
            s.export(long_id, out)
        assert blocks[1].hex() in str(e.value)
        assert not out.exists()
        assert quarantined(root, blocks[1])
        exact_refcounts(s)
    with open_store(root) as s:  # after that, an entry that still needs it cannot be read
        for e in s.entries():
            assert blocks[1] not in [bytes(d) for d in s.manifest(e.id).token_blocks]


def test_load_entry_fails_and_a_second_read_finds_no_entry(
    two: tuple[Path, list[int], str, str]
) -> None:
    root, long, long_id, _ = two
    blocks = blocks_of(root, long_id)
    damage(root, blocks[3], "swap", blocks[4], root.parent / "unused")
    with open_store(root) as s:
        with pytest.raises(CorruptBlockError):
            s.load_entry(long_id)
        with pytest.raises(kvstore.errors.EntryNotFoundError):
            s.load_entry(long_id)


def test_cli_export_refuses_to_launder_a_corrupt_block(
    two: tuple[Path, list[int], str, str], tmp_path: Path
) -> None:
    """The issue's reproduction: export must not write fresh hashes over damaged bytes."""
    root, _, long_id, _ = two
    blocks = blocks_of(root, long_id)
    damage(root, blocks[2], "flip", b"", tmp_path / "unused")
    out = tmp_path / "laundered.kv"
    p = subprocess.run([sys.executable, "-m", "kvstore", "export", long_id, str(out),
                        "--root", str(root)], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert p.returncode != 0 and not out.exists()
    assert blocks[2].hex() in p.stderr and "Traceback" not in p.stderr


def test_import_of_a_v5_file_with_a_bad_block_names_the_block(
    two: tuple[Path, list[int], str, str], tmp_path: Path
) -> None:
    root, _, long_id, _ = two
    v5 = tmp_path / "v5" / "entry.json"
    v5.parent.mkdir()
    with open_store(root) as s:
        s.export(long_id, v5, format="v5")
    bad = sorted((v5.parent / "blocks").iterdir())[0]
    data = bytearray(bad.read_bytes())
    data[3] ^= 1
    bad.write_bytes(bytes(data))
    with open_store(tmp_path / "other") as s:
        with pytest.raises(CorruptBlockError) as e:
            s.import_file(v5)
        assert bad.name in str(e.value)
        assert list(s.entries()) == []


def test_import_of_a_v5_file_with_a_symlinked_block_is_refused(
    two: tuple[Path, list[int], str, str], tmp_path: Path, outside: Path
) -> None:
    """The error names the block; it does not print the digest of the file it points at."""
    root, _, long_id, _ = two
    v5 = tmp_path / "v5" / "entry.json"
    v5.parent.mkdir()
    with open_store(root) as s:
        s.export(long_id, v5, format="v5")
    bad = sorted((v5.parent / "blocks").iterdir())[0]
    size = bad.stat().st_size
    outside.write_bytes(b"\x5a" * size)
    bad.unlink()
    bad.symlink_to(outside)
    with open_store(tmp_path / "other") as s:
        with pytest.raises(kvstore.errors.KVStoreError) as e:
            s.import_file(v5)
        assert bad.name in str(e.value)
        assert hashlib.sha256(outside.read_bytes()).hexdigest() not in str(e.value)
        assert list(s.entries()) == []


# --- the raw-speed switch --------------------------------------------------------------------


def test_verify_reads_false_skips_the_check_and_verify_true_still_catches(
    two: tuple[Path, list[int], str, str]
) -> None:
    root, long, long_id, _ = two
    blocks = blocks_of(root, long_id)
    damage(root, blocks[2], "flip", b"", root.parent / "unused")
    with open_store(root, verify_reads=False) as s:
        cache, n = s.restore(long)  # raw speed, and the risk the docs name: damaged rows
        assert n == 80 and not holds(cache, long, 80)
        assert not quarantined(root, blocks[2])
        cache, n = s.restore(long, verify=True)  # the per-call switch still works
        assert n == 32 and holds(cache, long, 32)
    assert quarantined(root, blocks[2])


def test_verify_false_per_call_on_a_default_store(two: tuple[Path, list[int], str, str]) -> None:
    root, long, long_id, _ = two
    blocks = blocks_of(root, long_id)
    damage(root, blocks[2], "flip", b"", root.parent / "unused")
    with open_store(root) as s:
        cache, n = s.restore(long, verify=False)
        assert n == 80 and not holds(cache, long, 80)
        assert os.path.isfile(block_file(root, blocks[2]))


# --- verify --read-data -------------------------------------------------------------------------


STRUCTURAL = {"truncate", "symlink", "fifo", "directory"}  # seen without reading the data


def run_cli(*args: str | Path, cwd: Path, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run([sys.executable, "-m", "kvstore", *map(str, args)],
                              capture_output=True, text=True, timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired:
        pytest.fail(f"kvstore {' '.join(map(str, args))} hung")


@pytest.mark.parametrize("how", DAMAGES)
def test_verify_catches_each_damage(
    two: tuple[Path, list[int], str, str], how: str, outside: Path
) -> None:
    root, _, long_id, _ = two
    blocks = blocks_of(root, long_id)
    damage(root, blocks[2], how, blocks[3], outside)
    flags = [["--read-data"], []] if how in STRUCTURAL else [["--read-data"]]
    for extra in flags:
        p = run_cli("verify", *extra, "--json", "--root", root, cwd=root.parent, timeout=30)
        assert p.returncode == 1, (extra, p.stdout, p.stderr)
        report = json.loads(p.stdout)["report"]
        assert report["corrupt_blocks"] == [blocks[2].hex()], extra


# --- across two processes ---------------------------------------------------------------


@pytest.mark.parametrize("how", ["flip", "truncate", "swap"])
def test_a_child_restores_what_the_parent_saved_and_spoiled(
    two: tuple[Path, list[int], str, str], how: str
) -> None:
    root, long, long_id, short_id = two
    blocks = blocks_of(root, long_id)
    damage(root, blocks[3], how, blocks[4], root.parent / "unused")
    got, err = restore_in_child(root, long)
    assert got == {"n": 48, "holds": True}, err
    assert err.count("WARNING") == 1 and blocks[3].hex() in err
    assert quarantined(root, blocks[3])
    with open_store(root) as s:
        m = s.lookup(long)
        assert m is not None and m.length == 48
        exact_refcounts(s)


CHILD_SAVE_AND_SPOIL = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import test_integrity as t
    root = t.Path(sys.argv[2])
    how = sys.argv[3]
    tokens = t.toks(80, 9)
    with t.open_store(root) as s:
        eid = s.save(tokens, t.make_cache(tokens)).id
        blocks = [bytes(d) for d in s.manifest(eid).token_blocks]
    t.damage(root, blocks[1], how, blocks[2], root.parent / "unused")
    print(json.dumps({"id": eid, "bad": blocks[1].hex(), "tokens": tokens}))
    """
)


@pytest.mark.parametrize("how", ["flip", "truncate", "swap"])
def test_the_parent_restores_what_a_child_saved_and_spoiled(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "root"
    with open_store(root):
        pass
    here = str(Path(__file__).resolve().parent)
    p = subprocess.run([sys.executable, "-c", CHILD_SAVE_AND_SPOIL, here, str(root), how],
                       capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    child = json.loads(p.stdout.strip().splitlines()[-1])
    caplog.set_level(logging.WARNING, logger="kvstore")
    with open_store(root) as s:
        cache, n = s.restore(child["tokens"])
        assert n == 16 and holds(cache, child["tokens"], 16)
        exact_refcounts(s)
    assert len(warnings_of(caplog)) == 1
    assert quarantined(root, bytes.fromhex(child["bad"]))
