"""The Store: lookup semantics, dedup, partial reads, and clear errors for bad input."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from factories import arrays_cache, kv_cache, prefix_cache, same_bits

import kvstore
from kvstore.errors import InvalidDigestError

NS = kvstore.Namespace(model_id="tiny", config_fingerprint="cfg", tokenizer_hash="tok")


@pytest.fixture
def store(tmp_path: Path):
    with kvstore.Store.open(tmp_path / "root", namespace=NS, block_tokens=16) as s:
        yield s


def test_dedup_of_a_shared_prefix(tmp_path: Path) -> None:
    prefix = list(range(2048))
    with kvstore.Store.open(tmp_path / "root", namespace=NS) as store:  # default 256 tokens
        for i in range(20):
            suffix = [2048 + 512 * i + j for j in range(512)]
            tokens = prefix + suffix
            info = store.save(tokens, [prefix_cache(tokens)])
            assert info.n_tokens == 2560
        s = store.stats()
        row = 2 * 2 * 32 * 2  # keys + values, H=2, D=32, bf16
        ideal = 2048 * row + 20 * 512 * row
        assert s.entries == 20
        assert s.logical_bytes == 20 * 2560 * row
        assert ideal <= s.physical_bytes <= 1.1 * ideal
        assert s.dedup_ratio == pytest.approx(s.logical_bytes / s.physical_bytes)
        # and every entry restores to its own suffix
        tokens = prefix + [2048 + 512 * 7 + j for j in range(512)]
        (c,), n = store.restore(tokens)
        assert n == 2560
        assert same_bits(c.keys[..., :n, :], prefix_cache(tokens).keys[..., :n, :])


def test_longest_prefix_wins_and_namespaces_never_mix(store: kvstore.Store) -> None:
    a = list(range(100))
    b = a[:40] + list(range(500, 560))
    store.save(a, [prefix_cache(a)])
    info_b = store.save(b, [prefix_cache(b)])
    q = b[:50] + [1, 2, 3]
    m = store.lookup(q)
    assert m is not None and m.entry_id == info_b.id and m.length == 50
    q = a[:40] + [9999]
    m = store.lookup(q)
    assert m is not None and m.length == 40
    other = kvstore.Namespace(model_id="tiny", config_fingerprint="cfg2", tokenizer_hash="tok")
    assert store.lookup(a, namespace=other) is None
    assert store.lookup(a, namespace=kvstore.Namespace(model_id="tiny2")) is None
    store.save(a, [prefix_cache(a)], namespace=other)
    assert store.lookup(a, namespace=other) is not None
    assert store.stats().entries == 3


def test_query_longer_than_entry_and_exact_flag(store: kvstore.Store) -> None:
    a = list(range(37))
    store.save(a, [prefix_cache(a)])
    m = store.lookup(a + [5, 6, 7])
    assert m is not None and m.length == 37 and not m.exact
    m = store.lookup(a)
    assert m is not None and m.exact
    m = store.lookup(a[:30])
    assert m is not None and m.length == 30 and not m.exact and m.n_tokens == 37
    (c,), n = store.restore(a[:30])
    assert n == 30 and c.offset == 30
    assert same_bits(c.keys[..., :30, :], prefix_cache(a).keys[..., :30, :])
    assert store.lookup([4000, 4001]) is None
    assert store.restore([4000, 4001]) == (None, 0)


def test_many_entries_share_one_key_and_the_best_is_found(store: kvstore.Store) -> None:
    # 60 entries sharing their first block, then diverging at every position:
    # the sorted prefix values must still give the longest extension.
    base = list(range(16))
    for i in range(60):
        toks = base + [1000 + i] * (i % 7 + 1) + [2000 + i]
        store.save(toks, [prefix_cache(toks)])
    target = base + [1000 + 33] * (33 % 7 + 1) + [2000 + 33]
    m = store.lookup(target + [77, 78])
    assert m is not None and m.length == len(target)


def test_restoring_a_prefix_reads_only_its_blocks(store: kvstore.Store) -> None:
    toks = list(range(80))  # 5 blocks of 16
    store.save(toks, [prefix_cache(toks)])
    man = store.manifest(store.lookup(toks).entry_id)  # type: ignore[union-attr]
    assert len(man.token_blocks) == 5
    for d in man.token_blocks[2:]:
        os.unlink(store.local.blocks.path(d))  # blocks 3.. are gone
    (c,), n = store.restore(toks[:32] + [5000])
    assert n == 32
    assert same_bits(c.keys[..., :32, :], prefix_cache(toks).keys[..., :32, :])
    # the full entry needs them: a clean miss, not a crash
    assert store.restore(toks) == (None, 0)
    with pytest.raises(kvstore.BlockNotFoundError):
        store.load(store.lookup(toks))  # type: ignore[arg-type]


def test_truncated_or_flipped_block_gives_the_intact_prefix_and_is_quarantined(
    store: kvstore.Store,
) -> None:
    toks = list(range(40))
    store.save(toks, [kv_cache(40, 3)])
    match = store.lookup(toks)
    assert match is not None
    man = store.manifest(match.entry_id)
    p = store.local.blocks.path(man.token_blocks[1])
    data = bytearray(p.read_bytes())
    os.chmod(p, 0o644)
    p.write_bytes(data[:-1])
    with pytest.raises(kvstore.CorruptBlockError) as e:
        store.load(match)
    assert e.value.digest == man.token_blocks[1].hex() and e.value.expected != e.value.actual
    (c,), n = store.restore(toks)  # the entry was cut back to its intact first block
    assert n == 16 and same_bits(c.keys[..., :16, :], kv_cache(40, 3).keys[..., :16, :])
    assert (store.local.blocks.quarantine_dir / man.token_blocks[1].hex()).exists()
    store.save(toks, [kv_cache(40, 3)])  # saving again writes good bytes
    match = store.lookup(toks)
    assert match is not None and match.length == 40
    p.write_bytes(bytes(data[:5]) + bytes([data[5] ^ 0xFF]) + bytes(data[6:]))
    with pytest.raises(kvstore.CorruptBlockError) as e:
        store.load(match)  # verified by default
    assert e.value.digest == man.token_blocks[1].hex()
    assert store.verify(read_data=True).sound


def test_same_tokens_twice_is_idempotent(store: kvstore.Store) -> None:
    toks = list(range(50))
    first = store.save(toks, [kv_cache(50, 1)])
    again = store.save(toks, [kv_cache(50, 1)])
    assert again.id == first.id and again.new_bytes == 0
    assert store.stats().entries == 1


def test_delete_drops_the_entry(store: kvstore.Store) -> None:
    toks = list(range(50))
    info = store.save(toks, [kv_cache(50, 1)], metadata={"who": "test"})
    assert store.manifest(info.id).metadata == {"who": "test"}
    assert store.delete(info.id) is True
    assert store.lookup(toks) is None
    assert store.delete(info.id) is False
    assert store.stats().entries == 0 and store.stats().logical_bytes == 0


@pytest.mark.parametrize(
    "tokens, message",
    [
        ([], "empty"),
        ([1, -2, 3], "-2"),
        ([1, 2.5], "2.5"),
        ([1, "a"], "'a'"),
        ("abc", "str"),
        ([2**32], "4294967296"),
        (np.array([1, -2, 3]), "-2"),
        (np.array([2**32], dtype=np.uint64), "4294967296"),
        (np.array([2**32 - 1], dtype=np.uint32), "4294967295"),
        (np.array([], dtype=np.int32), "empty"),
        (np.array([[1, 2]]), r"\[1, 2\]"),
        (np.array([1.0, 2.0]), "1.0"),
    ],
)
def test_bad_tokens(store: kvstore.Store, tokens: object, message: str) -> None:
    with pytest.raises(kvstore.InvalidTokensError, match=message):
        store.save(tokens, [kv_cache(3, 0)])
    with pytest.raises(kvstore.InvalidTokensError):
        store.lookup(tokens)
    assert store.stats().entries == 0


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint16, np.uint32, np.uint64])
def test_numpy_tokens_are_the_same_tokens_as_a_list(store: kvstore.Store, dtype: type) -> None:
    toks = [0, 7, 65535, 3, 1]
    info = store.save(np.array(toks, dtype=dtype), [kv_cache(5, 0)])
    assert list(kvstore.catalog.keys.tokens_from_le(store.manifest(info.id).tokens)) == toks
    m = store.lookup(toks)
    assert m is not None and m.entry_id == info.id and m.exact


def test_mismatched_or_empty_cache(store: kvstore.Store) -> None:
    with pytest.raises(kvstore.CacheMismatchError, match="non-empty"):
        store.save([1, 2, 3], [])
    with pytest.raises(kvstore.CacheMismatchError, match="5 tokens but 3"):
        store.save([1, 2, 3], [kv_cache(5, 0)])
    with pytest.raises(kvstore.CacheMismatchError, match="empty"):
        from mlx_lm.models.cache import KVCache

        store.save([1, 2, 3], [KVCache()])
    # nothing was committed, and the store still works
    assert store.stats().entries == 0
    store.save([1, 2, 3], [kv_cache(3, 0), arrays_cache(1)])
    assert store.stats().entries == 1


def test_malformed_digest(store: kvstore.Store) -> None:
    for bad in ("../../config", "zz" * 32, "AB" * 32, "ab" * 31):
        with pytest.raises(InvalidDigestError):
            store.delete(bad)
        with pytest.raises(InvalidDigestError):
            store.local.blocks.path(bad.encode())
    with pytest.raises(kvstore.EntryNotFoundError):
        store.manifest("ab" * 32)


def test_namespace_is_required(tmp_path: Path) -> None:
    with kvstore.Store.open(tmp_path / "root") as s:
        with pytest.raises(kvstore.NamespaceRequiredError):
            s.save([1], [kv_cache(1, 0)])
        with pytest.raises(kvstore.NamespaceRequiredError):
            s.lookup([1])
        s.save([1], [kv_cache(1, 0)], namespace=NS)
        assert s.lookup([1], namespace=NS) is not None


def test_not_a_root_and_settings_mismatch(tmp_path: Path) -> None:
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("mine")
    with pytest.raises(kvstore.NotAStoreError, match="not a kvstore root"):
        kvstore.Store.open(stray)
    assert (stray / "notes.txt").read_text() == "mine" and not (stray / "index").exists()
    with pytest.raises(kvstore.NotAStoreError):
        kvstore.Store.open(tmp_path / "missing", create=False)
    root = tmp_path / "root"
    kvstore.Store.open(root, hash="sha256", block_tokens=32).close()
    with pytest.raises(kvstore.RootSettingsError, match="hash='sha256', not 'blake3'"):
        kvstore.Store.open(root, hash="blake3")
    with pytest.raises(kvstore.RootSettingsError, match="block_tokens=32, not 64"):
        kvstore.Store.open(root, block_tokens=64)
    with kvstore.Store.open(root, namespace=NS) as s:  # its own settings are fine
        assert s.local.settings.hash == "sha256" and s.block_tokens == 32
        s.save(list(range(40)), [kv_cache(40, 2)])
        m = s.manifest(next(s.entries()).id)
        assert m.hash == "sha256"
        d = m.token_blocks[0]
        import hashlib

        assert hashlib.sha256(s.local.blocks.path(d).read_bytes()).digest() == d


def test_block_files_are_content_addressed_and_immutable(store: kvstore.Store) -> None:
    import blake3

    toks = list(range(20))
    store.save(toks, [kv_cache(20, 9)])
    m = store.manifest(next(store.entries()).id)
    for d in (*m.token_blocks, *m.state_blocks):
        p = store.local.blocks.path(d)
        assert p.parent.name == d.hex()[:2] and p.name == d.hex()
        assert blake3.blake3(p.read_bytes()).digest() == d
    # a second entry reusing the first block does not rewrite it
    p0 = store.local.blocks.path(m.token_blocks[0])
    ino = p0.stat().st_ino
    toks2 = toks[:16] + [777]
    store.save(toks2, [kv_cache(17, 9)])
    assert p0.stat().st_ino == ino
    assert not any(store.local.blocks.tmp_dir.iterdir())


def test_token_block_layout_is_per_token_rows_of_every_tensor(store: kvstore.Store) -> None:
    toks = list(range(20))
    c = kv_cache(20, 4)
    store.save(toks, [c])
    m = store.manifest(next(store.entries()).id)
    block1 = store.local.blocks.path(m.token_blocks[1]).read_bytes()
    k = c.keys[..., 16:20, :]
    v = c.values[..., 16:20, :]
    mx.eval(k, v)
    assert block1 == bytes(memoryview(k)) + bytes(memoryview(v))


def test_save_and_restore_from_an_atexit_handler(tmp_path: Path) -> None:
    """At exit the I/O threads refuse work; a save or restore then runs on the caller."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        import atexit, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        import kvstore
        from factories import kv_cache
        ns = kvstore.Namespace(model_id="m")
        s = kvstore.Store.open({str(tmp_path / "root")!r}, namespace=ns)
        def late():
            info = s.save(list(range(3000)), [kv_cache(3000, 1), kv_cache(3000, 2)])
            (a, b), n = s.restore(list(range(3000)))
            print(info.new_bytes, n, a.offset)
        atexit.register(late)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(2 * 3000 * 2 * 2 * 32 * 2), "3000", "3000"]


