"""Per-request counts by tier (issue 28): what ``Store.restore`` and ``note_request`` count,
what the root keeps over its lifetime and since a reset, and why a request missed."""

from __future__ import annotations

import socket
from pathlib import Path

import mlx.core as mx
import pytest
from factories import arrays_cache, prefix_cache
from helpers.kv import T, make_cache, open_store

import kvstore
from kvstore.store.usage import MISS_REASONS, TIERS

OTHER_MODEL = kvstore.Namespace(model_id="tiny-gc", config_fingerprint="cfg2",
                                tokenizer_hash="tok")
OTHER_TENANT = kvstore.Namespace(model_id="tiny-gc", config_fingerprint="cfg2",
                                 tokenizer_hash="tok", ns="tenant-b")


def _toks(n: int, seed: int = 1) -> list[int]:
    return [(seed * 7919 + i * 104729) % 30000 + 1 for i in range(n)]


def test_restore_counts_each_request_by_tier_and_the_root_keeps_them(tmp_path: Path) -> None:
    toks = _toks(40)
    with open_store(tmp_path / "root") as s:
        s.save(toks, make_cache(toks))
        assert s.restore(toks)[1] == 40
        assert s.restore(toks[:20])[1] == 20
        assert s.restore([9999, 9998]) == (None, 0)
        u = s.usage()
    for c in (u.lifetime, u.since_reset):
        assert (c.requests, c.prompt_tokens) == (3, 62)
        assert (c.local_requests, c.local_tokens) == (2, 60)
        assert (c.memory_requests, c.remote_requests, c.memory_tokens, c.remote_tokens) == (0,) * 4
        assert (c.hits, c.misses, c.reused_tokens, c.computed_tokens) == (2, 1, 60, 2)
        assert c.miss_reasons == {"no_entry": 1}
        assert c.tokens_saved_share == pytest.approx(60 / 62)
        assert c.since > 0
    assert u.reset_at == 0
    with open_store(tmp_path / "root") as s:  # written to the root, read by another opener
        again = s.usage()
        assert again.lifetime == u.lifetime and again.since_reset == u.since_reset


def test_a_reset_starts_the_since_reset_counts_and_keeps_the_lifetime(tmp_path: Path) -> None:
    toks = _toks(40)
    with open_store(tmp_path / "root") as s:
        s.save(toks, make_cache(toks))
        s.restore(toks)
        s.note_request(100, 90, "memory")
        before = s.reset_usage()
        assert before.since_reset.requests == 2 and before.lifetime.requests == 2
        after = s.usage()
        assert after.since_reset.requests == 0 and after.since_reset.since == after.reset_at > 0
        assert after.lifetime == before.lifetime
        s.note_request(10, 0, miss="no_entry")
        s.restore(toks[:32])
        u = s.usage()
    assert (u.lifetime.requests, u.lifetime.prompt_tokens) == (4, 40 + 100 + 10 + 32)
    assert (u.lifetime.memory_tokens, u.lifetime.local_tokens) == (90, 72)
    assert (u.since_reset.requests, u.since_reset.prompt_tokens) == (2, 42)
    assert (u.since_reset.local_requests, u.since_reset.local_tokens) == (1, 32)
    assert u.since_reset.memory_requests == 0 and u.since_reset.miss_reasons == {"no_entry": 1}


@pytest.mark.parametrize(
    ("args", "kw", "message"),
    [
        ((10, 11, "local"), {}, "reused_tokens 11 > prompt_tokens 10"),
        ((10, 5, "disk"), {}, "tier must be one of"),
        ((10, 5, None), {}, "tier must be one of"),
        ((-1, 0, None), {}, "prompt_tokens must be an int >= 0"),
        ((True, 0, None), {}, "prompt_tokens must be an int >= 0"),
        ((10, 0, None), {"miss": "bad luck"}, "miss must be one of"),
        ((10, 0, None), {}, "a request that reused nothing needs its miss reason"),
    ],
)
def test_note_request_refuses_figures_that_contradict_each_other(
    tmp_path: Path, args: tuple[int, int, str | None], kw: dict[str, str], message: str
) -> None:
    with open_store(tmp_path / "root") as s:
        with pytest.raises(ValueError, match=message):
            s.note_request(*args, **kw)
        assert s.usage().lifetime.requests == 0


