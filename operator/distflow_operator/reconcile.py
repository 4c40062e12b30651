"""Reconcile one job: observe -> decide -> write status -> act. The I/O shell around the pure core.

Level-based, like a controller-runtime work queue:

- ``kick(job)`` marks a job dirty; at most one reconcile per job runs at a
  time, and kicks that arrive meanwhile coalesce into one more pass. kopf's
  watch events (job or any of its pods changed) kick; so do a periodic resync
  and the decisions' own ``requeue_after`` (backoff, deadline, TTL).
- Reads come from kopf's in-memory indices (the watch caches), never from
  list calls. The cache may lag the operator's own writes; that is safe
  because creates are idempotent (409 = exists), deletes carry a uid
  precondition, and the status the operator wrote last is remembered and
  preferred over a stale copy of it.
- The status (attempt, restarts, times) is written *before* pods are created
  or deleted, so a crash between the two leaves a state the next pass
  completes rather than repeats.
- A reconcile that raises is counted and retried with exponential backoff.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import aiohttp

from distflow_operator.kube import ChildConflict, KubeApi, KubeApiError
from distflow_operator.metrics import JobSample, OperatorMetrics
from distflow_operator.observed import JobView, PodView, job_view, parse_time
from distflow_operator.policy import Decision, decide, run_state
from distflow_operator.progress import scrape_progress
from distflow_operator.render import (
    JobRef, build_config_map, build_headless_service, build_node_pod, build_pod_group,
)
from distflow_operator.status import compute_status, status_patch, transition_events

logger = logging.getLogger("distflow_operator")
JobKey = tuple[str, str]
"""(namespace, name)"""
MAX_ERROR_BACKOFF_S = 60.0


@dataclass
class _JobMemory:
    """What the operator remembers about one job between passes."""

    uid: str
    status: dict[str, Any] | None = None
    """The status as last computed and written."""
    seen_attempt: int = 0
    seen: set[str] = field(default_factory=set)
    """Pods of seen_attempt observed so far: one that vanishes was lost."""
    progress: dict[str, Any] | None = None
    """Last progress scraped from node 0."""

    def lost(self, attempt: int, pods: Iterable[PodView]) -> set[str]:
        names = {p.name for p in pods if p.attempt == attempt}
        if attempt != self.seen_attempt:
            self.seen_attempt, self.seen = attempt, set()
        lost = self.seen - names
        self.seen |= names
        return lost


@dataclass
class _QueueEntry:
    dirty: bool = False
    task: asyncio.Task | None = None
    timer: asyncio.TimerHandle | None = None
    timer_due: float = 0.0
    failures: int = 0


def _first(store: Any) -> Any:
    return next(iter(store), None) if store is not None else None


class Reconciler:
    """Keeps every job's children and status in line with its spec.

    Args:
        jobs: (namespace, name) -> collection holding the job object (kopf index).
        pods: (namespace, job name) -> collection of the job's PodViews (kopf index).
    """

    def __init__(self, api: KubeApi, jobs: Mapping[JobKey, Any], pods: Mapping[JobKey, Any],
                 metrics: OperatorMetrics, *, api_workers: int = 16,
                 clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc)):
        self._api, self._jobs, self._pods, self._metrics, self._clock = api, jobs, pods, metrics, clock
        self._pool = ThreadPoolExecutor(api_workers, thread_name_prefix="distflow-api")
        self._memory: dict[JobKey, _JobMemory] = {}
        self._queue: dict[JobKey, _QueueEntry] = {}

    @property
    def num_jobs(self) -> int:
        return len(self._memory)

    # -- work queue ------------------------------------------------------------------------

    def kick(self, key: JobKey) -> None:
        """Reconcile ``key`` soon (coalesced with any pass already running)."""
        entry = self._queue.setdefault(key, _QueueEntry())
        entry.dirty = True
        if entry.task is None or entry.task.done():
            entry.task = asyncio.get_running_loop().create_task(self._drain(key, entry))

    def _requeue(self, key: JobKey, entry: _QueueEntry, delay: float) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        due = now + delay
        pending = entry.timer is not None and not entry.timer.cancelled() and entry.timer_due > now
        if pending and entry.timer_due <= due:
            return  # an earlier wake-up is already set
        if entry.timer is not None:
            entry.timer.cancel()
        entry.timer, entry.timer_due = loop.call_at(due, self.kick, key), due

    async def _drain(self, key: JobKey, entry: _QueueEntry) -> None:
        while entry.dirty:
            entry.dirty = False
            try:
                delay = await self.reconcile(key)
                entry.failures = 0
                self._metrics.record_reconcile(failed=False)
            except Exception:
                entry.failures += 1
                delay = min(2.0 ** entry.failures, MAX_ERROR_BACKOFF_S)
                self._metrics.record_reconcile(failed=True)
                logger.exception("reconcile %s/%s failed; retrying in %.0fs", *key, delay)
            if delay is not None and key in self._queue:
                self._requeue(key, entry, max(delay, 0.05))

    def forget(self, key: JobKey) -> None:
        """The job is gone: drop its memory, timers and metric series."""
        self._memory.pop(key, None)
        entry = self._queue.pop(key, None)
        if entry is not None and entry.timer is not None:
            entry.timer.cancel()
        self._metrics.forget_job(*key)

    # -- one pass --------------------------------------------------------------------------

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    async def reconcile(self, key: JobKey) -> float | None:
        """One pass for job ``key``; returns seconds until a time-based decision is due."""
        body = _first(self._jobs.get(key))
        if body is None:
            self.forget(key)
            return None
        uid = body["metadata"]["uid"]
        memory = self._memory.get(key)
        if memory is None or memory.uid != uid:
            memory = self._memory[key] = _JobMemory(uid)
        job = job_view(body, memory.status)
        pods = [p for p in self._pods.get(key, ()) if p.owner_uid == uid]
        now = self._clock()
        decision = decide(job, pods, now, memory.lost(run_state(job.status, pods).attempt, pods))
        new = compute_status(job, pods, decision, now, memory.progress)
        if new != job.status:
            patch = status_patch(job.status, new)
            if not await self._call(self._api.patch_job_status, job.namespace, job.name, patch):
                self.forget(key)
                return None
            self._observe_transition(job.status, new, now)
            await self._post_events(job, transition_events(job.status, new))
        memory.status = new
        # Right after the status it mirrors: a reader who sees the new phase in status sees it here too.
        self._metrics.record_job(job.namespace, job.name, JobSample(
            new["phase"], new.get("restarts", 0), new.get("readyNodes", 0), new.get("desiredNodes", 0)))
        try:
            await self._apply(job, decision)
        except (KubeApiError, ChildConflict) as err:
            # Users read `kubectl describe rljob`, not operator logs; the pass is retried with backoff.
            await self._post_events(job, [("Warning", "ReconcileError", str(err))])
            raise
        return decision.requeue_after

    def _observe_transition(self, old: Mapping[str, Any], new: Mapping[str, Any], now: datetime) -> None:
        added = (new.get("restarts") or 0) - (old.get("restarts") or 0)
        if added > 0:
            self._metrics.record_gang_restarts(added)
        if new["phase"] == "Running" and old.get("phase") != "Running":
            starts = [t for t in (parse_time(new.get("startTime")), parse_time(new.get("lastRestartTime"))) if t]
            if starts:
                self._metrics.observe_time_to_running((now - max(starts)).total_seconds())

    async def _post_events(self, job: JobView, events: list[tuple[str, str, str]]) -> None:
        owner = JobRef(job.name, job.namespace, job.uid)
        for event_type, reason, message in events:
            try:
                await self._call(self._api.post_event, owner, event_type, reason, message)
            except Exception as err:  # events are best effort; never fail a reconcile for one
                logger.warning("event %s on %s/%s not recorded: %s", reason, job.namespace, job.name, err)

    async def _apply(self, job: JobView, decision: Decision) -> None:
        if decision.delete_pods:
            await asyncio.gather(*(self._call(self._api.delete_pod, job.namespace, p.name, p.uid)
                                   for p in decision.delete_pods))
        if decision.create_ranks:
            await self._create_pods(job, decision)
        if decision.delete_job:
            await self._call(self._api.delete_job, job.namespace, job.name, job.uid)

    async def _create_pods(self, job: JobView, decision: Decision) -> None:
        owner = JobRef(job.name, job.namespace, job.uid, job.kueue_queue)
        spec, attempt = job.spec, decision.state.attempt
        children = [build_config_map(spec, owner), build_headless_service(spec, owner),
                    build_pod_group(spec, owner)]
        for child in children:
            if child is not None:
                await self._call(self._api.ensure, child, owner)
        pods = [build_node_pod(spec, owner, rank, attempt) for rank in decision.create_ranks]
        created = await asyncio.gather(*(self._call(self._api.create, pod) for pod in pods))
        if any(created):
            await self._post_events(job, [("Normal", "CreatedNodePods",
                                           f"created {sum(created)} node pods for attempt {attempt}")])

    # -- background loops ------------------------------------------------------------------

    async def resync_forever(self, interval_s: float) -> None:
        """Kick every known job periodically: heals anything a missed event left behind."""
        while True:
            await asyncio.sleep(interval_s)
            for key in list(self._jobs):
                self.kick(key)

    def _scrape_targets(self) -> list[tuple[JobKey, str, int]]:
        targets = []
        for key, memory in list(self._memory.items()):
            status = memory.status or {}
            if status.get("phase") != "Running":
                continue
            node0 = next((p for p in self._pods.get(key, ()) if p.rank == 0 and p.owner_uid == memory.uid
                          and p.attempt == status.get("attempt") and p.pod_ip and p.metrics_port), None)
            if node0 is not None:
                targets.append((key, node0.pod_ip, node0.metrics_port))
        return targets

    async def scrape_forever(self, interval_s: float) -> None:
        """Read progress from node 0 of every running job; kick jobs whose progress moved."""
        async with aiohttp.ClientSession() as session:
            while True:
                await asyncio.sleep(interval_s)
                targets = self._scrape_targets()
                results = await asyncio.gather(*(scrape_progress(session, ip, port) for _, ip, port in targets))
                for (key, _, _), progress in zip(targets, results, strict=True):
                    memory = self._memory.get(key)
                    if progress and memory is not None and progress != memory.progress:
                        memory.progress = progress
                        self.kick(key)

    async def close(self) -> None:
        for entry in self._queue.values():
            if entry.timer is not None:
                entry.timer.cancel()
            if entry.task is not None:
                entry.task.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
