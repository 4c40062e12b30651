"""The job's status, computed purely from the run-policy decision and the observed pods.

Phases::

    Pending ──> Starting ──> Running ──> Succeeded
       ^            │           │
       │            v           v
       └──────── Restarting <───┘ (a node failed; the gang restarts)     Failed: terminal
    Suspended: runPolicy.suspend (any non-terminal phase)

- Pending: some node pods are missing or not scheduled yet.
- Starting: every node pod is scheduled, not all of them run yet.
- Running: every node pod runs (or has already exited 0).
- Restarting: from a gang restart until the new attempt runs on every node.

With ``async.enable`` the status lists both pools (``pools``: trainer, then
rollout, each with its desired and Ready node pods); the phase and restarts
stay the gang's: a failure in either pool restarts every pod (policy.py).

While a resize is asked for (``resizing``; policy.py), the gang still runs at
its attempt's size (``attemptNodes``): phase and Ready count against that
size, ``desiredNodes`` is already the spec's new one. During an in-place
resize the pods that keep running count (not a grow's joiners, nor a
shrink's leaving ranks).

VersionSkew is True when the operator ignores fields it does not know
(a CRD newer than the operator) or cannot read a started job's spec at all.

Conditions follow ``metav1.Condition``: all six types are always present
(``kubectl wait --for=condition=Succeeded`` works from the start); a
condition's ``lastTransitionTime`` moves only when its status flips.
``status`` is written only when it changed, so a steady job costs no writes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from distflow_operator import MANAGER
from distflow_operator.observed import JobView, PodView, format_time
from distflow_operator.policy import Decision, NodeFailure, Resize
from distflow_operator.render import LABEL_JOB, LABEL_MANAGED_BY, node_pools

PHASES = ("Pending", "Starting", "Running", "Restarting", "Succeeded", "Failed", "Suspended")
CONDITION_TYPES = ("Ready", "Restarting", "Suspended", "Succeeded", "Failed", "VersionSkew")


class _Status(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, validate_by_name=True, validate_by_alias=True,
                              serialize_by_alias=True, use_attribute_docstrings=True, extra="forbid")


class Condition(_Status):
    type: str
    """Ready, Restarting, Suspended, Succeeded, Failed or VersionSkew."""
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(min_length=1)
    """CamelCase reason of the last change."""
    message: str = ""
    last_transition_time: str
    """When status last flipped (RFC 3339)."""
    observed_generation: int
    """metadata.generation this condition was computed from."""


class Progress(_Status):
    step: int | None = None
    """Last finished training step, from node 0's metrics."""
    total_steps: int | None = None
    """spec.trainer.totalSteps."""
    tokens_per_second: float | None = None
    """Tokens (prompt+response) per second per accelerator, verl's definition, as node 0 reports it."""
    step_seconds: float | None = None
    """Wall time of the last step, seconds, as node 0 reports it."""
    last_checkpoint_step: int | None = None
    """Step of the newest complete checkpoint."""


class PodErrorStatus(_Status):
    pod: str
    uid: str
    reason: str
    """ErrImagePull, ImagePullBackOff or CreateContainerConfigError."""
    since: str
    """When the operator first saw the pod waiting on it (RFC 3339); runPolicy.podErrorGraceSeconds runs from here."""


class LastFailure(_Status):
    attempt: int
    """The attempt this failure ended."""
    rank: int | None = None
    pod: str
    reason: str
    """The container's or pod's reason (OOMKilled, Error, Evicted, ...), or NodeLost/NodeDisrupted."""
    exit_code: int | None = None
    message: str = ""
    """The node's termination message (its last words), or the operator's explanation."""
    time: str
    """When the operator decided on it (RFC 3339)."""


