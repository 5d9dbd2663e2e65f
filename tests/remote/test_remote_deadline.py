"""Issue 29, item 6: a slow gateway never stalls a request, and failed pushes are tried
again. The real gateway is made slow or failing by a TCP proxy on 127.0.0.1 between the
client and it (tests/helpers/slowproxy.py); the gateway itself is never stopped."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from helpers.kv import T, make_cache, matches, open_built, open_store, tokens_for
from helpers.slowproxy import SlowProxy, wait_until

from kvstore.remote import Remote
from kvstore.store.retry import PushRetry

DEADLINE = 1.0
MARGIN = 0.5  # what a request may take past the deadline (the local part, a loaded machine)
SLOW = 3.0  # seconds the proxy adds to each request
RETRYING = PushRetry(attempts=50, first=0.1, cap=0.4, give_up_after=60)  # until it lands
GIVING_UP = PushRetry(attempts=3, first=0.1, cap=0.2, give_up_after=60)  # three tries


@contextmanager
def through(proxy: SlowProxy) -> Iterator[SlowProxy]:
    """Stores opened in this block reach the gateway through ``proxy``
    (``AWS_ENDPOINT_URL``); the bucket fixture's clean-up does not."""
    was = os.environ["AWS_ENDPOINT_URL"]
    os.environ["AWS_ENDPOINT_URL"] = proxy.url
    try:
        yield proxy
    finally:
        os.environ["AWS_ENDPOINT_URL"] = was


@pytest.fixture
def proxy(endpoint: str) -> Iterator[SlowProxy]:
    """A proxy in front of the gateway, for the whole test."""
    with SlowProxy(endpoint) as p, through(p):
        yield p


def exact_keys(url: str) -> list[str]:
    r = Remote(url)
    try:
        return [o.key for o in r.client.list(r.prefix + "exact/")]
    finally:
        r.close()


def pushed(tmp_path: Path, url: str, endpoint: str, toks: list[int]) -> None:
    """Machine A saves ``toks`` straight to the gateway."""
    assert os.environ["AWS_ENDPOINT_URL"] == endpoint
    with open_store(tmp_path / "a", remote=url) as a:
        a.save(toks, make_cache(toks))
        st = a.push(60)
        assert (st.entries, st.failed) == (1, 0), st


def test_a_slow_gateway_costs_a_request_the_deadline_and_the_next_one_nothing(
        tmp_path: Path, url: str, endpoint: str) -> None:
    toks = tokens_for(1, 12 * T + 3)
    pushed(tmp_path, url, endpoint, toks)
    query = toks + [5, 6, 7]
    with SlowProxy(endpoint, delay=SLOW) as proxy, through(proxy):
        with open_store(tmp_path / "b", remote=url, remote_deadline=DEADLINE) as b:
            t0 = time.monotonic()
            cache, n = b.restore(query)
            took = time.monotonic() - t0
            assert (cache, n) == (None, 0)  # nothing here yet: computed
            assert took < DEADLINE + MARGIN, took
            assert b.counters.values().remote_deadline_misses == 1
            assert b.usage().lifetime.miss_reasons == {"remote_timeout": 1}
            # the lookup goes on, then the pull, in the background
            assert b.tiers.settle(120)
            assert b.stats().entries == 1
            v = b.counters.values()
            assert v.remote_pulls == 1 and v.remote_errors == 0, v
            asked = proxy.requests
            t0 = time.monotonic()
            cache, n = b.restore(query)  # restored here; the slow remote is not waited for
            took = time.monotonic() - t0
            assert n == len(toks) and cache is not None and matches(cache, query, n)
            assert took < DEADLINE / 2, took
            assert b.tiers.settle(120)
            assert proxy.requests > asked  # but asked in the background, for a longer hit
            assert b.counters.values().remote_deadline_misses == 2
            asked = proxy.requests
            t0 = time.monotonic()
            cache, n = b.restore(toks)  # exact here: the remote is not asked at all
            assert time.monotonic() - t0 < DEADLINE
            assert n == len(toks) and cache is not None and matches(cache, toks, n)
            assert proxy.requests == asked
            life = b.usage().lifetime
            assert (life.requests, life.local_requests, life.remote_requests) == (3, 2, 0)


