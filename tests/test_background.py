"""Issue 29, item 6, the parts on their own: the bounded background queue that finishes a
pull a request's deadline left (kvstore.store.background) and the schedule of failed
pushes (kvstore.store.retry). Against the gateway: tests/remote/test_remote_deadline.py."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvstore.store.background import Background
from kvstore.store.retry import PushRetry, Retries


def test_one_job_per_key_at_a_time_and_a_bounded_queue() -> None:
    started, gate = threading.Event(), threading.Event()
    ran: list[str] = []

    def job(name: str) -> str:
        started.set()
        gate.wait(30)
        ran.append(name)
        return name

    bg = Background(queue_size=2, workers=1)
    try:
        first = bg.submit("a", lambda: job("a"))
        assert first is not None and started.wait(30)  # "a" runs, the queue is empty
        assert bg.submit("a", lambda: job("a again")) is first  # the same entry: joined
        b, c = (bg.submit(k, lambda k=k: job(k)) for k in ("b", "c"))
        assert b is not None and c is not None and bg.submit("b", lambda: job("b")) is b
        assert bg.submit("d", lambda: job("d")) is None and bg.shed == 1  # the queue is full
        assert len(bg) == 3
        gate.set()
        assert bg.wait(30) and len(bg) == 0
        assert ran == ["a", "b", "c"] and first.result() == "a"
        again = bg.submit("a", lambda: job("a later"))  # done: a new job may start
        assert again is not None and again.result(30) == "a later"
    finally:
        gate.set()
        bg.close(30)


def test_close_drops_what_waits_and_waits_for_what_runs() -> None:
    started, gate = threading.Event(), threading.Event()

    def slow() -> int:
        started.set()
        gate.wait(30)
        return 1

    bg = Background(queue_size=4, workers=1)
    running = bg.submit("run", slow)
    assert running is not None and started.wait(30)
    waiting = bg.submit("wait", lambda: 2)
    assert waiting is not None
    assert bg.close(0.2) == 1  # still running after the timeout
    assert waiting.cancelled()
    assert bg.submit("late", lambda: 3) is None and bg.closed and bg.shed == 0
    gate.set()
    assert running.result(30) == 1
    assert bg.close(30) == 0


def test_an_exception_reaches_the_future() -> None:
    bg = Background()
    try:
        fut = bg.submit("x", lambda: 1 // 0)
        assert fut is not None
        with pytest.raises(ZeroDivisionError):
            fut.result(30)
    finally:
        bg.close(30)


@pytest.mark.parametrize(("queue_size", "workers"), [(0, 1), (1, 0)])
def test_bounds_are_checked(queue_size: int, workers: int) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        Background(queue_size=queue_size, workers=workers)


def test_the_pause_doubles_up_to_its_cap() -> None:
    p = PushRetry(attempts=10, first=0.5, cap=3.0, give_up_after=1e9)
    assert [p.pause(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_a_push_is_given_up_after_its_attempts() -> None:
    r, p = Retries(), PushRetry(attempts=3, first=1.0, cap=10.0, give_up_after=1e9)
    d = b"\x01" * 32
    assert r.failed(d, 100.0, p) is None and r.scheduled() == 1
    assert r.next_due(100.0) == 1.0 and r.due(100.5) == [] and r.due(101.0) == [d]
    assert r.next_due(101.0) is None  # handed over: not due again unless it fails again
    assert r.failed(d, 101.0, p) is None and r.next_due(101.0) == 2.0
    assert r.failed(d, 103.0, p) == 3  # the third failed try: given up
    assert r.scheduled() == 0
    assert r.next_due(103.0) is None and r.due(1e9) == [] and len(r) == 1
    assert r.take() == [d] and len(r) == 0  # kept for the next push, then forgotten


def test_a_push_is_given_up_after_its_time() -> None:
    r, p = Retries(), PushRetry(attempts=100, first=4.0, cap=4.0, give_up_after=10.0)
    d = b"\x02" * 32
    assert r.failed(d, 0.0, p) is None  # next try at 4 s
    assert r.failed(d, 4.0, p) is None  # at 8 s
    assert r.failed(d, 8.0, p) == 3  # the next would begin 12 s after the first failure


def test_a_push_that_lands_is_forgotten() -> None:
    r, p = Retries(), PushRetry()
    d = b"\x03" * 32
    assert r.failed(d, 0.0, p) is None
    r.done(d)
    assert len(r) == 0 and r.next_due(0.0) is None


def test_the_deadline_is_a_store_option_and_a_prompt_cache_option(tmp_path: Path) -> None:
    from kvstore import Store
    from kvstore.mlx_lm import PersistentPromptCache

    with Store.open(tmp_path / "a", remote_deadline=0.5) as s:
        assert s.tiers.deadline == 0.5
    with Store.open(tmp_path / "b") as s:
        assert s.tiers.deadline is None  # a library store waits by each tier's own bounds
        with PersistentPromptCache(s, remote_deadline=2.0) as c:
            assert c.remote_deadline == 2.0  # the cache's own: the store's stays None
        for bad in (0.0, -1.0, float("nan")):
            with pytest.raises(ValueError, match="remote_deadline must be > 0"):
                PersistentPromptCache(s, remote_deadline=bad)
    for bad in (0.0, float("nan")):
        with pytest.raises(ValueError, match="remote_deadline must be > 0"):
            Store.open(tmp_path / "c", remote_deadline=bad)
    assert not (tmp_path / "c").exists()


def test_two_prompt_caches_over_one_store_keep_their_own_deadlines(tmp_path: Path) -> None:
    """A prompt cache's ``remote_deadline`` is its own (each of its lookups passes it): a
    second cache over the same store keeps its own, and the store's is unchanged."""
    from kvstore import Store
    from kvstore.mlx_lm import PersistentPromptCache

    with Store.open(tmp_path / "a", remote_deadline=1.5) as s:
        with PersistentPromptCache(s, remote_deadline=0.25) as a, \
                PersistentPromptCache(s, remote_deadline=4.0) as b, \
                PersistentPromptCache(s) as c:
            assert s.tiers.deadline == 1.5  # the store's, not the last cache's
            assert (a.remote_deadline, b.remote_deadline, c.remote_deadline) == (0.25, 4.0,
                                                                                 None)
            assert s.options.remote_deadline == 1.5
    with Store.open(tmp_path / "b") as s, PersistentPromptCache(s, remote_deadline=0.5):
        assert s.tiers.deadline is None
