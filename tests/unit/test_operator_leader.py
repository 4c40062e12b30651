"""Lease leader election: one holder per term, takeover only after expiry, renewals keep it."""

from __future__ import annotations

import copy
from datetime import datetime, timedelta, timezone

import pytest

from distflow_operator.leader import LeaderElector

pytestmark = pytest.mark.unit


class FakeLeases:
    """A Lease store with the API server's optimistic concurrency (resourceVersion)."""

    def __init__(self):
        self.lease = None
        self.version = 0

    def request(self, method, path, body=None, *, ok=(200,), **_):
        if method == "GET":
            return (200, copy.deepcopy(self.lease)) if self.lease else (404, {})
        if method == "POST" and self.lease is not None or method == "PUT" and (
                body["metadata"]["resourceVersion"] != self.lease["metadata"]["resourceVersion"]):
            return 409, {}
        self.version += 1
        self.lease = copy.deepcopy(body)
        self.lease["metadata"]["resourceVersion"] = str(self.version)
        return (201 if method == "POST" else 200), {}


class Clock:
    """A replica's monotonic clock, moved by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _elector(store, identity, clock, duration=15):
    elector = LeaderElector(store, "ns", lease_duration_s=duration, identity=identity)
    elector.clock = clock
    return elector


def _skew_renew_time(store, seconds):
    """What a holder whose wall clock is ``seconds`` off writes as its renewTime."""
    skewed = datetime.now(timezone.utc) + timedelta(seconds=seconds)
    store.lease["spec"]["renewTime"] = skewed.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def test_one_holder_per_term_and_takeover_only_after_the_lease_expires():
    store, clock = FakeLeases(), Clock()
    a, b = _elector(store, "a", clock), _elector(store, "b", clock)
    assert a.try_acquire() and not b.try_acquire()
    assert a.try_acquire()  # renewal
    assert store.lease["spec"]["holderIdentity"] == "a" and store.lease["spec"]["leaseTransitions"] == 0
    assert not b.try_acquire()  # b sees the renewal: its own clock counts from now
    clock.now += 14
    assert not b.try_acquire()
    clock.now += 2
    assert b.try_acquire() and not a.try_acquire()
    assert store.lease["spec"]["holderIdentity"] == "b" and store.lease["spec"]["leaseTransitions"] == 1


def test_a_holder_whose_clock_runs_an_hour_behind_keeps_the_lease_while_it_renews():
    store, clock = FakeLeases(), Clock()
    a, b = _elector(store, "a", clock), _elector(store, "b", clock)
    for _ in range(10):  # a renews every 5 s; its renewTime reads an hour old on b's wall clock
        assert a.try_acquire()
        _skew_renew_time(store, -3600 + clock.now)
        assert not b.try_acquire(), "b took a live leader's Lease because of clock skew"
        clock.now += 5
    assert store.lease["spec"]["holderIdentity"] == "a"


def test_a_dead_holder_whose_clock_ran_ahead_is_replaced_after_one_lease_duration():
    store, clock = FakeLeases(), Clock()
    a, b = _elector(store, "a", clock), _elector(store, "b", clock)
    assert a.try_acquire()
    _skew_renew_time(store, 3600)  # a's last renewTime lies an hour in b's future; then a dies
    assert not b.try_acquire()
    clock.now += 15.5
    assert b.try_acquire(), "b waited for a's wall clock instead of one lease duration of its own"
    assert store.lease["spec"]["holderIdentity"] == "b"


def test_a_follower_that_starts_late_waits_a_full_lease_duration_from_its_first_look():
    store, clock = FakeLeases(), Clock()
    a = _elector(store, "a", clock)
    assert a.try_acquire()
    _skew_renew_time(store, -600)  # looks stale by wall clock, but b has never seen it change
    clock.now += 100
    b = _elector(store, "b", clock)
    assert not b.try_acquire()
    clock.now += 10
    assert not b.try_acquire()
    clock.now += 6
    assert b.try_acquire()


def test_a_write_that_lost_the_race_does_not_win():
    store = FakeLeases()
    a = LeaderElector(store, "ns", identity="a")
    assert a.try_acquire()
    real_get = store.request

    def racing(method, path, body=None, **kw):
        answer = real_get(method, path, body, **kw)
        if method == "GET":  # someone renews between our read and our write
            store.version += 1
            store.lease["metadata"]["resourceVersion"] = str(store.version)
        return answer
    store.request = racing
    assert not a.try_acquire()


def test_a_released_lease_is_taken_at_once_and_the_releaser_stops_leading():
    store, clock = FakeLeases(), Clock()
    a, b = _elector(store, "a", clock), _elector(store, "b", clock)
    assert a.try_acquire()
    a._renewed_at = clock.now
    assert not b.try_acquire() and a.is_leader
    assert a.release() and not a.is_leader
    assert b.try_acquire(), "b waited a lease duration for a Lease that was given up"
    assert store.lease["spec"]["holderIdentity"] == "b" and store.lease["spec"]["leaseTransitions"] == 1
    assert not a.release()  # no longer the holder: b's Lease is left alone
    assert store.lease["spec"]["holderIdentity"] == "b"
