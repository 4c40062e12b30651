"""Leader election on a coordination.k8s.io Lease, as client-go's leaderelection does.

Every replica watches and keeps its caches warm; only the holder of the Lease
reconciles. The holder renews every ``lease_duration/3`` seconds and stops
acting as soon as it could not renew for ``renew_deadline`` (< lease
duration), so a replica that was paused or cut off has stepped down before
another one may take the Lease over. Writes to the Lease are conditional on
its resourceVersion: two candidates never both win one term. Status patches
are conditional on the job's resourceVersion too (reconcile.py), which
covers the last window of a replica that is frozen between its check and its
write. The Lease's calls run on a thread of their own, through a client of
their own without the reconciler's rate limit: a burst of reconciles queued
on the shared pool or the rate limit never delays a renewal past the
deadline.

Expiry never compares another replica's ``renewTime`` with the local clock
(clocks of two nodes may be seconds apart: a follower whose clock runs ahead
would take a live leader's Lease, and there would be two leaders). As in
client-go, a follower records, by its own monotonic clock, when it observed
the Lease's record change (holder, renewTime, transitions); the holder has
expired once ``leaseDurationSeconds`` passed since that local observation
with no further change.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

from distflow_operator.kube import KubeApi

logger = logging.getLogger("distflow_operator")
LEASE_NAME = "distflow-operator"


def _micro_time(value: datetime) -> str:
    return value.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """Holds or waits for Lease ``namespace/LEASE_NAME``; ``is_leader`` says which."""

    def __init__(self, api: KubeApi, namespace: str, *, lease_duration_s: float = 15.0,
                 on_elected: Callable[[], None] = lambda: None, identity: str | None = None):
        self._api, self._namespace, self._duration = api, namespace, lease_duration_s
        self._renew_deadline = lease_duration_s * 2 / 3
        self._on_elected = on_elected
        self.identity = identity or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._renewed_at = float("-inf")
        """time.monotonic() of the last successful acquire or renew."""
        self._observed_record: tuple[Any, ...] | None = None
        self._observed_at = float("-inf")
        """time.monotonic() when this replica first saw ``_observed_record``."""
        self.clock: Callable[[], float] = time.monotonic
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="distflow-lease")

    @property
    def is_leader(self) -> bool:
        return self.clock() - self._renewed_at < self._renew_deadline

    def _holder_expired(self, spec: dict[str, Any]) -> bool:
        """True once the Lease record has not changed for its leaseDurationSeconds, by the local clock."""
        record = (spec.get("holderIdentity"), spec.get("renewTime"), spec.get("acquireTime"),
                  spec.get("leaseTransitions"), spec.get("leaseDurationSeconds"))
        now = self.clock()
        if record != self._observed_record:
            self._observed_record, self._observed_at = record, now
        return now - self._observed_at > (spec.get("leaseDurationSeconds") or self._duration)

    def _path(self, name: str = LEASE_NAME) -> str:
        return f"/apis/coordination.k8s.io/v1/namespaces/{self._namespace}/leases/{name}"

    def _spec(self, transitions: int, acquired: str | None) -> dict[str, Any]:
        now = _micro_time(datetime.now(timezone.utc))
        return {"holderIdentity": self.identity, "leaseDurationSeconds": max(1, round(self._duration)),
                "acquireTime": acquired or now, "renewTime": now, "leaseTransitions": transitions}

    def try_acquire(self) -> bool:
        """One acquire-or-renew round trip; True if this replica holds the Lease now."""
        status, lease = self._api.request("GET", self._path(), ok=(200, 404))
        if status == 404:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": LEASE_NAME, "namespace": self._namespace}, "spec": self._spec(0, None)}
            status, _ = self._api.request("POST", self._path().rsplit("/", 1)[0], body, ok=(201, 409))
            return status == 201
        spec = lease.get("spec") or {}
        mine = spec.get("holderIdentity") == self.identity
        if not mine and spec.get("holderIdentity") and not self._holder_expired(spec):
            return False
        transitions = (spec.get("leaseTransitions") or 0) + (not mine)
        lease["spec"] = self._spec(transitions, spec.get("acquireTime") if mine else None)
        status, _ = self._api.request("PUT", self._path(), lease, ok=(200, 409))  # 409: someone else won
        return status == 200

    def release(self) -> bool:
        """Give the Lease up (a replica stopping gracefully, e.g. in a rolling update), so a follower
        takes it at its next try instead of after a lease duration; True if this replica held it."""
        status, lease = self._api.request("GET", self._path(), ok=(200, 404))
        if status == 404 or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
            return False
        self._renewed_at = float("-inf")  # stop acting before the Lease says anyone else may
        lease["spec"] = {**lease["spec"], "holderIdentity": "", "leaseDurationSeconds": 1,
                         "renewTime": _micro_time(datetime.now(timezone.utc))}
        status, _ = self._api.request("PUT", self._path(), lease, ok=(200, 409))
        return status == 200

    async def _call(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn)

    async def run(self) -> None:
        """Acquire and renew forever."""
        while True:
            was_leader = self.is_leader
            # The Lease was written at the start of the round trip at the latest: count from there,
            # so a call that hung does not stretch this replica's term past what the Lease says.
            started = self.clock()
            try:
                if await self._call(self.try_acquire):
                    self._renewed_at = started
            except Exception as err:  # API server unreachable: the renew deadline makes this replica step down
                logger.warning("lease %s/%s: %s", self._namespace, LEASE_NAME, err)
            if self.is_leader and not was_leader:
                logger.info("leader election: %s leads", self.identity)
                self._on_elected()
            elif was_leader and not self.is_leader:
                logger.warning("leader election: %s lost the lease; standing by", self.identity)
            await asyncio.sleep(self._duration / 3 if self.is_leader else self._duration / 5)

    async def stop(self) -> None:
        """Give the Lease up if held (best effort: otherwise it expires), then close the client."""
        try:
            await self._call(self.release)
        except Exception as err:
            logger.warning("releasing lease %s/%s failed: %s", self._namespace, LEASE_NAME, err)
        self._thread.shutdown(wait=False)
        self._api.close()