class ResizeStatus(_Status):
    from_: int = Field(alias="from")
    """Nodes before the resize."""
    to: int
    """Nodes after it (spec.cluster.numNodes)."""
    requested_at: str
    """When the operator saw the new size and asked the workers to stop (RFC 3339)."""
    stopped_at: str | None = None
    """When the first worker stopped at a step boundary for it, checkpoint saved (RFC 3339)."""
    resumed_at: str | None = None
    """When every node pod of the new attempt was running (RFC 3339)."""
    attempt: int | None = None
    """The attempt that runs at the new size, once started."""
    cost_seconds: float | None = None
    """Seconds from stoppedAt to resumedAt: the gang's downtime as the operator sees it (model
    loading and the first step after come on top). In place: from requestedAt to resumedAt."""
    in_place: bool | None = None
    """True: resized in the running attempt, nothing stopped: the rollout pool alone (async.enable),
    the trainer pods kept training; or a synchronous job's whole gang, its surviving pods kept running
    (new ranks joined, leaving ranks exited 4)."""


class PoolStatus(_Status):
    name: Literal["trainer", "rollout"]
    """The pool (async.enable): trainer (ranks 0 .. N-R-1) or rollout (the last async.rolloutPool.numNodes)."""
    nodes: int
    """Node pods the pool has (desired)."""
    ready: int
    """Node pods of the pool, of the current attempt, that are Ready."""


class JobStatus(_Status):
    """Status of an RLPostTrainJob, written by the operator only."""

    phase: Literal["Pending", "Starting", "Running", "Restarting", "Succeeded", "Failed", "Suspended"]
    """Pending, Starting, Running, Restarting, Succeeded, Failed or Suspended."""
    reason: str | None = None
    """Why the job is in its phase (CamelCase), e.g. MaxRestartsExceeded."""
    message: str | None = None
    """Human-readable detail of reason."""
    observed_generation: int | None = None
    """metadata.generation the status was computed from."""
    attempt: int = 1
    """Gang attempt: every node pod carries label distflow.io/attempt with it."""
    restarts: int = 0
    """Gang restarts after failures."""
    disruptions: int = 0
    """Gang restarts after disruptions (preemption, eviction) or Ignore exit codes; not in restarts."""
    desired_nodes: int = 0
    """spec.cluster.numNodes."""
    ready_nodes: int = 0
    """Node pods of the current attempt that are Ready."""
    nodes: str = "0/0"
    """ready/desired, for kubectl get."""
    replicas: int = 0
    """Node pods of the current attempt (running or exited 0): the scale subresource's status replicas."""
    selector: str | None = None
    """Label selector of the job's node pods (scale subresource; an HPA reads their metrics with it)."""
    start_time: str | None = None
    """When the current run's pods were first created."""
    completion_time: str | None = None
    """When the job finished."""
    last_restart_time: str | None = None
    """When the last gang restart was decided."""
    pools: list[PoolStatus] | None = None
    """The trainer and the rollout pool with their node counts (async.enable only)."""
    progress: Progress | None = None
    """Training progress scraped from node 0."""
    pod_errors: list[PodErrorStatus] | None = None
    """Node pods of the current attempt waiting on a pull or config error, since when."""
    succeeded_ranks: list[int] | None = None
    """Ranks of the current attempt that exited 0 (kept when their pods are garbage-collected)."""
    last_failure: LastFailure | None = None
    """What ended the last failed attempt: kept after the restart deletes the pod and its logs."""
    attempt_nodes: int | None = None
    """Nodes the current attempt's pods were created for (differs from desiredNodes during a resize)."""
    attempt_rollout_nodes: int | None = None
    """Rollout pool nodes of the current attempt (async.enable); an in-place resize changes it."""
    resizing: ResizeStatus | None = None
    """The resize in flight (kubectl scale): requested, not yet running at its new size."""
    last_resize: ResizeStatus | None = None
    """The last resize done, with what it cost."""
    conditions: list[Condition] = Field(default_factory=list)
    """metav1.Condition-style conditions, one per type."""


def _phase(job: JobView, decision: Decision, desired: int, running: int, scheduled: int) -> str:
    if decision.terminal:
        return decision.terminal.phase
    if decision.suspended:
        return "Suspended"
    if decision.restart or (job.status.get("phase") == "Restarting" and running < desired):
        return "Restarting"
    if desired and running == desired:
        return "Running"
    if desired and scheduled == desired:
        return "Starting"
    return "Pending"


