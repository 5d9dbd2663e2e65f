"""The restore onto a GPU, its logic run on the host: each block read whole into a slot of a
staging ring, hashed there, its runs copied out by a copier (on a CUDA GPU the card's copy
engines; here ``HostCopier``, whose deferred copies run only when their slot is waited for,
as asynchronous copies would), a slot reused only once its copies are done."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from factories import (
    arrays_cache,
    cache_list,
    kv_cache,
    quantized_cache,
    rotating_cache,
    same_bits,
    state_arrays,
)

import kvstore
from kvstore.blocks import BlockCheck
from kvstore.codecs import staging
from kvstore.codecs.cudart import CudaError
from kvstore.codecs.staging import Copy, HostCopier
from kvstore.local import restore as restore_mod
from kvstore.local import staged
from kvstore.local.reader import Run
from kvstore.store.tenants import tenant_namespace

NS = kvstore.Namespace(model_id="staged", config_fingerprint="cfg", tokenizer_hash="tok")
T = 16
N = 100  # 7 token blocks, the last partial


def toks(n: int = N, base: int = 1000) -> list[int]:
    return list(range(base, base + n))


class Copiers:
    """What the restores of one test made their copies with."""

    def __init__(self, make: Callable[[], HostCopier | None]) -> None:
        self.make = make
        self.made: list[HostCopier] = []

    def __call__(self) -> HostCopier | None:
        c = self.make()
        if c is not None:
            self.made.append(c)
        return c


@pytest.fixture
def copiers(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Copiers]]:
    def use(make: Callable[[], HostCopier | None]) -> Copiers:
        c = Copiers(make)
        monkeypatch.setattr(restore_mod, "copier_for_restore", c)
        return c

    yield use


@pytest.fixture
def store(tmp_path: Path) -> Iterator[kvstore.Store]:
    with kvstore.Store.open(tmp_path / "root", namespace=NS, durable=False,
                            block_tokens=T) as s:
        yield s


def _mixed(n: int) -> list[Any]:
    return [kv_cache(n, 1), quantized_cache(n, 2), rotating_cache(n, 48, 3),
            arrays_cache(4), cache_list(n, 5), kv_cache(n, 6, mx.float32)]


def _arrays(cache: list[Any]) -> list[mx.array]:
    return [a for c in cache for a in state_arrays(c)]


def _host_restore(store: kvstore.Store, tokens: list[int], copiers: Callable[..., Copiers],
                  verify: bool = True) -> tuple[list[Any] | None, int]:
    copiers(lambda: None)
    return store.restore(tokens, verify=verify)


@pytest.mark.parametrize("verify", [True, False])
def test_every_kind_restores_bit_exact_through_the_ring(
        store: kvstore.Store, copiers: Callable[..., Copiers], verify: bool) -> None:
    t = toks()
    store.save(t, _mixed(N))
    want, n = _host_restore(store, t, copiers, verify)
    assert want is not None and n == N
    used = copiers(lambda: HostCopier(deferred=True))
    got, n2 = store.restore(t, verify=verify)
    assert got is not None and n2 == N
    a, b = _arrays(got), _arrays(want)
    assert len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b, strict=True))
    (c,) = used.made
    # one send a block slot (7 token blocks, the window's and the state's), every one of
    # them waited for before its slot was reused or at the end
    assert c.sent >= 7 and not c._pending
    # the destinations were handed over first: one span per restored tensor
    assert len(c.prepared) == sum(len(state_arrays(x)) for x in got) or c.prepared


def test_a_prefix_reads_its_last_block_in_part_and_zeroes_the_spare_rows(
        store: kvstore.Store, copiers: Callable[..., Copiers]) -> None:
    t = toks()
    store.save(t, [kv_cache(N, 1), kv_cache(N, 2, mx.float16)])
    query = t[:41] + [7, 7, 7]
    for verify in (True, False):
        want, n = _host_restore(store, query, copiers, verify)
        assert want is not None and n == 41
        copiers(lambda: HostCopier(deferred=True))
        got, n2 = store.restore(query, verify=verify)
        assert got is not None and n2 == 41
        for g, w in zip(got, want, strict=True):
            # the whole buffer, spare rows included (zeros on both paths)
            assert g.keys.shape == w.keys.shape and g.keys.shape[2] > 41
            assert same_bits(g.keys, w.keys) and same_bits(g.values, w.values)
            assert not mx.any(g.keys[..., 41:, :]).item()


def test_a_ring_smaller_than_the_read_is_reused_only_after_its_copies(
        store: kvstore.Store, copiers: Callable[..., Copiers],
        monkeypatch: pytest.MonkeyPatch) -> None:
    t = toks(40 * T)
    store.save(t, [kv_cache(40 * T, 1), kv_cache(40 * T, 2)])
    want, _ = _host_restore(store, t, copiers)
    assert want is not None
    monkeypatch.setattr(staged, "RING_BYTES", 1)  # two slots for 40 blocks
    monkeypatch.setattr(staged, "CHUNK", 1000)  # each block read and hashed in pieces
    rings: list[int] = []

    class Counting(HostCopier):
        def ring(self, count: int, nbytes: int) -> list[memoryview]:
            rings.append(count)
            return super().ring(count, nbytes)

    used = copiers(lambda: Counting(deferred=True))
    got, n = store.restore(t)
    assert got is not None and n == 40 * T and rings == [2]
    for g, w in zip(got, want, strict=True):
        assert same_bits(g.keys, w.keys) and same_bits(g.values, w.values)
    (c,) = used.made
    assert c.sent == 40 and c.waits >= 38  # every reuse of a slot waited for its copies


def test_a_block_that_hashes_wrong_is_not_copied_and_is_quarantined(
        store: kvstore.Store, copiers: Callable[..., Copiers], tmp_path: Path) -> None:
    t = toks()
    info = store.save(t, [kv_cache(N, 1)])
    m = store.manifest(info.id)
    bad = m.token_blocks[3]
    path = Path(store.local.blocks.where(bad))
    data = bytearray(path.read_bytes())
    data[5] ^= 0xFF
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    used = copiers(lambda: HostCopier(deferred=True))
    got, n = store.restore(t)  # the longest intact prefix: blocks 0-2
    assert got is not None and n == 3 * T
    first = used.made[0]
    assert first.sent == len(m.token_blocks) - 1  # the bad block's copies were never sent
    assert not path.exists()  # quarantined
    (want,) = [kv_cache(N, 1)]
    k, _ = want.keys_and_values()
    assert same_bits(got[0].keys[..., : 3 * T, :], k[..., : 3 * T, :])


def test_a_block_cut_short_is_a_bad_block(
        store: kvstore.Store, copiers: Callable[..., Copiers]) -> None:
    t = toks()
    info = store.save(t, [kv_cache(N, 1)])
    d = store.manifest(info.id).token_blocks[5]
    path = Path(store.local.blocks.where(d))
    os.chmod(path, 0o644)
    os.truncate(path, path.stat().st_size // 2)
    copiers(lambda: HostCopier(deferred=True))
    got, n = store.restore(t)
    assert got is not None and n == 5 * T


def test_a_copy_that_fails_half_way_raises_after_the_queued_copies_and_loses_nothing(
        store: kvstore.Store, copiers: Callable[..., Copiers]) -> None:
    t = toks(20 * T)
    store.save(t, [kv_cache(20 * T, 1)])
    used = copiers(lambda: HostCopier(deferred=True, fail_at=3))
    with pytest.raises(CudaError) as e:
        store.restore(t)
    assert e.value.call == "cudaMemcpy2DAsync" and isinstance(e.value, kvstore.KVStoreError)
    (c,) = used.made
    assert not c._pending  # every copy queued before the failure was finished
    assert c.sent < 20  # the reads stopped
    copiers(lambda: HostCopier())
    got, n = store.restore(t)
    assert got is not None and n == 20 * T
    assert store.verify(read_data=True).sound


def test_a_salted_entry_hashes_its_salt_after_what_is_read(
        tmp_path: Path, copiers: Callable[..., Copiers]) -> None:
    ns = tenant_namespace(NS, "ab" * 16)
    t = toks()
    with kvstore.Store.open(tmp_path / "root", namespace=ns, durable=False,
                            block_tokens=T) as s:
        s.save(t, [kv_cache(N, 1)])
        want, _ = _host_restore(s, t, copiers)
        copiers(lambda: HostCopier(deferred=True))
        got, n = s.restore(t)
        assert got is not None and want is not None and n == N
        assert same_bits(got[0].keys, want[0].keys)


def test_a_tensor_handed_over_in_two_buffers_is_refused() -> None:
    check = BlockCheck("blake3", [])
    s = staged.StagedStream([("uint8", [8])], [[]], [], check, None,  # type: ignore[arg-type]
                            HostCopier())
    a, b = bytearray(8), bytearray(8)
    s.fill(0, 0, memoryview(a)[:4])
    with pytest.raises(staged.StagingError):
        s.fill(0, 4, memoryview(b)[4:])


def test_plan_jobs_makes_one_job_a_block_and_a_2d_copy_a_run() -> None:
    # tensor 0: 2 rows of 4 bytes a block, strided by 24 in the array (3 blocks of rows);
    # tensor 1: a state tensor of 10 bytes in slot 3; a spare run of zeros
    runs0 = [Run(0, 4, 0, 0, 2, 12, 4), Run(4, 4, 1, 0, 2, 12, 4),
             Run(8, 4, -1, 0, 2, 12)]
    runs1 = [Run(0, 10, 3, 2)]
    check = BlockCheck("blake3", [(b"a" * 32, 8), (b"b" * 32, 8), (b"c" * 32, 1),
                                  (b"d" * 32, 40)])
    jobs, zeros = staged.plan_jobs([runs0, runs1], [1000, 5000], check, tail=0)
    assert [(j.slot, j.nbytes) for j in jobs] == [(0, 8), (1, 8), (3, 40)]
    assert jobs[0].copies == [Copy(1000, 0, 4, 2, 12, 4)]
    assert jobs[1].copies == [Copy(1004, 0, 4, 2, 12, 4)]
    assert jobs[2].copies == [Copy(5000, 2, 10, 1, 10, 10)]
    assert zeros == [(1008, 12, 4, 2)]
    unverified = BlockCheck("blake3", [(b"d" * 32, 40)] * 4, hashing=False)
    jobs, _ = staged.plan_jobs([runs0, runs1], [1000, 5000], unverified, tail=0)
    assert [(j.slot, j.nbytes) for j in jobs] == [(0, 8), (1, 8), (3, 12)]


def test_no_cuda_copier_without_a_cuda_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # this machine's MLX has no CUDA GPU: restores fill their arrays on the host
    assert staging.cuda_copier() is None
    monkeypatch.setenv("KVSTORE_GPU_RESTORE", "0")
    assert staging.cuda_copier() is None


def test_pinning_the_ring_is_a_setup_cost_left_out_of_a_measured_rate() -> None:
    class SlowPinning:
        def host_alloc(self, nbytes: int) -> int:
            import time

            time.sleep(0.02)
            return 4096

    staging.setup_seconds()
    assert staging._pinned(SlowPinning(), 3, 10) == [4096] * 3  # type: ignore[arg-type]
    assert staging.setup_seconds() >= 0.06
    assert staging.setup_seconds() == 0.0  # read once