def test_a_damaged_usage_record_starts_afresh(tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    with open_store(tmp_path / "root") as s:
        s.local.index.put_meta(b"usage", b"\xc1 not msgpack")
        assert s.usage().lifetime.requests == 0
        s.note_request(5, 5, "local")
        assert s.usage().lifetime.local_tokens == 5
        s.local.index.put_meta(b"usage", b"\x81\xa8lifetime\x81\xa8requests\xff")  # -1 is refused
        assert s.usage().lifetime.requests == 0
    assert "request counts are unreadable" in caplog.text


def test_the_json_shape_names_every_tier_and_reason(tmp_path: Path) -> None:
    with open_store(tmp_path / "root") as s:
        s.note_request(10, 4, "remote")
        d = s.usage().to_dict()
    life = d["lifetime"]
    assert set(life["tiers"]) == set(TIERS) and set(life["miss_reasons"]) == set(MISS_REASONS)
    assert life["tiers"]["remote"] == {"requests": 1, "tokens": 4}
    assert (life["reused_tokens"], life["computed_tokens"], life["tokens_saved_share"]) == (4, 6,
                                                                                           0.4)
    assert d["reset_at"] is None


# --- why a request missed ------------------------------------------------------------


def test_an_entry_of_another_model_is_the_reason_not_no_entry(tmp_path: Path) -> None:
    toks = _toks(40)
    with open_store(tmp_path / "root") as s:
        s.save(toks, make_cache(toks))
        assert s.restore(toks, namespace=OTHER_MODEL) == (None, 0)
        assert s.restore(toks, namespace=OTHER_TENANT) == (None, 0)  # other tenants: not shown
        assert s.restore(toks[:10], namespace=OTHER_MODEL) == (None, 0)  # short of a block
        assert s.miss_reason(_toks(40, seed=2), namespace=OTHER_MODEL) == "no_entry"
        assert s.usage().lifetime.miss_reasons == {"other_model": 2, "no_entry": 1}


def _hybrid(tokens: list[int]) -> list[object]:
    """A cache that cannot be trimmed: attention rows and an SSM-like state."""
    return [prefix_cache(tokens, mx.float16, heads=2, dim=8), arrays_cache(len(tokens))]


def test_a_hybrid_entry_sharing_blocks_it_cannot_serve_is_too_shallow(tmp_path: Path) -> None:
    toks = _toks(40)
    query = toks[:2 * T + 3] + _toks(20, seed=5)  # shares two blocks and a bit, then differs
    with open_store(tmp_path / "root") as s:
        s.save(toks, _hybrid(toks))
        assert s.restore(query) == (None, 0)
        assert s.restore(toks[:T + 1]) == (None, 0)  # inside the entry: still not its length
        assert s.restore(toks + [7]) [1] == 40  # the entry is a prefix: it serves
        assert s.miss_reason(query, reused=2 * T) is None  # memory gave all it shares
        assert s.miss_reason(query, reused=T) == "shallow"
        c = s.usage().lifetime
    assert c.miss_reasons == {"shallow": 2} and (c.local_requests, c.local_tokens) == (1, 40)


def test_a_corrupt_block_is_a_verify_failure_and_counted(tmp_path: Path) -> None:
    toks = _toks(40)
    with open_store(tmp_path / "root") as s:
        info = s.save(toks, make_cache(toks))
        first = s.manifest(info.id).token_blocks[0]
        path = tmp_path / "root" / "blocks" / first.hex()[:2] / first.hex()
        data = bytearray(path.read_bytes())
        data[5] ^= 1
        path.write_bytes(bytes(data))
        assert s.restore(toks) == (None, 0)
        assert s.counters.values().corrupt_blocks == 1
        assert s.usage().lifetime.miss_reasons == {"verify_failed": 1}


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_remote_that_does_not_answer_is_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("boto3")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    toks = _toks(40)
    with open_store(tmp_path / "root", remote="s3://nobody/here", remote_timeout=2.0) as s:
        assert s.restore(toks) == (None, 0)
        s.save(toks, make_cache(toks))
        assert s.restore(toks + [1, 2])[1] == 40  # a local hit is still a hit
        u = s.usage().lifetime
    assert u.miss_reasons == {"remote_timeout": 1} and u.local_tokens == 40
    assert "unreachable" in caplog.text


# --- issue 38, item 9: every miss has its reason, and they add up --------------------------


def test_every_request_that_reused_nothing_has_a_reason_and_they_add_up(tmp_path: Path) -> None:
    """``stats`` said "missed 8 requests … no_entry 4, other_model 2": the other two, prompts
    of one token, had no reason."""
    from kvstore.mlx_lm import PersistentPromptCache
    from kvstore.tiny import make_tiny_model

    key = (str(make_tiny_model(tmp_path / "llama", "llama")), None, None)
    toks = _toks(40)
    with open_store(tmp_path / "root") as s:
        s.save(toks, make_cache(toks))
        for _ in range(2):
            assert s.restore(toks, namespace=OTHER_MODEL) == (None, 0)
        for seed in range(2, 6):
            assert s.restore(_toks(40, seed=seed)) == (None, 0)
        assert s.restore(toks)[1] == 40
        s.restore(toks[:20])
        ppc = PersistentPromptCache(s)
        for one in ([5], [6]):
            cache, rest = ppc.fetch_nearest_cache(key, one)
            assert cache is None and rest == one
        assert ppc.request_counts().miss_reasons == {"too_short": 2}
        ppc.close()
        c = s.usage().lifetime
    assert (c.requests, c.misses) == (10, 8)
    assert c.miss_reasons == {"no_entry": 4, "other_model": 2, "too_short": 2}
    assert sum(c.miss_reasons.values()) == c.misses and c.partial_reasons == {}
    d = c.to_dict()
    assert sum(d["miss_reasons"].values()) == d["misses"] == 8


def test_a_partial_reuse_keeps_its_reason_apart_from_the_misses() -> None:
    from kvstore.store.usage import Counts

    c = Counts()
    c.note(100, 0, None, "no_entry")
    c.note(100, 32, "local", "shallow")
    c.note(100, 64, "memory", None)
    assert (c.misses, c.miss_reasons, c.partial_reasons) == (1, {"no_entry": 1},
                                                             {"shallow": 1})
    both = c.copy()
    both.add(c)
    assert (both.miss_reasons, both.partial_reasons) == ({"no_entry": 2}, {"shallow": 2})
    assert c.miss_reasons == {"no_entry": 1}  # the copy shares no dict