def test_a_gateway_fast_again_is_waited_for_again(
        tmp_path: Path, url: str, endpoint: str) -> None:
    t1, t2, t3 = (tokens_for(seed, 5 * T) for seed in (11, 12, 13))
    with open_store(tmp_path / "a", remote=url) as a:
        for t in (t1, t2):
            a.save(t, make_cache(t))
        assert a.push(60).entries == 2
        with SlowProxy(endpoint, delay=SLOW) as proxy, through(proxy), \
                open_store(tmp_path / "b", remote=url, remote_deadline=DEADLINE) as b:
            assert b.restore(t1 + [1]) == (None, 0)  # cut: the remote is slow
            assert b.tiers.settle(120) and b.stats().entries == 1
            proxy.delay = 0.0
            t0 = time.monotonic()
            assert b.restore(t2 + [1]) == (None, 0)  # not waited for: asked in the background
            assert time.monotonic() - t0 < DEADLINE / 2
            assert b.tiers.settle(60) and b.stats().entries == 2  # it answered in time
            cache, n = b.restore(t2 + [1])
            assert n == len(t2) and cache is not None and matches(cache, t2 + [1], n)
            a.save(t3, make_cache(t3))
            assert a.push(60).entries == 1
            cache, n = b.restore(t3 + [1])  # waited for again: pulled within the deadline
            assert n == len(t3) and cache is not None and matches(cache, t3 + [1], n)
            life = b.usage().lifetime
            assert (life.local_requests, life.remote_requests) == (1, 1), life
            v = b.counters.values()
            assert (v.remote_pulls, v.remote_deadline_misses, v.remote_errors) == (3, 2, 0), v


def test_a_hit_pulled_within_the_deadline_is_used_at_once(
        tmp_path: Path, url: str, endpoint: str, proxy: SlowProxy) -> None:
    toks = tokens_for(2, 9 * T + 1)
    with open_store(tmp_path / "a", remote=url) as a:  # through the proxy, not delayed
        a.save(toks, make_cache(toks))
        assert a.push(60).entries == 1
    with open_store(tmp_path / "b", remote=url, remote_deadline=30.0) as b:
        m = b.lookup(toks + [1])
        assert m is not None and (m.where, m.origin, m.length) == ("local", "remote", len(toks))
        assert b.stats().entries == 1  # pulled during the lookup
        cache, n = b.restore(toks + [2])
        assert n == len(toks) and cache is not None and matches(cache, toks + [2], n)
        v = b.counters.values()
        assert (v.remote_pulls, v.remote_deadline_misses) == (1, 0), v


def test_a_remote_hit_within_the_deadline_counts_as_the_remotes(
        tmp_path: Path, url: str, endpoint: str) -> None:
    toks = tokens_for(3, 6 * T)
    pushed(tmp_path, url, endpoint, toks)
    with open_store(tmp_path / "b", remote=url, remote_deadline=30.0) as b:
        cache, n = b.restore(toks + [9])
        assert n == len(toks) and cache is not None and matches(cache, toks + [9], n)
        life = b.usage().lifetime
        assert (life.requests, life.remote_requests, life.remote_tokens) == (1, 1, len(toks))


def test_pushes_that_fail_are_tried_again_and_land(
        tmp_path: Path, url: str, proxy: SlowProxy) -> None:
    toks = tokens_for(4, 8 * T)
    with open_built(tmp_path / "b", {"push_retry": RETRYING}, remote=url) as b:
        proxy.fail = True
        b.save(toks, make_cache(toks))
        wait_until(lambda: b.counters.values().remote_errors >= 3, 60, "three failed tries")
        proxy.fail = False
        # no push() call: the write-behind tries it again by itself
        wait_until(lambda: len(exact_keys(url)) == 1, 60, "the entry on the remote")
        st = b.push(60)
        assert (st.entries, st.failed, st.given_up) == (1, 0, 0), st
        assert st.retried >= 3, st
        assert b.counters.values().remote_pushes_given_up == 0
    with open_store(tmp_path / "c", remote=url) as c:  # another machine gets it, bit-exact
        cache, n = c.restore(toks)
        assert n == len(toks) and cache is not None and matches(cache, toks, n)


