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


def test_one_holder_per_term_and_takeover_only_after_the_lease_expires():
    store = FakeLeases()
    a = LeaderElector(store, "ns", lease_duration_s=15, identity="a")
    b = LeaderElector(store, "ns", lease_duration_s=15, identity="b")
    assert a.try_acquire() and not b.try_acquire()
    assert a.try_acquire()  # renewal
    assert store.lease["spec"]["holderIdentity"] == "a" and store.lease["spec"]["leaseTransitions"] == 0
    stale = datetime.now(timezone.utc) - timedelta(seconds=16)
    store.lease["spec"]["renewTime"] = stale.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    assert b.try_acquire() and not a.try_acquire()
    assert store.lease["spec"]["holderIdentity"] == "b" and store.lease["spec"]["leaseTransitions"] == 1


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
