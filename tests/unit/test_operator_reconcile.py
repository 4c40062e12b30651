"""The reconciler against an in-memory API: call order, idempotence, coalescing, retries."""

from __future__ import annotations

import asyncio
import copy
import itertools
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml

from distflow_operator.kube import ChildConflict, StatusConflict
from distflow_operator.metrics import OperatorMetrics
from distflow_operator.observed import parse_time, pod_view
from distflow_operator.podcache import PodCache
from distflow_operator.reconcile import CONFLICT_RETRY_S, Reconciler

pytestmark = pytest.mark.unit

KEY = ("ns", "grpo-tiny")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rljob.yaml"


def merge_patch(target: dict, patch: dict) -> dict:
    """``target`` with JSON merge patch ``patch`` applied (RFC 7386), as the API server does."""
    out = dict(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_patch(out[key], value)
        else:
            out[key] = value
    return out


class FakeApi:
    """Records calls; created pods appear in the pod index as Running at once (like kwok)."""

    def __init__(self, pods: dict, update_index_status: bool = True):
        self.pods, self.update_index_status = pods, update_index_status
        self.calls: list[tuple] = []
        self.jobs: dict = {}
        self.taken: set[str] = set()
        self.config_maps: list[dict] = []
        """The data of every ConfigMap ensured, in order."""
        self.created: dict[str, dict] = {}
        """name -> the last pod created under it."""

    def patch_job_status(self, namespace, name, patch, resource_version=None):
        self.calls.append(("status", patch.get("phase"), patch.get("attempt")))
        if self.update_index_status:
            body = self.jobs[(namespace, name)][0]
            body["status"] = merge_patch(body.get("status", {}), patch)
        return str(len(self.calls))

    def ensure(self, obj, owner):
        self.calls.append(("ensure", obj["kind"]))
        if obj["kind"] == "ConfigMap":
            self.config_maps.append(obj["data"])
        if obj["metadata"]["name"] in self.taken:
            raise ChildConflict(f"{obj['kind']} {obj['metadata']['name']} exists and is not controlled by it")

    def create(self, pod):
        self.calls.append(("create", pod["metadata"]["name"], pod["metadata"]["labels"]["distflow.io/attempt"]))
        pod = copy.deepcopy(pod)
        self.created[pod["metadata"]["name"]] = pod
        pod["metadata"]["uid"] = f"uid-{len(self.calls)}"
        pod["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
        self.pods.setdefault(KEY, []).append(pod_view(pod))
        return True

    def delete_pod(self, namespace, name, uid):
        self.calls.append(("delete", name))
        self.pods[KEY] = [p for p in self.pods[KEY] if p.uid != uid]

    def force_delete_pod(self, namespace, name, uid):
        self.calls.append(("force-delete", name))

    def set_config_map_key(self, namespace, name, key, value):
        self.calls.append(("config-map", name, key, value))

    def delete_job(self, namespace, name, uid):
        self.calls.append(("delete-job", name))

    def post_event(self, owner, event_type, reason, message):
        self.calls.append(("event", reason))


def setup(backoff=0, update_index_status=True):
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"].update(namespace="ns", uid="job-uid", generation=1)
    doc["spec"]["runPolicy"]["backoffSeconds"] = backoff
    pods: dict = {}
    api = FakeApi(pods, update_index_status)
    api.jobs = {KEY: [doc]}
    metrics = OperatorMetrics()
    return Reconciler(api, api.jobs, pods, metrics), api, doc, pods, metrics


def fail(pods, index, **changes):
    pods[KEY][index] = replace(pods[KEY][index], **{"phase": "Failed", "exit_code": 1, "ready": False, **changes})


def test_status_is_written_before_children_are_created():
    reconciler, api, doc, _, _ = setup()
    asyncio.run(reconciler.reconcile(KEY))
    assert api.calls == [
        ("status", "Pending", 1), ("ensure", "ConfigMap"), ("ensure", "Service"),
        ("create", "grpo-tiny-node-0", "1"), ("create", "grpo-tiny-node-1", "1"),
        ("event", "CreatedNodePods")]


def test_a_steady_job_costs_no_api_calls():
    reconciler, api, doc, _, _ = setup()

    async def passes():
        for _ in range(3):
            await reconciler.reconcile(KEY)
    asyncio.run(passes())
    assert doc["status"]["phase"] == "Running"
    calls = len(api.calls)
    asyncio.run(reconciler.reconcile(KEY))
    assert len(api.calls) == calls


def test_an_in_place_request_goes_with_the_spec_once_and_an_exit_3_starts_the_new_size():
    reconciler, api, doc, pods, _ = setup()

    async def scenario():
        for _ in range(2):
            await reconciler.reconcile(KEY)
        doc["spec"]["cluster"]["numNodes"] = 1
        api.calls.clear()
        for _ in range(3):  # the request is written on the first pass only
            await reconciler.reconcile(KEY)
        requested = list(api.calls), api.config_maps[-1]
        api.calls.clear()
        fail(pods, 0, exit_code=3)  # a worker image that stops instead of resizing in place
        for _ in range(3):  # the new attempt at 1 node; then steady
            await reconciler.reconcile(KEY)
        return requested
    requested, data = asyncio.run(scenario())
    # The request and the spec at the new size in one update of the ConfigMap.
    assert requested == [("status", None, None), ("event", "ResizeRequested"), ("ensure", "ConfigMap")]
    assert data["resize"] == '{"numNodes": 1, "inPlace": true}'
    assert "numNodes" not in (yaml.safe_load(data["spec.yaml"])["spec"].get("cluster") or {})  # 1: the default
    assert api.calls[:3] == [("status", "Restarting", 2), ("delete", "grpo-tiny-node-0"),
                             ("delete", "grpo-tiny-node-1")], api.calls
    assert [c for c in api.calls if c[0] == "create"] == [("create", "grpo-tiny-node-0", "2")]
    # The request goes with the attempt (and the new attempt's ConfigMap is rendered whole, without it).
    assert [c for c in api.calls if c[0] == "config-map"] == [("config-map", "grpo-tiny-config", "resize", None)]
    assert "resize" not in api.config_maps[-1]
    assert (doc["status"]["restarts"], doc["status"]["attemptNodes"], doc["status"]["lastResize"]["to"]) == (0, 1, 1)


def test_an_in_place_shrink_and_grow_back_keep_the_attempt_and_lose_no_pod():
    reconciler, api, doc, pods, _ = setup()

    async def passes(n):
        for _ in range(n):
            await reconciler.reconcile(KEY)

    async def scenario():
        await passes(2)
        doc["spec"]["cluster"]["numNodes"] = 1
        await passes(1)
        fail(pods, 1, exit_code=4)  # rank 1 leaves at a step boundary
        await passes(2)  # its pod deleted; then the shrink is done
        shrunk = (copy.deepcopy(doc["status"]), reconciler._memory[KEY].lost(1, pods[KEY]))
        api.calls.clear()
        doc["spec"]["cluster"]["numNodes"] = 2
        await passes(2)  # the joiner created (Running at once here); then the grow is done
        return shrunk
    shrunk, lost = asyncio.run(scenario())
    assert (shrunk["attempt"], shrunk["restarts"], shrunk["attemptNodes"], shrunk["lastResize"]["inPlace"]) == \
        (1, 0, 1, True)
    assert lost == {}  # the pod the operator deleted itself is no loss, even once rank 1 comes back
    assert [c for c in api.calls if c[0] in ("create", "delete")] == [("create", "grpo-tiny-node-1", "1")]
    env = {e["name"]: e.get("value") for e in api.created["grpo-tiny-node-1"]["spec"]["containers"][0]["env"]}
    assert (env["DISTFLOW_JOIN"], env["PET_NNODES"], env["PET_NODE_RANK"]) == ("1", "2", "1")
    assert api.config_maps[-1]["resize"] == '{"numNodes": 2, "inPlace": true}'
    status = doc["status"]
    assert (status["attempt"], status["restarts"], status["attemptNodes"], status["phase"]) == (1, 0, 2, "Running")
    assert (status["lastResize"]["from"], status["lastResize"]["to"], status["lastResize"]["inPlace"]) == (1, 2, True)


def test_gang_restart_writes_the_attempt_then_replaces_every_pod():
    reconciler, api, doc, pods, metrics = setup()

    async def scenario():
        await reconciler.reconcile(KEY)
        await reconciler.reconcile(KEY)
        api.calls.clear()
        fail(pods, 1)
        for _ in range(3):  # decide the restart; recreate; observe the new pods running
            await reconciler.reconcile(KEY)
    asyncio.run(scenario())
    assert api.calls[:4] == [("status", "Restarting", 2), ("event", "NodeFailed"),
                             ("delete", "grpo-tiny-node-0"), ("delete", "grpo-tiny-node-1")]
    assert ("create", "grpo-tiny-node-0", "2") in api.calls and ("create", "grpo-tiny-node-1", "2") in api.calls
    assert doc["status"]["restarts"] == 1 and doc["status"]["phase"] == "Running"
    assert metrics._gang_restarts == 1


def test_a_status_write_that_lost_a_race_acts_on_nothing_and_decides_again():
    reconciler, api, doc, _, _ = setup()
    write = api.patch_job_status
    races = iter([True])

    def racing(namespace, name, patch, resource_version=None):
        if next(races, False):  # another writer changed the job since the version this pass read
            api.calls.append(("conflict", patch.get("phase")))
            raise StatusConflict(f"{name} changed since resourceVersion {resource_version}")
        return write(namespace, name, patch, resource_version)

    api.patch_job_status = racing
    first = asyncio.run(reconciler.reconcile(KEY))
    assert (api.calls, first) == ([("conflict", "Pending")], CONFLICT_RETRY_S)
    asyncio.run(reconciler.reconcile(KEY))
    assert api.calls[1:3] == [("status", "Pending", 1), ("ensure", "ConfigMap")]


def test_own_status_write_wins_over_a_stale_watch_cache():
    reconciler, api, doc, pods, _ = setup(backoff=30, update_index_status=False)

    async def scenario():
        await reconciler.reconcile(KEY)
        await reconciler.reconcile(KEY)
        fail(pods, 0)
        first = await reconciler.reconcile(KEY)
        await reconciler.reconcile(KEY)  # the index still shows attempt 1 and no status
        return first
    requeue = asyncio.run(scenario())
    restarts = [c for c in api.calls if c[0] == "status" and c[1] == "Restarting"]
    assert restarts == [("status", "Restarting", 2)] and requeue == 30
    assert not [c for c in api.calls if c[0] == "create" and c[2] == "2"]  # still in backoff


def test_a_pod_that_vanishes_restarts_the_gang():
    reconciler, api, doc, pods, _ = setup()

    async def scenario():
        await reconciler.reconcile(KEY)
        await reconciler.reconcile(KEY)
        pods[KEY] = pods[KEY][1:]  # node 0 deleted behind the operator's back
        await reconciler.reconcile(KEY)
    asyncio.run(scenario())
    assert doc["status"]["attempt"] == 2 and doc["status"]["reason"] == "NodeLost"


def test_kicks_coalesce_and_errors_are_counted_and_retried():
    reconciler, api, doc, pods, metrics = setup()
    runs = []

    async def flaky(key):
        runs.append(key)
        await asyncio.sleep(0.01)
        if len(runs) == 1:
            raise RuntimeError("API down")
        return None

    reconciler.reconcile = flaky

    async def scenario():
        for _ in range(10):
            reconciler.kick(KEY)
        await asyncio.sleep(0.05)
        assert len(runs) == 1  # ten kicks while the first pass runs: one pass
        await asyncio.sleep(2.2)  # first retry after 2 s
    asyncio.run(scenario())
    assert len(runs) == 2
    assert (metrics._reconciles, metrics._errors) == (2, 1)
    assert metrics._queue_depth == 0
    assert sum(metrics._reconcile_time.counts) == 2 and 0.02 <= metrics._reconcile_time.sum < 0.5


def test_queue_depth_counts_jobs_waiting_for_a_pass_and_each_pass_is_timed():
    reconciler, api, doc, pods, metrics = setup()
    other = ("ns", "other")
    depths = []

    async def slow(key):
        depths.append(metrics._queue_depth)
        await asyncio.sleep(0.02)

    reconciler.reconcile = slow

    async def scenario():
        reconciler.kick(KEY)
        reconciler.kick(other)
        assert metrics._queue_depth == 2  # neither pass has started
        await asyncio.sleep(0.005)
        assert metrics._queue_depth == 0  # both running
        for _ in range(5):
            reconciler.kick(KEY)  # coalesce into one more pass of KEY
        assert metrics._queue_depth == 1
        await asyncio.sleep(0.1)
    asyncio.run(scenario())
    assert metrics._queue_depth == 0 and depths == [1, 0, 0]
    assert sum(metrics._reconcile_time.counts) == 3 and 0.06 <= metrics._reconcile_time.sum < 0.5


def test_a_deleted_job_is_forgotten_with_its_metric_series():
    reconciler, api, doc, _, metrics = setup()
    asyncio.run(reconciler.reconcile(KEY))
    assert KEY in metrics._jobs and reconciler.num_jobs == 1
    api.jobs.clear()
    assert asyncio.run(reconciler.reconcile(KEY)) is None
    assert KEY not in metrics._jobs and reconciler.num_jobs == 0


def test_a_job_deleted_during_a_watch_gap_is_dropped_at_the_next_resync():
    # kopf's index keeps the job (no watch event said DELETED); the LIST at resync does not have it.
    reconciler, api, doc, pods, metrics = setup()
    doc["metadata"]["resourceVersion"] = "40"
    api.list_pods = lambda namespace, selector: []
    api.list_jobs = lambda namespace: ([], "55")
    asyncio.run(reconciler.reconcile(KEY))
    assert KEY in metrics._jobs
    api.calls.clear()

    async def resyncs():
        for _ in range(3):
            await reconciler.resync()
            await asyncio.sleep(0.01)
    asyncio.run(resyncs())
    assert [c for c in api.calls if c[0] in ("create", "ensure", "status")] == []
    assert KEY not in metrics._jobs and reconciler.num_jobs == 0
    assert metrics._reconciles == 0  # never kicked again


def test_a_job_newer_than_the_resync_list_is_not_taken_for_a_ghost():
    reconciler, api, doc, pods, metrics = setup()
    doc["metadata"]["resourceVersion"] = "60"  # created after the LIST answered at 55
    api.list_pods = lambda namespace, selector: []
    api.list_jobs = lambda namespace: ([], "55")

    async def resync():
        await reconciler.resync()
        for _ in range(200):  # the kicked pass runs on the event loop and the API thread pool
            await asyncio.sleep(0.01)
            if ("create", "grpo-tiny-node-1", "1") in api.calls:
                return
    asyncio.run(resync())
    assert KEY in metrics._jobs and ("create", "grpo-tiny-node-1", "1") in api.calls


def _recreate(doc):
    """The job deleted and applied again under its name: a new uid, no status."""
    doc["metadata"]["uid"] = "job-uid-2"
    doc.pop("status", None)


def test_a_recreated_job_deletes_the_earlier_jobs_pods_says_why_then_creates_its_own():
    reconciler, api, doc, pods, _ = setup()
    asyncio.run(reconciler.reconcile(KEY))
    _recreate(doc)
    api.calls.clear()
    asyncio.run(reconciler.reconcile(KEY))
    assert (doc["status"]["phase"], doc["status"]["reason"]) == ("Pending", "StalePodsOfEarlierJob")
    assert "grpo-tiny-node-0, grpo-tiny-node-1 belong to an earlier job of this name (uid job-uid)" in (
        doc["status"]["message"])
    assert [c for c in api.calls if c[0] in ("create", "delete", "event")] == [
        ("event", "StalePodsOfEarlierJob"), ("delete", "grpo-tiny-node-0"), ("delete", "grpo-tiny-node-1")]
    api.calls.clear()
    asyncio.run(reconciler.reconcile(KEY))
    assert [c for c in api.calls if c[0] == "create"] == [
        ("create", "grpo-tiny-node-0", "1"), ("create", "grpo-tiny-node-1", "1")]
    assert {p.owner_uid for p in pods[KEY]} == {"job-uid-2"}


def test_an_earlier_jobs_pod_stuck_terminating_is_force_deleted_after_the_timeout():
    reconciler, api, doc, pods, _ = setup()
    doc["spec"]["runPolicy"]["terminatingTimeoutSeconds"] = 60
    asyncio.run(reconciler.reconcile(KEY))
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    pods[KEY] = [replace(p, deleting=True, deletion_time=t0) for p in pods[KEY]]  # on a NotReady node
    _recreate(doc)
    api.calls.clear()
    reconciler._clock = lambda: t0 + timedelta(seconds=30)
    assert asyncio.run(reconciler.reconcile(KEY)) == pytest.approx(30)
    assert not [c for c in api.calls if c[0] in ("create", "delete", "force-delete")]
    assert doc["status"]["reason"] == "StalePodsOfEarlierJob"
    reconciler._clock = lambda: t0 + timedelta(seconds=61)
    asyncio.run(reconciler.reconcile(KEY))
    assert [c for c in api.calls if c[0] == "force-delete"] == [
        ("force-delete", "grpo-tiny-node-0"), ("force-delete", "grpo-tiny-node-1")]


def test_a_pod_with_the_jobs_name_and_no_owner_is_left_alone_and_named():
    reconciler, api, doc, pods, _ = setup()
    pod = _pod_obj("grpo-tiny-node-0", "u-foreign")
    pods[KEY] = [pod_view(pod)]
    asyncio.run(reconciler.reconcile(KEY))
    assert doc["status"]["reason"] == "PodNamesTaken" and "grpo-tiny-node-0" in doc["status"]["message"]
    assert [c for c in api.calls if c[0] in ("create", "delete")] == [("create", "grpo-tiny-node-1", "1")]


def test_a_name_taken_by_a_foreign_object_is_reported_on_the_job_and_retried():
    reconciler, api, doc, pods, _ = setup()
    api.taken.add("grpo-tiny")  # someone else's Service
    with pytest.raises(ChildConflict):
        asyncio.run(reconciler.reconcile(KEY))
    assert api.calls[-1] == ("event", "ReconcileError")
    assert not [c for c in api.calls if c[0] == "create"]


def test_each_requeue_after_wakes_the_job_again():
    reconciler, api, doc, pods, _ = setup()
    runs = []

    async def timed(key):
        runs.append(asyncio.get_running_loop().time())
        return 0.1 if len(runs) < 4 else None

    reconciler.reconcile = timed

    async def scenario():
        reconciler.kick(KEY)
        await asyncio.sleep(0.6)
    asyncio.run(scenario())
    assert len(runs) == 4
    assert all(b - a >= 0.09 for a, b in itertools.pairwise(runs))


def _pod_obj(name, uid, phase="Running", rv="1"):
    return {"metadata": {"name": name, "uid": uid, "namespace": "ns", "resourceVersion": rv,
                         "labels": {"distflow.io/job-name": "grpo-tiny", "distflow.io/node-rank": "0",
                                    "distflow.io/attempt": "1"}},
            "status": {"phase": phase}}


def test_relist_purges_pods_deleted_while_the_watch_was_down():
    cache = PodCache()
    cache.observe("ADDED", _pod_obj("a", "u-a"))
    cache.observe("ADDED", _pod_obj("b", "u-b"))
    mark = cache.begin_list()
    cache.observe("ADDED", _pod_obj("c", "u-c"))  # created after the LIST started: kept
    changed = cache.replace(mark, [_pod_obj("a", "u-a")], {"ns"})
    assert changed == {KEY} and sorted(p.name for p in cache[KEY]) == ["a", "c"]


def test_relist_never_overwrites_a_newer_watch_event():
    cache = PodCache()
    cache.observe("ADDED", _pod_obj("a", "u-a"))
    mark = cache.begin_list()
    cache.observe("MODIFIED", _pod_obj("a", "u-a", phase="Failed"))
    assert cache.replace(mark, [_pod_obj("a", "u-a", phase="Running")], {"ns"}) == set()
    assert [p.phase for p in cache[KEY]] == ["Failed"]
    assert cache.forget("u-a") == KEY and KEY not in cache


@pytest.mark.parametrize(("code", "message", "grace", "tried_at", "failed_at"), [
    # 2 s after the first refusal, then 4 s: the third try fails the job.
    (422, "spec.volumes[0].persistentVolumeClaim: Invalid", 120, [0, 2, 6], 6),
    # A 403 that is not a quota refusal may clear by itself (Pod Security relaxed, an admission plugin's
    # discovery catching up): tried with backoff until it has lasted podErrorGraceSeconds.
    (403, 'violates PodSecurity "restricted:latest"', 5, [0, 2], 5),
])
def test_refused_pod_creation_is_reported_once_retried_with_backoff_then_fails_the_job(
        code, message, grace, tried_at, failed_at):
    from distflow_operator.kube import KubeApiError

    reconciler, api, doc, _, _ = setup()
    doc["spec"]["runPolicy"]["podErrorGraceSeconds"] = grace
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    clock = [start]
    reconciler._clock = lambda: clock[0]
    tries = []

    def refuse(pod):
        api.calls.append(("create", pod["metadata"]["name"]))
        tries.append((clock[0] - start).total_seconds())
        raise KubeApiError("POST", "/pods", code, {"reason": "Refused", "message": message})
    api.create = refuse
    seen = []

    async def passes_until_failed():
        while doc.get("status", {}).get("phase") != "Failed":
            delay = await reconciler.reconcile(KEY)
            # The status write's own watch event kicks the job at once: that pass must not try again.
            kicked = await reconciler.reconcile(KEY)
            seen.append((doc["status"]["phase"], doc["status"]["reason"]))
            if seen[-1][0] != "Failed":
                clock[0] += timedelta(seconds=min(d for d in (delay, kicked) if d is not None))
            assert clock[0] - start < timedelta(seconds=60)
    asyncio.run(passes_until_failed())
    assert sorted(set(tries)) == tried_at and len(tries) == 2 * len(tried_at)  # two ranks a try
    assert seen[-1] == ("Failed", "PodCreationRejected") and message in doc["status"]["message"]
    assert set(seen[:-1]) == {("Pending", "PodCreationRejected")}
    assert (parse_time(doc["status"]["completionTime"]) - start).total_seconds() == failed_at
    # Every refusal with one message: one event for them, one for the job failing.
    assert [c for c in api.calls if c == ("event", "PodCreationRejected")] == [("event", "PodCreationRejected")] * 2


def test_a_pod_group_kind_the_cluster_does_not_serve_fails_the_job_with_the_fix():
    from distflow_operator.kube import KubeApiError

    reconciler, api, doc, _, _ = setup()
    doc["spec"]["scheduling"] = {"batchScheduler": "volcano"}
    ensure = api.ensure

    def no_volcano(obj, owner):
        if obj["kind"] == "PodGroup":  # no Volcano CRDs: the API server has no such resource
            raise KubeApiError("POST", "/apis/scheduling.volcano.sh/v1beta1/namespaces/ns/podgroups", 404,
                               {"reason": "NotFound", "message": "the server could not find the requested resource"})
        return ensure(obj, owner)
    api.ensure = no_volcano
    clock = [datetime(2026, 1, 1, tzinfo=timezone.utc)]
    reconciler._clock = lambda: clock[0]

    async def passes():
        for _ in range(12):  # the tries are 2 s, then 4 s apart: move the clock as the work queue would
            delay = await reconciler.reconcile(KEY)
            if doc["status"]["phase"] == "Failed":
                return
            clock[0] += timedelta(seconds=delay or 0)
    asyncio.run(passes())
    assert (doc["status"]["phase"], doc["status"]["reason"]) == ("Failed", "PodCreationRejected")
    assert "spec.scheduling.batchScheduler=volcano" in doc["status"]["message"]
    assert "404" in doc["status"]["message"]
    assert not [c for c in api.calls if c[0] == "create"]


def test_an_operator_started_before_it_knew_the_namespace_lists_its_pods_before_deciding():
    # The first resync ran with an empty job index (no namespace listed); the job then arrives
    # with two running pods the pod watch has not delivered yet: no write, no create.
    reconciler, api, doc, _, _ = setup()
    doc["status"] = {"phase": "Running", "attempt": 1, "startTime": "2026-01-01T00:00:00Z"}
    running = []
    for rank in (0, 1):
        pod = _pod_obj(f"grpo-tiny-node-{rank}", f"u-{rank}")
        pod["metadata"]["labels"]["distflow.io/node-rank"] = str(rank)
        pod["metadata"]["ownerReferences"] = [{"uid": "job-uid", "controller": True}]
        pod["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
        running.append(pod)
    listed = []
    api.list_pods = lambda namespace, selector: listed.append(namespace) or running
    reconciler = Reconciler(api, api.jobs, PodCache(), OperatorMetrics(), pod_selector="distflow.io/job-name")

    async def first_passes():
        reconciler._jobs = {}
        await reconciler.relist_pods()  # the job index is still empty: lists no namespace
        reconciler._jobs = api.jobs
        return await reconciler.reconcile(KEY)
    asyncio.run(first_passes())
    assert listed == ["ns"]
    assert not [c for c in api.calls if c[0] == "create"]
    assert [c for c in api.calls if c[0] == "status" and c[1] is not None] == []  # the phase stayed Running
    assert doc["status"]["phase"] == "Running" and doc["status"]["nodes"] == "2/2"


class CachedApi(FakeApi):
    """Pods live in a PodCache fed by watch events, as in the operator."""

    def __init__(self, cache: PodCache):
        super().__init__({})
        self.cache, self.objects = cache, {}

    def create(self, pod):
        self.calls.append(("create", pod["metadata"]["name"], pod["metadata"]["labels"]["distflow.io/attempt"]))
        obj = copy.deepcopy(pod)
        obj["metadata"]["uid"] = f"uid-{len(self.calls)}"
        obj["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
        self.objects[obj["metadata"]["uid"]] = obj
        self.cache.observe("ADDED", obj)
        return True

    def delete_pod(self, namespace, name, uid):
        self.calls.append(("delete", name))
        if (obj := self.objects.pop(uid, None)) is not None:
            self.cache.observe("DELETED", obj)

    def remove(self, rank: int, disrupted: bool = False) -> None:
        """Node ``rank``'s pod vanishes: evicted (DisruptionTarget) or deleted on a lost node."""
        uid = next(u for u, o in self.objects.items() if o["metadata"]["labels"]["distflow.io/node-rank"] == str(rank))
        obj = self.objects.pop(uid)
        if disrupted:
            obj["status"]["conditions"].append({"type": "DisruptionTarget", "status": "True",
                                                "reason": "EvictionByEvictionAPI"})
        self.cache.observe("DELETED", obj)


def cached_setup(uid="job-uid"):
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"].update(namespace="ns", uid=uid, generation=1)
    doc["spec"]["runPolicy"]["backoffSeconds"] = 0
    api = CachedApi(PodCache())
    api.jobs = {KEY: [doc]}
    return Reconciler(api, api.jobs, api.cache, OperatorMetrics()), api, doc


async def _passes(reconciler, n):
    for _ in range(n):
        await reconciler.reconcile(KEY)


def test_after_an_eviction_a_later_loss_of_the_same_rank_counts_a_restart():
    reconciler, api, doc = cached_setup()

    async def scenario():
        await _passes(reconciler, 2)
        api.remove(0, disrupted=True)
        await _passes(reconciler, 3)  # the uncounted restart, then attempt 2 created and running
        assert (doc["status"]["attempt"], doc["status"]["restarts"], doc["status"]["disruptions"]) == (2, 0, 1)
        api.remove(0)  # the same name, another pod: lost, not evicted
        await reconciler.reconcile(KEY)
    asyncio.run(scenario())
    assert (doc["status"]["attempt"], doc["status"]["restarts"], doc["status"]["disruptions"]) == (3, 1, 1)
    assert doc["status"]["reason"] == "NodeLost"


def test_a_new_job_of_the_same_name_does_not_inherit_the_old_ones_evictions():
    reconciler, api, doc = cached_setup()

    async def scenario():
        await _passes(reconciler, 2)
        api.remove(0, disrupted=True)
        await reconciler.reconcile(KEY)
        api.jobs.clear()  # deleted; its pods go with it
        for uid in list(api.objects):
            api.cache.observe("DELETED", api.objects.pop(uid))
        await reconciler.reconcile(KEY)
        doc2 = yaml.safe_load(EXAMPLE.read_text())
        doc2["metadata"].update(namespace="ns", uid="job-uid-2", generation=1)
        api.jobs[KEY] = [doc2]
        await _passes(reconciler, 2)
        api.remove(0)
        await reconciler.reconcile(KEY)
        return doc2
    doc2 = asyncio.run(scenario())
    assert (doc2["status"]["attempt"], doc2["status"]["restarts"], doc2["status"]["disruptions"]) == (2, 1, 0)