def test_pushes_that_keep_failing_are_given_up_and_counted(
        tmp_path: Path, url: str, proxy: SlowProxy) -> None:
    toks = tokens_for(5, 8 * T)
    with open_built(tmp_path / "b", {"push_retry": GIVING_UP}, remote=url) as b:
        proxy.fail = True
        b.save(toks, make_cache(toks))
        wait_until(lambda: b.counters.values().remote_pushes_given_up == 1, 60, "given up")
        v = b.counters.values()
        assert v.remote_errors == 3 and v.remote_pushes == 0, v  # three tries in all
        asked = proxy.requests
        time.sleep(1.0)  # the bound holds: nothing tries it again by itself
        assert proxy.requests == asked and b.counters.values().remote_errors == 3
        proxy.fail = False
        assert exact_keys(url) == []
        st = b.push(60)  # an explicit push still uploads what was given up
        assert (st.entries, st.failed, st.given_up, st.retried) == (1, 0, 1, 2), st
    assert len(exact_keys(url)) == 1


def test_what_is_still_failing_at_close_is_said_once(
        tmp_path: Path, url: str, proxy: SlowProxy) -> None:
    b = open_built(tmp_path / "b", {"push_retry": GIVING_UP}, remote=url)
    proxy.fail = True
    for seed in (6, 7):
        t = tokens_for(seed, 4 * T)
        b.save(t, make_cache(t))
    wait_until(lambda: b.counters.values().remote_pushes_given_up == 2, 60, "given up")
    st = b.tiers.close(5)
    assert (st.entries, st.failed, st.pending) == (0, 2, 0), st
    b.close()


def test_an_explicit_push_waits_for_the_tries_within_its_timeout(
        tmp_path: Path, url: str, proxy: SlowProxy) -> None:
    toks = tokens_for(8, 6 * T)
    with open_built(tmp_path / "b", {"push_retry": RETRYING}, remote=url) as b:
        proxy.fail = True
        b.save(toks, make_cache(toks))
        out: dict[str, Any] = {}
        th = threading.Thread(target=lambda: out.update(st=b.push(60)))
        th.start()
        try:
            wait_until(lambda: b.counters.values().remote_errors >= 3, 60, "three failed tries")
            assert th.is_alive()  # push() waits: the entry will be tried again
        finally:
            proxy.fail = False
            th.join(60)
        assert not th.is_alive()
        st = out["st"]
        assert (st.entries, st.failed, st.given_up, st.pending) == (1, 0, 0, 0), st
        assert st.retried >= 3, st
    assert len(exact_keys(url)) == 1


def test_each_prompt_cache_waits_by_its_own_deadline(
        tmp_path: Path, url: str, endpoint: str) -> None:
    """Issue 35: two prompt caches over one store (with no deadline of its own) each wait for
    a slow gateway by their own ``remote_deadline``: the patient one gets its entry from the
    remote, the quick one computes (one deadline miss); the store's stays None."""
    from helpers.kv import two_layer_kv

    from kvstore.mlx_lm import PersistentPromptCache
    from kvstore.tiny import make_tiny_model

    key = (str(make_tiny_model(tmp_path / "model" / "llama", "llama")), None, None)
    first, second = tokens_for(21, 6 * T), tokens_for(22, 6 * T)
    with open_store(tmp_path / "a", remote=url) as a:
        with PersistentPromptCache(a, min_tokens=T) as ppc:
            for t in (first, second):
                ppc.insert_cache(key, t, two_layer_kv(t))
            assert ppc.drain(60)
        assert a.push(60).entries == 2
    with SlowProxy(endpoint, delay=0.4) as proxy, through(proxy), \
            open_store(tmp_path / "b", remote=url) as b, \
            PersistentPromptCache(b, remote_deadline=60.0) as patient, \
            PersistentPromptCache(b, remote_deadline=0.2) as quick:
        cache, rest = patient.fetch_nearest_cache(key, first + [1])
        assert cache is not None and rest == [1]  # waited for: pulled from the remote
        assert patient.request_counts().remote_tokens == len(first)
        t0 = time.monotonic()
        cache, rest = quick.fetch_nearest_cache(key, second + [1])
        assert time.monotonic() - t0 < 0.2 + MARGIN
        assert cache is None and rest == second + [1]  # cut by its own deadline: computed
        assert b.counters.values().remote_deadline_misses == 1
        assert b.tiers.deadline is None
        assert b.tiers.settle(120)
