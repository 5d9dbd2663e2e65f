"""The lower tiers' health and the request deadline (kvstore.store.health), on a clock the
test moves. Against the gateway: tests/remote/test_remote_deadline.py."""

from __future__ import annotations

import threading

from kvstore.store.health import Ask, Health


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_failed_tier_is_benched_for_down_for_seconds() -> None:
    c = Clock()
    h = Health(clock=c, down_for=30.0)
    assert not h.benched("remote") and not h.unavailable(["remote"])
    h.bench("remote")
    assert h.benched("remote") and h.unavailable(["remote"])
    assert not h.benched("other") and not h.unavailable(["other"])
    c.now += 29.9
    assert h.benched("remote")
    c.now += 0.1
    assert not h.benched("remote") and not h.unavailable(["remote"])


def test_without_a_deadline_a_tier_is_waited_for_its_own_timeout() -> None:
    h = Health(clock=Clock())
    assert h.until() is None
    assert h.ask("remote", 5.0, None) == Ask(wait=5.0)
    assert h.ask("remote", None, None) == Ask(wait=None)


def test_the_deadline_cuts_a_wait_longer_than_what_is_left() -> None:
    c = Clock()
    h = Health(1.5, clock=c)
    until = h.until()
    assert until == 101.5
    assert h.ask("remote", 5.0, until) == Ask(wait=1.5, cut=True)
    assert h.ask("remote", None, until) == Ask(wait=1.5, cut=True)
    assert h.ask("remote", 0.5, until) == Ask(wait=0.5)  # the tier's own bound is shorter
    c.now += 1.0
    assert h.ask("remote", 5.0, until) == Ask(wait=0.5, cut=True)
    c.now += 0.5
    assert h.ask("remote", 5.0, until) == Ask(skip="no time left")


def test_a_tier_the_deadline_cut_is_asked_in_the_background_for_slow_for_seconds() -> None:
    c = Clock()
    h = Health(1.5, clock=c, slow_for=30.0)
    h.cut("remote")
    assert h.unavailable(["remote"]) and not h.benched("remote")
    assert h.ask("remote", 5.0, h.until()) == Ask(skip="it was slow", background=True)
    assert h.ask("remote", 5.0, None) == Ask(wait=5.0)  # no deadline: waited for
    c.now += 30.0
    assert not h.unavailable(["remote"])
    assert h.ask("remote", 5.0, h.until()) == Ask(wait=1.5, cut=True)


def test_an_answer_within_the_deadline_lifts_the_slowness_a_late_one_does_not() -> None:
    c = Clock()
    h = Health(1.5, clock=c)
    h.cut("remote")
    began = c.now
    h.late()
    c.now += 1.6
    h.answered("remote", began)  # past the deadline: still slow
    assert h.unavailable(["remote"])
    began = c.now
    h.late()
    c.now += 1.5
    h.answered("remote", began)
    assert not h.unavailable(["remote"])


def test_too_many_late_lookups_skip_the_lower_tiers() -> None:
    c = Clock()
    h = Health(1.5, clock=c, late_lookups=2)
    h.late()
    assert h.ask("remote", 5.0, h.until()) == Ask(wait=1.5, cut=True)
    h.late()
    assert h.ask("remote", 5.0, h.until()) == Ask(skip="lookups still running")
    h.cut("remote")  # slow and crowded: not even asked in the background
    assert h.ask("remote", 5.0, h.until()) == Ask(skip="it was slow")
    assert not h.settle(0)
    h.answered("remote", c.now)
    h.answered("remote", c.now)
    assert h.settle(0)
    assert h.ask("remote", 5.0, h.until()) == Ask(wait=1.5, cut=True)  # lifted in time


def test_settle_waits_for_the_last_late_lookup() -> None:
    h = Health(1.5)
    h.late()
    t = threading.Timer(0.05, h.answered, ("remote", 0.0))
    t.start()
    try:
        assert h.settle(10)
    finally:
        t.join(10)


def test_a_cut_request_is_worth_a_warning_once_per_warn_every() -> None:
    c = Clock()
    h = Health(1.5, clock=c, warn_every=60.0)
    assert h.warn_due()
    c.now += 59.9
    assert not h.warn_due()
    c.now += 0.1
    assert h.warn_due() and not h.warn_due()


def test_a_request_may_bring_its_own_deadline() -> None:
    """A lookup's own deadline (a prompt cache's ``remote_deadline``) bounds that request
    alone: ``until`` and whether an answer came in time go by it; the store's is kept."""
    c = Clock()
    h = Health(clock=c)
    assert h.until() is None and h.until(0.5) == 100.5
    h.cut("remote")
    began = c.now
    h.late()
    c.now += 0.5
    h.answered("remote", began, 0.5)  # within the request's own deadline: lifted
    assert not h.unavailable(["remote"])
    h = Health(1.5, clock=c)
    assert h.until(0.25) == c.now + 0.25 and h.until() == c.now + 1.5
    h.cut("remote")
    began = c.now
    h.late()
    c.now += 0.5
    h.answered("remote", began, 0.25)  # past its own, though within the store's
    assert h.unavailable(["remote"]) and h.deadline == 1.5