def _explain(job: JobView, decision: Decision, phase: str, counts: tuple[int, int, int]) -> tuple[str, str]:
    """(reason, message) of the phase."""
    desired, running, scheduled = counts
    outcome = decision.terminal or decision.restart
    if outcome:
        return outcome.reason, outcome.message
    if decision.waiting and phase in ("Pending", "Starting", "Restarting"):
        return decision.waiting
    if phase == "Restarting":
        return job.status.get("reason") or "NodeFailed", job.status.get("message") or ""
    return {
        "Suspended": ("Suspended", "runPolicy.suspend is true; node pods deleted"),
        "Running": ("AllNodesRunning", f"{desired}/{desired} nodes running"),
        "Starting": ("NodesStarting", f"{running}/{desired} nodes running"),
        "Pending": ("NodesPending", f"{scheduled}/{desired} nodes scheduled"),
    }[phase]


def _condition(prev: Mapping[str, Mapping[str, Any]], ctype: str, true: bool, reason: str,
               message: str, generation: int, now: str) -> dict[str, Any]:
    status = "True" if true else "False"
    old = prev.get(ctype) or {}
    since = old.get("lastTransitionTime") if old.get("status") == status else None
    return Condition(type=ctype, status=status, reason=reason, message=message,
                     last_transition_time=since or now, observed_generation=generation
                     ).model_dump(exclude_none=True)


def _version_skew(job: JobView, decision: Decision) -> tuple[bool, str, str]:
    if decision.held:
        return True, decision.held.reason, decision.held.message
    if job.unknown_fields:
        return True, "UnknownFields", (
            f"ignoring fields this operator does not know: {', '.join(job.unknown_fields)}; "
            "upgrade the operator to the CRD's version")
    return False, "SpecRead", ""


def _conditions(job: JobView, phase: str, reason: str, message: str, ready: int, desired: int,
                now: datetime, skew: tuple[bool, str, str]) -> list[dict[str, Any]]:
    prev = {c.get("type"): c for c in job.status.get("conditions") or []}
    stamp = format_time(now)
    all_ready = phase == "Running" and ready == desired
    truth = {"Ready": all_ready, "Restarting": phase == "Restarting", "Suspended": phase == "Suspended",
             "Succeeded": phase == "Succeeded", "Failed": phase == "Failed"}
    out = []
    for ctype in CONDITION_TYPES:
        if ctype == "VersionSkew":
            out.append(_condition(prev, ctype, *skew, job.generation, stamp))
            continue
        if ctype == "Ready":
            why = ("AllNodesReady" if all_ready else "NodesNotReady", f"{ready}/{desired} nodes ready")
        else:
            why = (reason, message) if truth[ctype] else (phase, "")
        out.append(_condition(prev, ctype, truth[ctype], why[0], why[1], job.generation, stamp))
    return out


def _progress(job: JobView, scraped: Mapping[str, Any] | None, phase: str) -> dict[str, Any] | None:
    merged = dict(job.status.get("progress") or {})
    merged.update({k: v for k, v in (scraped or {}).items() if v is not None})
    if job.spec is not None:
        merged["totalSteps"] = job.spec.trainer.total_steps
        if phase == "Succeeded":
            # Nodes exit 0 only after the last step; node 0 may exit before a scrape sees it.
            merged["step"] = job.spec.trainer.total_steps
    return Progress.model_validate(merged).model_dump(exclude_none=True) if merged else None


def _last_failure(failure: NodeFailure | None) -> LastFailure | None:
    if failure is None:
        return None
    return LastFailure(attempt=failure.attempt, rank=failure.rank, pod=failure.pod, reason=failure.reason,
                       exit_code=failure.exit_code, message=failure.message, time=format_time(failure.time))


def _resize(resize: Resize | None) -> ResizeStatus | None:
    if resize is None:
        return None
    return ResizeStatus(from_=resize.from_nodes, to=resize.to_nodes, requested_at=format_time(resize.requested_at),
                        stopped_at=format_time(resize.stopped_at) if resize.stopped_at else None,
                        resumed_at=format_time(resize.resumed_at) if resize.resumed_at else None,
                        attempt=resize.attempt, cost_seconds=resize.cost_seconds,
                        in_place=True if resize.in_place else None)


