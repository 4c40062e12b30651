"""Reconcile one job: observe -> decide -> write status -> act. The I/O shell around the pure core.

Level-based, like a controller-runtime work queue:

- ``kick(job)`` marks a job dirty; at most one reconcile per job runs at a
  time, and kicks that arrive meanwhile coalesce into one more pass. kopf's
  watch events (job or any of its pods changed) kick; so do a periodic resync
  and the decisions' own ``requeue_after`` (backoff, deadline, TTL).
- Reads come from in-memory caches: kopf's job index and the pod cache
  (podcache.py), fed by watch events and replaced every resync by a LIST of
  distflow's pods, so a pod deleted while a watch was down cannot linger.
  The caches may lag the operator's own writes; that is safe because
  creates are idempotent (409 = exists), deletes carry a uid precondition,
  and the status the operator wrote last is remembered and preferred over
  an older copy of the job (never over a newer one); status patches carry
  the job's resourceVersion, so a concurrent writer makes it decide again.
- The status (attempt, restarts, times) is written *before* pods are created
  or deleted, so a crash between the two leaves a state the next pass
  completes rather than repeats.
- A reconcile that raises is counted and retried with exponential backoff.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import aiohttp

from distflow_operator.kube import ChildConflict, KubeApi, KubeApiError, StatusConflict
from distflow_operator.metrics import JobSample, OperatorMetrics
from distflow_operator.observed import JobView, PodView, job_view, parse_time
from distflow_operator.podcache import PodCache
from distflow_operator.policy import Decision, Rejection, decide, run_state
from distflow_operator.progress import scrape_progress
from distflow.resize import RESIZE_KEY

from distflow_operator.render import (
    JobRef, build_config_map, build_headless_service, build_node_pod, build_pod_groups, config_map_name,
    resize_request_value,
)
from distflow_operator.stale import STALE_REASON, UNOWNED_REASON, clear_stale_pods
from distflow_operator.status import compute_status, status_patch, transition_events

logger = logging.getLogger("distflow_operator")
JobKey = tuple[str, str]
"""(namespace, name)"""
MAX_ERROR_BACKOFF_S = 60.0
EVENT_DEDUP_S = 600.0
CONFLICT_RETRY_S = 0.5
REFUSED_CREATE_ERRORS = (400, 403, 404, 422)
"""Answers that refuse a pod creation (bad volume, PodSecurity, quota; 404: a child's kind is not served,
e.g. a PodGroup without its scheduler's CRD): remembered as a policy.Rejection, reported in the status at
once, retried with backoff (policy.refused_retry_delay) and bounded by the policy."""


def _newer(a: str | None, b: str | None) -> str | None:
    """The later of two resourceVersions (etcd revisions; opaque by contract, numeric in practice)."""
    if not a or not b:
        return a or b
    try:
        return a if int(a) >= int(b) else b
    except ValueError:
        return b


@dataclass
class _JobMemory:
    """What the operator remembers about one job between passes."""

    uid: str
    status: dict[str, Any] | None = None
    """The status as last computed and written."""
    seen_attempt: int = 0
    seen: dict[str, str] = field(default_factory=dict)
    """uid -> name of the pods of seen_attempt observed so far: one that vanishes was lost."""
    deleted: set[str] = field(default_factory=set)
    """uids of pods of seen_attempt the operator deleted itself (an in-place shrink's leaving ranks, a
    withdrawn grow's joiners): their going is no loss, even while a new pod of the same name is on its way."""
    progress: dict[str, Any] | None = None
    """Last progress scraped from node 0."""
    resource_version: str | None = None
    """The job's resourceVersion after our last status write."""
    rejected: Rejection | None = None
    """The API server's refusals of the node pods (4xx) since it last accepted one."""
    posted: dict[tuple[str, str, str], float] = field(default_factory=dict)
    """Events posted recently -> when: the same event is not posted again within EVENT_DEDUP_S."""
    resize_request: str | None = None
    """The request last written to the ConfigMap key ``resize`` (None: none, or removed since)."""

    def lost(self, attempt: int, pods: Iterable[PodView]) -> dict[str, str]:
        """uid -> name of the pods of ``attempt`` seen before and gone now, not deleted by the operator."""
        present = {p.uid: p.name for p in pods if p.attempt == attempt}
        if attempt != self.seen_attempt:
            self.seen_attempt, self.seen, self.deleted = attempt, {}, set()
        self.seen.update(present)
        return {uid: name for uid, name in self.seen.items() if uid not in present and uid not in self.deleted}


@dataclass
class _QueueEntry:
    dirty: bool = False
    task: asyncio.Task | None = None
    timer: asyncio.TimerHandle | None = None
    timer_due: float = 0.0
    failures: int = 0


def _refusal_message(job: JobView, err: KubeApiError) -> str:
    if err.status != 404:
        return str(err)
    scheduler = job.spec.scheduling.batch_scheduler if job.spec is not None else "none"
    return (f"{err}: this cluster does not serve that kind; spec.scheduling.batchScheduler={scheduler} needs "
            "its scheduler and PodGroup CRD installed (or set batchScheduler: none)")


def _first(store: Any) -> Any:
    return next(iter(store), None) if store is not None else None


class Reconciler:
    """Keeps every job's children and status in line with its spec.

    Args:
        jobs: (namespace, name) -> collection holding the job object (kopf index).
        pods: the node pod cache the watch feeds; relisted every resync with ``pod_selector``.
    """

    def __init__(self, api: KubeApi, jobs: Mapping[JobKey, Any], pods: PodCache,
                 metrics: OperatorMetrics, *, api_workers: int = 16, pod_selector: str = "",
                 clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc)):
        self._api, self._jobs, self._metrics, self._clock = api, jobs, metrics, clock
        self.pods = self._pods = pods
        self._pod_selector = pod_selector
        self._listed_namespaces: set[str] = set()
        """Namespaces whose pods a LIST has answered for: before that, an empty cache is not 'no pods'."""
        self.is_leader: Callable[[], bool] = lambda: True
        """False while another replica holds the leader Lease: watch, but do not act."""
        self._pool = ThreadPoolExecutor(api_workers, thread_name_prefix="distflow-api")
        self._memory: dict[JobKey, _JobMemory] = {}
        self._queue: dict[JobKey, _QueueEntry] = {}
        self._queue_depth = 0
        """Entries marked dirty whose pass has not started: the work queue's depth."""
        self._ghosts: dict[JobKey, str] = {}
        """Jobs the index still holds but a LIST said are gone (deleted while a watch was down) -> uid.
        The index is fed by watch events; one whose DELETED event a watch gap swallowed would stay."""

    @property
    def num_jobs(self) -> int:
        return len(self._memory)

    # -- work queue ------------------------------------------------------------------------

    def _mark(self, entry: _QueueEntry, dirty: bool) -> None:
        if entry.dirty != dirty:
            self._queue_depth += 1 if dirty else -1
            self._metrics.set_queue_depth(self._queue_depth)
        entry.dirty = dirty

    def kick(self, key: JobKey) -> None:
        """Reconcile ``key`` soon (coalesced with any pass already running)."""
        entry = self._queue.setdefault(key, _QueueEntry())
        self._mark(entry, True)
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
            self._mark(entry, False)
            started = time.monotonic()
            try:
                delay = await self.reconcile(key)
                entry.failures = 0
                self._metrics.record_reconcile(failed=False, seconds=time.monotonic() - started)
            except Exception:
                entry.failures += 1
                delay = min(2.0 ** entry.failures, MAX_ERROR_BACKOFF_S)
                self._metrics.record_reconcile(failed=True, seconds=time.monotonic() - started)
                logger.exception("reconcile %s/%s failed; retrying in %.0fs", *key, delay)
            if delay is not None and key in self._queue:
                self._requeue(key, entry, max(delay, 0.05))

    def forget(self, key: JobKey) -> None:
        """The job is gone: drop its memory, timers and metric series."""
        self._memory.pop(key, None)
        entry = self._queue.pop(key, None)
        if entry is not None:
            self._mark(entry, False)
            if entry.timer is not None:
                entry.timer.cancel()
        self._metrics.forget_job(*key)

    # -- one pass --------------------------------------------------------------------------

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a blocking API call on the reconciler's thread pool."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))
    def kick_all(self) -> None:
        for key in list(self._jobs):
            if key not in self._ghosts:
                self.kick(key)

    def elected(self) -> None:
        """This replica leads (again): what it remembered may be stale, so start from the API's state."""
        for memory in self._memory.values():
            memory.status, memory.resource_version = None, None
        self._metrics.forget_jobs()
        self.kick_all()

    async def reconcile(self, key: JobKey) -> float | None:
        """One pass for job ``key``; returns seconds until a time-based decision is due."""
        if not self.is_leader():
            return None  # the leader reconciles; kick_all runs when this replica is elected
        if self._pod_selector and key[0] not in self._listed_namespaces:
            # The first resync may have run before the job index knew this job's namespace.
            await self._list_pods({key[0]})
        body = _first(self._jobs.get(key))
        if body is None or self._ghosts.get(key) == body["metadata"]["uid"]:
            self.forget(key)
            return None
        uid = body["metadata"]["uid"]
        memory = self._memory.get(key)
        if memory is None or memory.uid != uid:
            memory = self._memory[key] = _JobMemory(uid)
        body_version = body["metadata"].get("resourceVersion")
        # Our last write wins over a watch that has not delivered it yet, never over a newer object.
        ours = _newer(memory.resource_version, body_version) == memory.resource_version
        job = job_view(body, memory.status if ours else None)
        if job.deleting:
            return None  # the garbage collector removes the children; the status stays as it was
        labelled = self._pods.get(key, ())
        pods = [p for p in labelled if p.owner_uid == uid]
        now = self._clock()
        attempt = run_state(job.status, pods).attempt
        lost = memory.lost(attempt, pods)
        evicted = self._pods.disrupted(key, uid, attempt) if lost and isinstance(self._pods, PodCache) else ()
        disrupted = {name for pod_uid, name in lost.items() if pod_uid in evicted}
        decision = clear_stale_pods(job, [p for p in labelled if p.owner_uid != uid],
                                    decide(job, pods, now, set(lost.values()), memory.rejected, disrupted), now)
        new = compute_status(job, pods, decision, now, memory.progress)
        if new != job.status:
            version = _newer(memory.resource_version, body_version)
            try:
                written = await self.call(self._api.patch_job_status, job.namespace, job.name,
                                           status_patch(job.status, new), version)
            except StatusConflict:
                # Someone else changed the job (a spec edit, another replica): decide again on fresh data.
                memory.status, memory.resource_version = None, None
                return CONFLICT_RETRY_S
            if written is None:
                self.forget(key)
                return None
            memory.resource_version = written
            self._observe_transition(job.status, new, now)
        memory.status = new
        # Right after the status it mirrors, before any other API call (the events below): a reader
        # who sees the new phase in status sees it here too.
        self._metrics.record_job(job.namespace, job.name, JobSample(
            new["phase"], new.get("restarts", 0), new.get("readyNodes", 0), new.get("desiredNodes", 0)))
        if new != job.status:
            await self._post_events(job, transition_events(job.status, new))
        if decision.waiting and decision.waiting[0] in (STALE_REASON, UNOWNED_REASON):
            await self._post_events(job, [("Warning", *decision.waiting)])
        if await self._act(job, memory, decision, now) is False:
            # The next pass, at once, reports the refusal in the status; the policy holds the next try
            # until refused_retry_delay has passed, however often the job is kicked meanwhile.
            return 0.0
        return decision.requeue_after

    async def _act(self, job: JobView, memory: _JobMemory, decision: Decision, now: datetime) -> bool:
        """Apply the decision; False when the API server refused the pods (4xx), which is
        remembered for the policy (policy.Rejection) instead of being retried silently.

        Raises:
            KubeApiError, ChildConflict: anything else; the pass is retried with backoff.
        """
        request = (resize_request_value(decision.resize_request, decision.resize_rollout_nodes,
                                        decision.resize_in_place)
                   if decision.resize_request is not None else None)
        in_place = request if decision.resize_rollout_nodes is not None or decision.resize_in_place else None
        memory.deleted.update(p.uid for p in decision.delete_pods)
        try:
            await self._apply(job, decision, in_place)
            if decision.create_ranks:
                memory.resize_request = in_place  # the ConfigMap was written as rendered: with an in-place request only
            await self._request_resize(job, memory, request, in_place is not None)
        except KubeApiError as err:
            if decision.create_ranks and err.status in REFUSED_CREATE_ERRORS:
                last, message = memory.rejected, _refusal_message(job, err)
                memory.rejected = Rejection(last.tries + 1 if last else 1, err.status, message,
                                            last.since if last else now, now)
                await self._post_events(job, [("Warning", "PodCreationRejected", message)])
                return False
            await self._post_events(job, [("Warning", "ReconcileError", str(err))])
            raise
        except ChildConflict as err:
            # Users read `kubectl describe rljob`, not operator logs.
            await self._post_events(job, [("Warning", "ReconcileError", str(err))])
            raise
        if decision.create_ranks:
            memory.rejected = None
        return True

    async def _request_resize(self, job: JobView, memory: _JobMemory, value: str | None, in_place: bool) -> None:
        """Write (or withdraw) the ConfigMap's resize request when it differs from what was written; an
        in-place request (of the rollout pool or the whole gang) goes with the spec at the new size, in
        one update."""
        if value == memory.resize_request:
            return
        if in_place:
            owner = JobRef(job.name, job.namespace, job.uid, job.kueue_queue)
            await self.call(self._api.ensure, build_config_map(job.spec, owner, value), owner)
        else:
            await self.call(self._api.set_config_map_key, job.namespace, config_map_name(job.name), RESIZE_KEY,
                            value)
        memory.resize_request = value

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
        memory = self._memory.get((job.namespace, job.name))
        now = asyncio.get_running_loop().time()
        for event_type, reason, message in events:
            if memory is not None:
                # A failure retried with backoff would otherwise post the same Event every pass.
                memory.posted = {k: t for k, t in memory.posted.items() if now - t < EVENT_DEDUP_S}
                if (event_type, reason, message) in memory.posted:
                    continue
                memory.posted[(event_type, reason, message)] = now
            try:
                await self.call(self._api.post_event, owner, event_type, reason, message)
            except Exception as err:  # events are best effort; never fail a reconcile for one
                logger.warning("event %s on %s/%s not recorded: %s", reason, job.namespace, job.name, err)

    async def _apply(self, job: JobView, decision: Decision, in_place: str | None = None) -> None:
        if decision.delete_pods:
            gone = await asyncio.gather(*(self.call(self._api.delete_pod, job.namespace, p.name, p.uid)
                                          for p in decision.delete_pods))
            # No watch event will ever say so for a pod that is already gone: drop it now.
            if any(self._pods.forget(p.uid) for p, was_gone in zip(decision.delete_pods, gone, strict=True)
                   if was_gone):
                self.kick((job.namespace, job.name))
        for pod in decision.force_delete_pods:
            logger.warning("%s/%s: pod %s still Terminating past its timeout; force-deleting it",
                           job.namespace, job.name, pod.name)
            await self.call(self._api.force_delete_pod, job.namespace, pod.name, pod.uid)
        if decision.create_ranks:
            await self._create_pods(job, decision, in_place)
        if decision.delete_job:
            await self.call(self._api.delete_job, job.namespace, job.name, job.uid)

    async def _create_pods(self, job: JobView, decision: Decision, in_place: str | None = None) -> None:
        """Ensure the ConfigMap (with ``in_place``'s request, rendered by resize_request_value),
        Service and PodGroups, then create the decision's node pods."""
        owner = JobRef(job.name, job.namespace, job.uid, job.kueue_queue)
        spec, attempt = job.spec, decision.state.attempt
        children = [build_config_map(spec, owner, in_place), build_headless_service(spec, owner),
                    *build_pod_groups(spec, owner)]
        for child in children:
            await self.call(self._api.ensure, child, owner)
        pods = [build_node_pod(spec, owner, rank, attempt, decision.joining) for rank in decision.create_ranks]
        created = await asyncio.gather(*(self.call(self._api.create, pod) for pod in pods))
        if any(created):
            joining = ", joining its running gang (an in-place resize)" if decision.joining else ""
            await self._post_events(job, [("Normal", "CreatedNodePods",
                                           f"created {sum(created)} node pods for attempt {attempt}{joining}")])

    # -- background loops ------------------------------------------------------------------

    async def relist_pods(self) -> None:
        """LIST distflow's pods in every namespace with jobs and replace the pod cache with the answer."""
        await self._list_pods({ns for ns, _ in list(self._jobs)})

    async def _list_pods(self, namespaces: set[str]) -> None:
        mark = self._pods.begin_list()
        listed = await asyncio.gather(*(self.call(self._api.list_pods, ns, self._pod_selector)
                                        for ns in sorted(namespaces)))
        self._metrics.record_pods_received(listed=sum(len(items) for items in listed))
        for key in self._pods.replace(mark, [pod for items in listed for pod in items], namespaces):
            self.kick(key)
        self._listed_namespaces |= namespaces

    async def relist_jobs(self) -> None:
        """LIST the jobs of every namespace the index knows; a job the index holds that the LIST does
        not (and that is not newer than the LIST) was deleted during a watch gap: forget it."""
        index = {key: body for key in list(self._jobs) if (body := _first(self._jobs.get(key))) is not None}
        namespaces = sorted({ns for ns, _ in index})
        answers = await asyncio.gather(*(self.call(self._api.list_jobs, ns) for ns in namespaces))
        listed = {(ns, item["metadata"]["name"]) for ns, (items, _) in zip(namespaces, answers, strict=True)
                  for item in items}
        at = dict(zip(namespaces, (version for _, version in answers), strict=True))
        self._ghosts = {key: uid for key, uid in self._ghosts.items() if key in index}
        for key, body in index.items():
            meta = body["metadata"]
            if key in listed or _newer(meta.get("resourceVersion"), at[key[0]]) != at[key[0]]:
                continue
            if self._ghosts.get(key) != meta["uid"]:
                logger.info("%s/%s was deleted while a watch was down; forgetting it", *key)
                self._ghosts[key] = meta["uid"]
            self.forget(key)

    async def resync(self) -> None:
        """Relist jobs and pods, then kick every known job: heals what a missed event left behind."""
        for relist in (self.relist_jobs, self.relist_pods):
            try:
                await relist()
            except Exception as err:  # the API server may be restarting; the next resync lists again
                logger.warning("%s failed: %s", relist.__name__, err)
        self.kick_all()

    async def resync_forever(self, interval_s: float) -> None:
        while True:
            await self.resync()
            await asyncio.sleep(interval_s)

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