def test_restores_are_counted_for_the_hit_rate_and_the_lru(tmp_path: Path) -> None:
    toks = list(range(40))
    with kvstore.Store.open(tmp_path / "root", namespace=NS, block_tokens=16) as s:
        info = s.save(toks, [kv_cache(40, 1)])
        created = next(s.entries()).last_access
        assert s.restore(toks)[1] == 40
        assert s.restore(toks[:20])[1] == 20
        assert s.restore([9999, 9998]) == (None, 0)
        st = s.stats()  # flushes the batched stamps first
        assert (st.lookups, st.hits) == (3, 2)
        (e,) = list(s.entries())
        assert e.id == info.id and e.hits == 2 and e.last_access >= created
    with kvstore.Store.open(tmp_path / "root", namespace=NS) as s:  # and they were written
        assert s.stats().lookups == 3 and next(s.entries()).hits == 2


def _extend(c: object, n_new: int, seed: int) -> None:
    from factories import kv_pair

    k, v = kv_pair(n_new, seed)
    c.update_and_fetch(k, v)  # type: ignore[attr-defined]


def test_reuse_prefix_references_the_previous_turn_without_rehashing(
    store: kvstore.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvstore.local.writer as W

    turn1 = list(range(40))  # two full blocks of 16 and a partial one
    c = kv_cache(40, 1)
    first = store.save(turn1, [c])
    _extend(c, 30, 2)
    turn2 = turn1 + list(range(500, 530))
    hashed: list[int] = []
    real = W.new_hasher

    def counting(algo: str) -> object:
        hashed.append(1)
        return real(algo)

    monkeypatch.setattr(W, "new_hasher", counting)
    info = store.save(turn2, [c], reuse_prefix=True)
    m1, m2 = store.manifest(first.id), store.manifest(info.id)
    assert m2.token_blocks[:2] == m1.token_blocks[:2]  # referenced, not recomputed
    assert len(hashed) == len(m2.token_blocks) - 2 + len(m2.state_blocks)
    assert info.new_bytes == (70 - 32) * 2 * 2 * 32 * 2
    (r,), n = store.restore(turn2)
    assert n == 70 and same_bits(r.keys[..., :70, :], c.keys[..., :70, :])
    # a different layout (dtype) is never mixed in
    info3 = store.save(turn2 + [1], [kv_cache(71, 3, mx.float16)], reuse_prefix=True)
    assert store.manifest(info3.id).token_blocks[0] not in m1.token_blocks


def test_reuse_prefix_falls_back_when_the_blocks_were_collected(
    store: kvstore.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = list(range(48))
    old = store.save(a, [kv_cache(48, 1)])
    gone = list(store.manifest(old.id).token_blocks[:2])
    store.delete(old.id)
    store.compact(grace=0)
    assert not store.local.blocks.exists(gone[0])
    # as if the entry vanished between the lookup and the commit
    import kvstore.local.saving as saving

    monkeypatch.setattr(saving, "reusable_prefix", lambda *a, **kw: gone)
    c = kv_cache(48, 5)
    info = store.save(a, [c], reuse_prefix=True)
    assert store.manifest(info.id).token_blocks[0] != gone[0]
    (r,), n = store.restore(a)
    assert n == 48 and same_bits(r.keys[..., :48, :], c.keys[..., :48, :])
    assert store.verify(read_data=True).sound


def test_access_stamps_that_cannot_be_written_never_fail_a_restore(
    store: kvstore.Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    toks = list(range(40))
    store.save(toks, [kv_cache(40, 1)])

    def refuse(*a: object, **k: object) -> None:
        raise kvstore.index.errors.IndexStoreError("read-only index")

    monkeypatch.setattr(store.local.index, "record_access", refuse)
    # flush on every restore
    monkeypatch.setattr(kvstore.store.access, "ACCESS_FLUSH_SECONDS", 0.0)
    (c,), n = store.restore(toks)
    assert n == 40 and c.offset == 40
    store.close()
    assert "access stamps not recorded" in caplog.text


def test_store_open_s_typed_options_are_open_store_s_own() -> None:
    """``Store.open`` is :func:`kvstore.store.opening.open_store`; the type checker sees its
    keyword options through ``OpenOptions``: the two must name the same options."""
    import inspect
    import typing

    from kvstore.store.opening import OpenOptions, open_store

    kw = [n for n, p in inspect.signature(open_store).parameters.items()
          if p.kind is p.KEYWORD_ONLY]
    hints = typing.get_type_hints(open_store)
    assert kvstore.Store.open.__func__ is open_store  # type: ignore[attr-defined]
    assert typing.get_type_hints(OpenOptions) == {n: hints[n] for n in kw}