def _pools(job: JobView, current: Sequence[PodView]) -> list[PoolStatus] | None:
    """Desired and Ready node pods per pool of an asynchronous job; None for a synchronous one."""
    if job.spec is None or not job.spec.async_.enable:
        return None
    ready = {p.rank for p in current if p.ready}
    return [PoolStatus(name=pool.name, nodes=pool.num_nodes, ready=len(ready.intersection(pool.ranks)))
            for pool in node_pools(job.spec)]


def node_selector(job_name: str) -> str:
    """The label selector (string form) of job ``job_name``'s node pods."""
    return f"{LABEL_MANAGED_BY}={MANAGER},{LABEL_JOB}={job_name}"


def compute_status(job: JobView, pods: Sequence[PodView], decision: Decision, now: datetime,
                   scraped: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The job's new status (camelCase mapping, as written to the API).

    Args:
        pods: the job's observed node pods.
        scraped: progress fields read from node 0 (step, tokensPerSecond, lastCheckpointStep)
            or None; earlier progress is kept when None.
    """
    state = decision.state
    if decision.held:
        held = {"phase": "Pending", **job.status}
        held["conditions"] = [c for c in job.status.get("conditions") or [] if c.get("type") != "VersionSkew"]
        held["conditions"].append(_condition(
            {c.get("type"): c for c in job.status.get("conditions") or []}, "VersionSkew",
            *_version_skew(job, decision), job.generation, format_time(now)))
        return held
    desired = job.spec.cluster.num_nodes if job.spec else 0
    current = [p for p in pods if p.attempt == state.attempt and not p.deleting]
    # While a resize is asked for, the gang runs at its attempt's size, not yet at the spec's.
    size = state.attempt_nodes if state.attempt_nodes is not None else desired
    in_place = state.resizing is not None and state.resizing.in_place and state.resizing.attempt == state.attempt
    if state.attempt_nodes is not None and not in_place:
        # Pods past the attempt's size (a withdrawn in-place grow's joiners, being deleted) are not the gang's.
        current = [p for p in current if p.rank is None or p.rank < size]
    # A rank that exited 0 counts as running even once the pod garbage collector has removed its pod.
    collected = len(state.succeeded_ranks - {p.rank for p in current})
    running = sum(p.phase in ("Running", "Succeeded") for p in current) + collected
    scheduled = sum(p.scheduled or p.phase != "Pending" for p in current) + collected
    ready = sum(p.ready for p in current)
    if in_place:
        # The pods that keep running: a shrink's leaving pods and a grow's joiners are not counted yet.
        size = min(state.resizing.from_nodes, state.resizing.to_nodes)
        running = min(running, size)
    phase = _phase(job, decision, size, running, scheduled)
    reason, message = _explain(job, decision, phase, (size, running, scheduled))
    status = JobStatus(
        phase=phase, reason=reason, message=message, observed_generation=job.generation,
        attempt=state.attempt, restarts=state.restarts, disruptions=state.disruptions,
        desired_nodes=desired, ready_nodes=ready,
        nodes=f"{ready}/{desired}", replicas=running, selector=node_selector(job.name),
        start_time=format_time(state.start_time) if state.start_time else None,
        completion_time=format_time(state.completion_time) if state.completion_time else None,
        last_restart_time=format_time(state.last_restart_time) if state.last_restart_time else None,
        pools=_pools(job, current),
        progress=_progress(job, scraped, phase),
        pod_errors=[PodErrorStatus(pod=e.pod, uid=e.uid, reason=e.reason, since=format_time(e.since))
                    for e in state.pod_errors] or None,
        succeeded_ranks=sorted(state.succeeded_ranks) or None,
        last_failure=_last_failure(state.last_failure),
        attempt_nodes=state.attempt_nodes, attempt_rollout_nodes=state.attempt_rollout_nodes,
        resizing=_resize(state.resizing), last_resize=_resize(state.last_resize),
        conditions=_conditions(job, phase, reason, message, ready, size, now,
                               _version_skew(job, decision)),
    )
    return status.model_dump(exclude_none=True)


def status_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """JSON merge patch (RFC 7386) turning status ``old`` into ``new``: removed keys become null at
    any depth, since a merge patch merges objects (a stop's ``lastResize`` replacing an in-place one
    would otherwise keep its ``inPlace``)."""
    patch: dict[str, Any] = {k: None for k in old if k not in new}
    for key, value in new.items():
        before = old.get(key)
        if before == value:
            continue
        both_objects = isinstance(before, Mapping) and isinstance(value, Mapping)
        patch[key] = status_patch(before, value) if both_objects else value
    return patch


def transition_events(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(type, reason, message) events worth recording for a status change: restarts and
    phase changes users act on (Pending/Starting churn is left to the status)."""
    events = []
    skew = {c["type"]: c for c in new.get("conditions") or []}.get("VersionSkew")
    was = {c["type"]: c for c in old.get("conditions") or []}.get("VersionSkew") or {}
    if skew and skew["status"] == "True" and (was.get("status"), was.get("reason")) != ("True", skew["reason"]):
        events.append(("Warning", skew["reason"], skew["message"]))
    events += _resize_events(old, new)
    reason, message = new.get("reason") or new["phase"], new.get("message") or ""
    if (new.get("restarts") or 0) > (old.get("restarts") or 0):
        events.append(("Warning", reason, message))
    phase, before = new["phase"], old.get("phase")
    if phase == before:
        return events
    if before == "Suspended":
        events.append(("Normal", "Resumed", "runPolicy.suspend is false; recreating node pods"))
    if phase == "Failed":
        events.append(("Warning", reason, message))
    elif phase in ("Running", "Succeeded", "Suspended"):
        events.append(("Normal", reason, message))
    return events


def _resize_events(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """ResizeRequested when a new size is asked for, Resized (with its cost) when it runs."""
    events = []
    asked, before = new.get("resizing") or {}, old.get("resizing") or {}
    if asked and (asked.get("to"), asked.get("requestedAt")) != (before.get("to"), before.get("requestedAt")):
        then = (_in_place_then(new, asked) if asked.get("inPlace") else
                "the gang had not started: its pods are replaced at the new size" if asked.get("stoppedAt") else
                "the workers stop at their next step boundary (checkpoint saved) and the gang restarts at the new size")
        events.append(("Normal", "ResizeRequested", f"cluster.numNodes {asked['from']} -> {asked['to']}: {then}"))
    done = new.get("lastResize")
    if done and done != old.get("lastResize") and done.get("inPlace"):
        what = "rollout pool" if new.get("pools") else "gang"
        events.append(("Normal", "Resized", (
            f"{what} resized in place from {done['from']} to {done['to']} nodes (attempt "
            f"{done.get('attempt')}, no restart): {done.get('costSeconds', 0):g}s from the request")))
    elif done and done != old.get("lastResize"):
        events.append(("Normal", "Resized", (
            f"resized from {done['from']} to {done['to']} nodes (attempt {done.get('attempt')}): "
            f"{done.get('costSeconds', 0):g}s from the stop to every node running")))
    return events


def _in_place_then(new: Mapping[str, Any], asked: Mapping[str, Any]) -> str:
    """What an in-place resize asked for does: of the rollout pool (async.enable: the status lists
    pools) or of a synchronous job's whole gang."""
    if new.get("pools"):
        return "the rollout pool resizes in place at the next step boundary; the trainer pods keep training"
    low, high = sorted((asked["from"], asked["to"]))
    ranks, ending = (f"rank {low}", "s") if high - low == 1 else (f"ranks {low}..{high - 1}", "")
    if asked["to"] > asked["from"]:
        return f"the gang resizes in place: the running pods keep training, new {ranks} join{ending} at a step boundary"
    return (f"the gang resizes in place: {ranks} leave{ending} at the next step boundary (exit 4), "
            "the others keep training")
