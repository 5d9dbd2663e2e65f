"""Issue 28 on the real gateway: a request that the remote tier answers counts as the
remote's, and the store counts its pushes and pulls (``/metrics`` reads these)."""

from __future__ import annotations

from pathlib import Path

from helpers.kv import T, make_cache, matches, open_store, tokens_for


def test_a_remote_hit_counts_for_the_remote_tier(tmp_path: Path, url: str) -> None:
    toks = tokens_for(3, 4 * T + 5)
    with open_store(tmp_path / "a", remote=url) as a:
        a.save(toks, make_cache(toks))
        st = a.push(60)
        assert (st.entries, st.failed) == (1, 0)
        pushed = a.counters.values()
        assert (pushed.remote_pushes, pushed.remote_errors) == (1, 0)
        assert pushed.remote_pushed_bytes == st.bytes > 0
    query = toks + [7, 8]
    with open_store(tmp_path / "b", remote=url) as b:  # another machine, an empty root
        cache, n = b.restore(query)
        assert n == len(toks) and cache is not None and matches(cache, query, n)
        cache, n = b.restore(query)  # now in b's root: a local hit
        assert n == len(toks)
        got = b.counters.values()
        assert (got.remote_pulls, got.remote_errors) == (1, 0)
        assert got.remote_pulled_bytes == sum(b.local.blocks.size(d) or 0
                                              for d in b.manifest(next(b.entries()).id)
                                              .block_digests()) > 0
        c = b.usage().lifetime
    assert (c.remote_requests, c.remote_tokens) == (1, len(toks))
    assert (c.local_requests, c.local_tokens) == (1, len(toks))
    assert (c.requests, c.prompt_tokens, c.misses) == (2, 2 * len(query), 0)
