"""Run policy: from an observed job and its pods, decide what to do next. Pure.

The gang is the unit: a job runs as attempt ``a`` (1-based), all node pods
labelled ``distflow.io/attempt=a``. Decisions, in order:

1. A finished job (Succeeded/Failed) never gets children again; its still
   running pods are deleted (finished pods stay for their logs) and
   ``ttlSecondsAfterFinished`` deletes the job itself.
2. An invalid spec fails a job that has not started (reason InvalidSpec)
   without children. A started job whose spec this operator cannot read
   (operator/CRD version skew) is held as it is: no pod created or deleted,
   the problem goes to the VersionSkew condition and an event. Fields
   the operator does not know are ignored (``JobView.unknown_fields``).
3. ``suspend``: every pod deleted, the job kept. Resuming starts a new attempt
   (so pods still terminating from before are never mistaken for failures) but
   counts no restart; the deadline clock restarts, as for a Kubernetes Job.
4. ``activeDeadlineSeconds`` since the pods were first created: Failed.
5. A node whose exit code matches a ``FailJob`` rule of
   ``runPolicy.exitCodeRules`` (default: exit code 2, invalid config) fails
   the job at once; so does an invalid image name, and an image pull or
   container config error that outlasts ``podErrorGraceSeconds`` (a Secret
   may appear seconds later). Any other failure or loss of a node pod
   restarts the whole gang as attempt a+1 after a backoff of
   ``backoffSeconds * 2**(n-1)`` for the job's n-th gang restart (capped at an
   hour), until ``maxRestarts``. Disruptions (preemption, eviction: the
   DisruptionTarget condition, or Kueue's TerminationTarget) and ``Ignore``
   exit codes restart the gang without using up ``maxRestarts``, as a Job's
   podFailurePolicy does, but they back off like any restart: a node that is
   lost again and again cannot turn the gang over in a tight loop. The pull
   error's grace runs from when the operator first saw it (``podErrors`` in
   the status), not from the pod's creation: a pod gated by Kueue or waiting
   for an autoscaled node gets the whole grace when its pull starts failing.
   What ended the attempt stays in ``status.lastFailure`` after the restart
   deletes the pod. The runtime resumes from its last checkpoint.
6. All nodes exited 0: Succeeded. A rank that exited 0 stays done
   (``succeededRanks``) when the pod garbage collector removes its pod.
7. A resize: ``cluster.numNodes`` (``kubectl scale``) differs from the size
   the current attempt's pods were created for (``attemptNodes`` in the
   status). A gang that is not running yet (a pod Pending or missing) is
   replaced at the new size directly (attempt a+1, counting no restart).
   In place (a synchronous job, ``async.enable`` false): while every node pod
   of the attempt runs, the operator writes ``{"numNodes": N, "inPlace": true}``
   into the ConfigMap key ``resize`` with the ConfigMap's spec at the new size,
   in one update, and the gang resizes in the running attempt: a grow creates
   the pods of ranks size..N-1 with ``DISTFLOW_JOIN=1`` and ``PET_NNODES=N``
   and is done when all N run; in a shrink the ranks >= N exit with code 4
   (``EXIT_LEFT_POOL``) at a step boundary, their pods are deleted, and it is
   done when they are gone. The surviving pods keep running, nothing is
   counted; the request stays in the ConfigMap at the attempt's size until the
   next attempt (a rank that reads it late re-forms with the others). A size
   set back before it is done withdraws it (joiners deleted, the request at
   the attempt's size; a shrink whose ranks began to leave is done first); a
   third size waits until the one in flight is done (a grow whose joiners are
   not all created is withdrawn instead: they would be created for that size).
   Exit code 3 (``EXIT_RESIZE``) during or after it, in the attempt, is a
   worker image that stops instead: the stop path below.
   Stop and restart (an asynchronous job whose trainer nodes change, a job
   whose rollout engine is a colocated vLLM, or a status without
   ``attemptNodes`` from an older operator): while every node
   pod of the attempt runs, the operator writes ``{"numNodes": N}`` into the
   key ``resize`` (``decision.resize_request``) and waits: the workers save a
   checkpoint at their next step boundary and exit with code 3. The first such
   exit, while a request is pending, ends the attempt: the other pods are
   deleted (the checkpoint is complete before any worker exits), and attempt
   a+1 starts at the spec's size at once, counting no restart and no
   disruption, with no backoff; the runtime resumes the checkpoint at the new
   world size. Failures before the stop take the ordinary path of 5 (the
   restart is at the new size; the request is dropped). A size set back
   before the stop withdraws the request. Exit code 3 without a pending
   request (a request withdrawn too late) restarts the gang like an
   ``Ignore`` exit code (not counted, with backoff, so it cannot loop) unless
   an ``exitCodeRules`` entry names code 3.
   ``status.resizing`` holds the resize in flight; ``status.lastResize`` the
   last one done, with when it was requested, when the first worker stopped,
   when the new attempt's pods all ran, and that downtime in seconds (in
   place: ``inPlace``, no stop, seconds from the request until done). A size
   the operator cannot read (the spec's own checks refuse it; the API
   server's CEL rules normally do first) is held as in 2, with reason
   ResizeRefused: the job keeps running at its size (a request made before
   is withdrawn: the operator could not start workers that stopped for it).
   The rollout pool in place (async.enable): a spec that changes
   ``async.rolloutPool.numNodes`` and ``cluster.numNodes`` by the same amount
   (the trainer nodes as the attempt's, ``attemptRolloutNodes`` in the status)
   while every node pod of the attempt runs resizes the rollout pool in the
   running attempt (``distflow.pools.elastic``) as above, the request naming
   the rollout nodes (``{"numNodes": N, "rolloutNodes": R}``); it is not
   withdrawn, and exit code 3 is no stop for it.
   Exit code 4 of a rank no in-place shrink removes is a failure; any failure,
   during or after an in-place resize, is a gang restart at the spec's size
   (the in-place resize in flight ends).
8. Otherwise pods of older attempts are deleted first, then, once they are gone
   and the backoff has passed, missing ranks are created. A pod still
   Terminating ``terminatingTimeoutSeconds`` after its grace period (its node
   is gone and no kubelet confirms) is force-deleted; meanwhile the status
   says which pods the restart waits for. When the API server refuses the
   pods, the status says why at once and the next try waits 2 s, doubling up
   to a minute; a refusal as invalid (400, 422) fails the job on the third
   try, a 403 (Pod Security, RBAC) once it has lasted
   ``podErrorGraceSeconds``. A quota refusal fails nothing: the job waits,
   as an unschedulable pod would, bounded only by ``activeDeadlineSeconds``
   (see :class:`Rejection`).

Deliberately simplified: a missing pod that the operator never saw (e.g. lost
while the operator itself was down) is recreated within the same attempt
rather than restarting the gang; the other ranks then time out in their
collectives and the resulting failures restart the gang.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from distflow.resize import EXIT_LEFT_POOL, EXIT_RESIZE

from distflow_operator.observed import JobView, PodView, parse_time
from distflow_operator.render import pod_name

TERMINAL_PHASES = ("Succeeded", "Failed")
FAIL_FAST_WAITING_REASONS = {"InvalidImageName": "ImagePullFailed"}
"""Container waiting reasons that will repeat on every attempt -> job Failed reason."""
GRACE_WAITING_REASONS = {
    "ErrImagePull": "ImagePullFailed",
    "ImagePullBackOff": "ImagePullFailed",
    "CreateContainerConfigError": "InvalidPodConfig",
}
"""Waiting reasons that may clear (registry hiccup, a Secret created later): fatal after a grace period."""
MAX_CHILD_REJECTIONS = 3
"""Passes in a row whose pod creation the API server refused as invalid (400, 422) before the job fails."""
FORBIDDEN = 403
QUOTA_REFUSAL = "exceeded quota"
"""What the ResourceQuota admission plugin's 403 says: room that frees when other workloads end."""
REFUSED_RETRY_SECONDS = 2.0
"""Wait before the second try of a refused pod creation; doubles with each refusal."""
MAX_REFUSED_RETRY_SECONDS = 60.0
MAX_BACKOFF_SECONDS = 3600.0


@dataclass(frozen=True)
class PodError:
    """A node pod waiting on an error that may clear (GRACE_WAITING_REASONS) and since when it is seen."""

    pod: str
    uid: str
    reason: str
    since: datetime
    """When the operator first saw this pod waiting on an error: the grace runs from here."""


@dataclass(frozen=True)
class NodeFailure:
    """What ended an attempt, kept in ``status.lastFailure`` once the restart has deleted the pod."""

    attempt: int
    pod: str
    reason: str
    """The container's or the pod's reason (OOMKilled, Error, Evicted, ImagePullBackOff), else NodeLost."""
    message: str
    """The node's termination message (why the runtime exited), else the operator's explanation."""
    time: datetime
    rank: int | None = None
    exit_code: int | None = None


@dataclass(frozen=True)
class Resize:
    """One resize of the gang, from the request to the new attempt running (times in UTC)."""

    from_nodes: int
    to_nodes: int
    requested_at: datetime
    """When the operator saw the new size (and asked the workers to stop, if they ran)."""
    stopped_at: datetime | None = None
    """When the first worker exited for it (or the gang that had not started was replaced)."""
    resumed_at: datetime | None = None
    """When every node pod of the new attempt was running."""
    attempt: int | None = None
    """The attempt that runs at ``to_nodes``, once started."""
    cost_seconds: float | None = None
    """Seconds from the stop to the new attempt's pods all running, in milliseconds' precision
    (model loading and the first step after come on top); None until resumed. Recorded once, when
    resumed, and kept: recomputed from the status' whole-second times it would change. In place:
    seconds from the request to the new rollout pods all running (grow) or the leaving pods gone."""
    in_place: bool = False
    """Resized in the running attempt, nothing stopped (``stopped_at`` stays None): the rollout pool
    alone (async.enable; ``distflow.pools.elastic``), the trainer pods kept running; or, for a
    synchronous job, the whole gang, its surviving pods kept running."""


@dataclass(frozen=True)
class RunState:
    """The run-policy state the operator keeps in the job's status."""

    attempt: int = 1
    restarts: int = 0
    """Gang restarts caused by failures (resuming from suspend is not one)."""
    disruptions: int = 0
    """Gang restarts caused by disruptions or Ignore exit codes: not counted in restarts."""
    start_time: datetime | None = None
    last_restart_time: datetime | None = None
    completion_time: datetime | None = None
    pod_errors: tuple[PodError, ...] = ()
    """Pods of the current attempt waiting on a pull or config error, with when it was first seen."""
    succeeded_ranks: frozenset[int] = frozenset()
    """Ranks of the current attempt that exited 0 (their pods may be garbage-collected since)."""
    last_failure: NodeFailure | None = None
    attempt_nodes: int | None = None
    """Nodes the current attempt's pods were created for; None: not recorded (an older operator's
    status: then the pods' PET_NNODES, else spec.cluster.numNodes, and a resize is never in place).
    An in-place resize changes it."""
    attempt_rollout_nodes: int | None = None
    """Rollout pool nodes of the current attempt (async.enable); None: no pools, or not recorded
    (an older operator's status: then a resize is never in place)."""
    resizing: Resize | None = None
    """The resize in flight: requested, not yet running at its new size."""
    last_resize: Resize | None = None
    """The last resize done."""


@dataclass(frozen=True)
class Rejection:
    """The API server refused to create the node pods on every try since ``since``.

    Why three clocks: 400 and 422 say the pod itself is invalid, which only a
    spec edit fixes, so a few tries suffice. 403 is a verdict on the cluster's
    state (the namespace's Pod Security level, RBAC, or an admission plugin
    whose discovery lags a CRD installed moments ago), which can change
    without any edit: it fails the job only after ``podErrorGraceSeconds``.
    A ResourceQuota's 403 is room that other workloads hold, often for hours
    (a long job's gang restart while the namespace is full): the job waits for
    it as a pod waits for a node, bounded by ``activeDeadlineSeconds`` only.
    """

    tries: int
    status: int
    """HTTP status of the last refusal."""
    message: str
    since: datetime
    """When the first refusal of this run happened."""
    last: datetime
    """When the last refusal happened: the next try waits :func:`refused_retry_delay` from here."""


@dataclass(frozen=True)
class Outcome:
    """A phase with the reason (CamelCase) and message that explain it."""

    phase: str
    reason: str
    message: str


@dataclass(frozen=True)
class Decision:
    state: RunState
    terminal: Outcome | None = None
    """Set when the job is finished (now or before)."""
    restart: Outcome | None = None
    """Set when this decision starts a gang restart."""
    suspended: bool = False
    held: Outcome | None = None
    """Set when the spec cannot be read but the job has started: touch nothing."""
    create_ranks: tuple[int, ...] = ()
    delete_pods: tuple[PodView, ...] = ()
    force_delete_pods: tuple[PodView, ...] = ()
    """Pods stuck Terminating past runPolicy.terminatingTimeoutSeconds: delete with grace period 0."""
    waiting: tuple[str, str] | None = None
    """(reason, message): what the job waits for (pods still terminating, a rejected pod creation)."""
    delete_job: bool = False
    """ttlSecondsAfterFinished has passed."""
    requeue_after: float | None = None
    """Seconds until a time-based decision is due (backoff, deadline, TTL)."""
    resize_request: int | None = None
    """The node count the ConfigMap key ``resize`` must hold; None: no key (no request)."""
    resize_rollout_nodes: int | None = None
    """With ``resize_request``: the rollout pool's size the request names (an in-place resize of the
    rollout pool; the ConfigMap's spec is rewritten at the new size with it); None: the whole gang's."""
    resize_in_place: bool = False
    """With ``resize_request``: the whole gang resizes in place (a synchronous job; ``"inPlace": true``
    in the request, the ConfigMap's spec rewritten at the new size with it); False: the workers stop."""
    joining: bool = False
    """The pods of ``create_ranks`` join the running attempt (``DISTFLOW_JOIN=1``): an in-place grow."""


def run_state(status: Mapping[str, Any], pods: Sequence[PodView]) -> RunState:
    """The run state from the last written status; pods of a newer attempt win
    (their status write may have been lost)."""
    attempt = max([status.get("attempt") or 1] + [p.attempt for p in pods if p.attempt])
    same_attempt = (status.get("attempt") or 1) == attempt
    failure = status.get("lastFailure")
    return RunState(
        attempt_nodes=status.get("attemptNodes") if same_attempt else None,
        attempt_rollout_nodes=status.get("attemptRolloutNodes") if same_attempt else None,
        resizing=_parse_resize(status.get("resizing")),
        last_resize=_parse_resize(status.get("lastResize")),
        attempt=attempt,
        restarts=status.get("restarts") or 0,
        disruptions=status.get("disruptions") or 0,
        start_time=parse_time(status.get("startTime")),
        last_restart_time=parse_time(status.get("lastRestartTime")),
        completion_time=parse_time(status.get("completionTime")),
        pod_errors=tuple(PodError(e["pod"], e["uid"], e["reason"], parse_time(e["since"]))
                         for e in status.get("podErrors") or [] if same_attempt),
        succeeded_ranks=frozenset(status.get("succeededRanks") or ()) if same_attempt else frozenset(),
        last_failure=NodeFailure(
            failure["attempt"], failure["pod"], failure["reason"], failure.get("message", ""),
            parse_time(failure["time"]), failure.get("rank"), failure.get("exitCode")) if failure else None,
    )


def _parse_resize(raw: Mapping[str, Any] | None) -> Resize | None:
    if not raw:
        return None
    return Resize(raw["from"], raw["to"], parse_time(raw["requestedAt"]), parse_time(raw.get("stoppedAt")),
                  parse_time(raw.get("resumedAt")), raw.get("attempt"), raw.get("costSeconds"),
                  bool(raw.get("inPlace")))


def restart_backoff(backoff_seconds: float, restarts: int) -> float:
    """Delay before the job's gang restart number ``restarts`` (1-based, counted or not), in seconds."""
    if restarts < 1:
        return 0.0
    return min(backoff_seconds * 2.0 ** (restarts - 1), MAX_BACKOFF_SECONDS)


def refused_retry_delay(tries: int) -> float:
    """Seconds between refused pod creation number ``tries`` (1-based) and the next try."""
    return min(REFUSED_RETRY_SECONDS * 2.0 ** (tries - 1), MAX_REFUSED_RETRY_SECONDS)


def _new_attempt(state: RunState, **changes: Any) -> RunState:
    """The next attempt: what was observed of the pods of this one no longer applies. A resize in
    flight ends with it, unless ``changes`` carries it on (the new attempt starts at the spec's size)."""
    changes.setdefault("resizing", None)
    return replace(state, attempt=state.attempt + 1, pod_errors=(), succeeded_ranks=frozenset(),
                   attempt_nodes=None, attempt_rollout_nodes=None, **changes)


def _observe(state: RunState, current: Sequence[PodView], now: datetime) -> RunState:
    """Record pull and config errors first seen now, and ranks that exited 0."""
    seen = {e.uid: e for e in state.pod_errors}
    errors = tuple(PodError(p.name, p.uid, p.waiting_reason, seen[p.uid].since if p.uid in seen else now)
                   for p in current if p.waiting_reason in GRACE_WAITING_REASONS)
    done = {p.rank for p in current if p.phase == "Succeeded" and p.rank is not None}
    return replace(state, pod_errors=errors, succeeded_ranks=state.succeeded_ranks | done)


def _min(*values: float | None) -> float | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def _finish(job: JobView, pods: Sequence[PodView], state: RunState, now: datetime,
            outcome: Outcome) -> Decision:
    state = replace(state, completion_time=state.completion_time or now)
    active = tuple(p for p in pods if not p.deleting and p.phase in ("Pending", "Running", "Unknown"))
    ttl = job.spec.run_policy.ttl_seconds_after_finished if job.spec else None
    if ttl is None:
        return Decision(state, terminal=outcome, delete_pods=active)
    remaining = (state.completion_time - now).total_seconds() + ttl
    return Decision(state, terminal=outcome, delete_pods=active, delete_job=remaining <= 0,
                    requeue_after=remaining if remaining > 0 else None)


Failure = tuple[str, Outcome]
"""(action, why): action FailJob, Count (a restart) or Ignore (a restart maxRestarts does not count)."""


def _pod_failure(pod: PodView, job: JobView, state: RunState, now: datetime) -> Failure | None:
    """What this current-attempt pod's state means, or None when it is fine (or within a grace period)."""
    detail = f"node pod {pod.name}: {pod.waiting_reason}; {pod.message}".rstrip("; ")
    if pod.waiting_reason in FAIL_FAST_WAITING_REASONS:
        return "FailJob", Outcome("Failed", FAIL_FAST_WAITING_REASONS[pod.waiting_reason], detail)
    since = next((e.since for e in state.pod_errors if e.uid == pod.uid), None)
    if since is not None:
        grace = job.spec.run_policy.pod_error_grace_seconds
        if (now - since).total_seconds() >= grace:
            return "FailJob", Outcome("Failed", GRACE_WAITING_REASONS[pod.waiting_reason],
                                      f"{detail} (still after runPolicy.podErrorGraceSeconds={grace})")
    if pod.phase == "Failed":
        detail = f"node pod {pod.name} failed ({pod.reason or 'Error'}, exit code {pod.exit_code})"
        if pod.message:
            detail += f": {pod.message}"
        if pod.disrupted:
            return "Ignore", Outcome("Restarting", "NodeDisrupted", detail)
        rule = next((r for r in job.spec.run_policy.exit_code_rules if pod.exit_code in r.exit_codes), None)
        if pod.exit_code == EXIT_RESIZE and rule is None:  # with a request pending, _resize_stop took it
            return "Ignore", Outcome("Restarting", "StoppedWithoutResize",
                                     f"{detail}: a stop for a resize that is no longer requested")
        if rule is not None and rule.action == "FailJob":
            reason = "InvalidConfig" if pod.exit_code == 2 else "FailJobExitCode"
            return "FailJob", Outcome("Failed", reason, f"{detail}; runPolicy.exitCodeRules: FailJob")
        return (rule.action if rule else "Count"), Outcome("Restarting", "NodeFailed", detail)
    if pod.deleting:
        if pod.disrupted:
            return "Ignore", Outcome("Restarting", "NodeDisrupted", f"node pod {pod.name} was disrupted")
        return "Count", _lost(pod.name)
    return None


def _grace_left(state: RunState, job: JobView, now: datetime) -> float | None:
    """Seconds until the first pod error in its grace period becomes fatal."""
    grace = job.spec.run_policy.pod_error_grace_seconds
    left = [grace - (now - e.since).total_seconds() for e in state.pod_errors]
    return max(0.0, min(left)) if left else None


def _node_failure(state: RunState, pod: PodView | None, name: str, why: Outcome, now: datetime) -> NodeFailure:
    """The record of what ended the attempt; ``pod`` is None for a pod that vanished unseen."""
    if pod is None:
        return NodeFailure(state.attempt, name, why.reason, why.message, now)
    return NodeFailure(state.attempt, pod.name, pod.waiting_reason or pod.reason or why.reason,
                       pod.message or why.message, now, pod.rank, pod.exit_code)


def _lost(name: str) -> Outcome:
    return Outcome("Restarting", "NodeLost", f"node pod {name} was deleted while running")


def _restart(job: JobView, pods: Sequence[PodView], state: RunState, now: datetime,
             why: Outcome, counted: bool = True) -> Decision:
    policy = job.spec.run_policy
    if counted and state.restarts >= policy.max_restarts:
        return _finish(job, pods, state, now, Outcome(
            "Failed", "MaxRestartsExceeded",
            f"{why.message}; {state.restarts} restarts used, runPolicy.maxRestarts={policy.max_restarts}"))
    state = _new_attempt(state, restarts=state.restarts + counted, disruptions=state.disruptions + (not counted),
                         last_restart_time=now)
    delay = restart_backoff(policy.backoff_seconds, state.restarts + state.disruptions)
    which = f"restart {state.restarts} of {policy.max_restarts}" if counted else "not counted in maxRestarts"
    message = (f"{why.message}; restarting all {job.spec.cluster.num_nodes} nodes as attempt "
               f"{state.attempt} ({which}) in {delay:g}s")
    return Decision(state, restart=Outcome("Restarting", why.reason, message),
                    delete_pods=tuple(p for p in pods if not p.deleting), requeue_after=delay or None)


def _refusal(job: JobView, rejected: Rejection, now: datetime) -> tuple[Outcome, float | None]:
    """(what the refusals mean, seconds until a 403 fails the job); the outcome is Failed once they do."""
    if rejected.status == FORBIDDEN and QUOTA_REFUSAL in rejected.message:
        elapsed = (now - rejected.since).total_seconds()
        return Outcome("Pending", "QuotaExceeded", (
            f"the namespace's ResourceQuota refuses the node pods ({rejected.tries} tries in {elapsed:.0f}s); "
            f"trying again every {MAX_REFUSED_RETRY_SECONDS:g}s at most until it has room, as long as "
            f"runPolicy.activeDeadlineSeconds allows: {rejected.message}")), None
    if rejected.status == FORBIDDEN:
        grace = job.spec.run_policy.pod_error_grace_seconds
        elapsed = (now - rejected.since).total_seconds()
        left: float | None = grace - elapsed
        tries, limit = f"{rejected.tries} tries in {elapsed:.0f}s", f"runPolicy.podErrorGraceSeconds={grace}"
        fatal = left <= 0
    else:
        left, tries, limit = None, f"{rejected.tries} of {MAX_CHILD_REJECTIONS} tries", "the last try"
        fatal = rejected.tries >= MAX_CHILD_REJECTIONS
    if fatal:
        return Outcome("Failed", "PodCreationRejected", (
            f"the API server refused the node pods ({tries}, past {limit}): {rejected.message}")), None
    return Outcome("Pending", "PodCreationRejected", (
        f"the API server refuses the node pods ({tries}; the job fails after {limit}): {rejected.message}")), left


def stuck_terminating(job: JobView, pods: Sequence[PodView],
                      now: datetime) -> tuple[tuple[PodView, ...], float | None]:
    """(pods Terminating past ``runPolicy.terminatingTimeoutSeconds`` after their grace period,
    seconds until the next one is); a gang restart's and ``stale.clear_stale_pods``' force deletes."""
    timeout = job.spec.run_policy.terminating_timeout_seconds
    due = [(p, (p.deletion_time - now).total_seconds() + timeout) for p in pods if p.deletion_time is not None]
    stuck = tuple(p for p, left in due if left <= 0)
    later = [left for _, left in due if left > 0]
    return stuck, (min(later) if later else None)


def _deadline(job: JobView, state: RunState, now: datetime) -> tuple[Outcome | None, float | None]:
    """(Failed outcome once past activeDeadlineSeconds, seconds left otherwise)."""
    limit = job.spec.run_policy.active_deadline_seconds
    if limit is None or state.start_time is None:
        return None, None
    elapsed = (now - state.start_time).total_seconds()
    if elapsed >= limit:
        return Outcome("Failed", "DeadlineExceeded",
                       f"running for {elapsed:.0f}s, past runPolicy.activeDeadlineSeconds={limit}"), None
    return None, limit - elapsed


def _advance(job: JobView, pods: Sequence[PodView], state: RunState, now: datetime,
             deadline_left: float | None) -> Decision:
    """Replace older attempts' pods, then create missing ranks once the backoff is over."""
    num_nodes = job.spec.cluster.num_nodes
    current = {p.rank for p in pods if p.attempt == state.attempt and p.rank is not None}
    stale = [p for p in pods if p.attempt != state.attempt or p.rank is None or not 0 <= p.rank < num_nodes]
    if stale:
        terminating = sorted(p.name for p in stale if p.deleting)
        stuck, stuck_in = stuck_terminating(job, [p for p in stale if p.deleting], now)
        waiting = None
        if terminating:
            waiting = "WaitingForTermination", (f"waiting for {len(terminating)} pods of earlier attempts to terminate "
                       f"({', '.join(terminating[:4])}); force-deleted "
                       f"runPolicy.terminatingTimeoutSeconds={job.spec.run_policy.terminating_timeout_seconds}"
                       " after their grace period")
        return Decision(state, delete_pods=tuple(p for p in stale if not p.deleting), force_delete_pods=stuck,
                        waiting=waiting, requeue_after=_min(deadline_left, stuck_in))
    wait = 0.0
    resized = state.resizing is not None and state.resizing.attempt == state.attempt
    if state.last_restart_time is not None and not resized:
        delay = restart_backoff(job.spec.run_policy.backoff_seconds, state.restarts + state.disruptions)
        wait = max(0.0, delay - (now - state.last_restart_time).total_seconds())
    missing = tuple(r for r in range(num_nodes) if r not in current | state.succeeded_ranks)
    if wait > 0 or not missing:
        return Decision(state, requeue_after=_min(wait or None, deadline_left))
    state = replace(state, start_time=state.start_time or now, attempt_nodes=num_nodes,
                    attempt_rollout_nodes=_rollout_nodes(job))
    limit = job.spec.run_policy.active_deadline_seconds
    return Decision(state, create_ranks=missing, requeue_after=_min(deadline_left, limit))


def _attempt_nodes(job: JobView, current: Sequence[PodView], state: RunState) -> int:
    """The size the current attempt runs at: as recorded, else (a status an older operator wrote)
    as its pods were created (PET_NNODES), else the spec's."""
    if state.attempt_nodes is not None:
        return state.attempt_nodes
    return next((p.num_nodes for p in current if p.num_nodes), job.spec.cluster.num_nodes)


def _settle(job: JobView, state: RunState, current: Sequence[PodView], now: datetime) -> RunState:
    """The resize in flight is done once every node pod of its attempt runs; a request is withdrawn
    once the spec's size is the attempt's again (the user set it back before the workers stopped)."""
    resize = state.resizing
    if resize is None:
        return state
    if resize.in_place:
        return _settle_in_place(state, current, now)
    if resize.attempt is None:
        withdrawn = job.spec.cluster.num_nodes == _attempt_nodes(job, current, state)
        return replace(state, resizing=None) if withdrawn else state
    if resize.attempt != state.attempt:
        return state
    if sum(p.phase == "Running" and not p.deleting for p in current) < resize.to_nodes:
        return state
    cost = round((now - resize.stopped_at).total_seconds(), 3)
    return replace(state, resizing=None, last_resize=replace(resize, resumed_at=now, cost_seconds=cost))


def _rollout_nodes(job: JobView) -> int | None:
    """async.rolloutPool.numNodes of the spec; None without pools."""
    return job.spec.async_.rollout_pool.num_nodes if job.spec.async_.enable else None


def _in_place_now(state: RunState) -> Resize | None:
    """The in-place resize (of the rollout pool or the whole gang) in flight in the current attempt, if any."""
    resize = state.resizing
    return resize if resize is not None and resize.in_place and resize.attempt == state.attempt else None


def _had_in_place(state: RunState) -> bool:
    """Whether the current attempt was resized in place (in flight or done)."""
    done = state.last_resize
    return _in_place_now(state) is not None or (done is not None and done.in_place and done.attempt == state.attempt)


def _gang_in_place(job: JobView, state: RunState) -> Resize | None:
    """The in-place resize of a synchronous job's whole gang in flight in the current attempt, else the
    one done in it; None when there is neither (an asynchronous job's is the rollout pool's)."""
    if job.spec.async_.enable:
        return None
    done = state.last_resize
    if done is None or not done.in_place or done.attempt != state.attempt:
        done = None
    return _in_place_now(state) or done


def _settle_in_place(state: RunState, current: Sequence[PodView], now: datetime) -> RunState:
    """An in-place resize is done once every pod of the new size runs (grow) or the leaving pods
    are gone (shrink); the attempt then runs at the new size."""
    resize = _in_place_now(state)
    if resize is None:
        return state
    if resize.to_nodes > resize.from_nodes:
        done = sum(p.phase == "Running" and not p.deleting and p.rank is not None and p.rank < resize.to_nodes
                   for p in current) >= resize.to_nodes
    else:
        done = not any(p.rank is not None and p.rank >= resize.to_nodes for p in current)
    if not done:
        return state
    cost = round((now - resize.requested_at).total_seconds(), 3)
    rollout = state.attempt_rollout_nodes
    if rollout is not None:
        rollout += resize.to_nodes - resize.from_nodes
    return replace(state, resizing=None, attempt_nodes=resize.to_nodes, attempt_rollout_nodes=rollout,
                   last_resize=replace(resize, resumed_at=now, cost_seconds=cost))


def _outside(current: Sequence[PodView], state: RunState) -> list[PodView]:
    """Pods of the attempt outside its gang, whose end is no failure: of the ranks an in-place shrink
    in flight removes, once their node exited with EXIT_LEFT_POOL (they left as asked), and, with no
    in-place resize in flight, of ranks past the attempt's size (a withdrawn grow's joiners, deleted)."""
    resize = _in_place_now(state)
    if resize is None:
        size = state.attempt_nodes
        return [] if size is None else [p for p in current if p.rank is not None and p.rank >= size]
    if resize.to_nodes >= resize.from_nodes:
        return []
    return [p for p in current if p.rank is not None and p.rank >= resize.to_nodes
            and p.phase == "Failed" and p.exit_code == EXIT_LEFT_POOL]


def _departed(job: JobView, state: RunState, lost: Collection[str]) -> set[str]:
    """Lost pod names of ranks outside the attempt's gang: ranks an in-place shrink removed, joiners
    of a withdrawn in-place grow (they are gone as asked)."""
    resize = _in_place_now(state)
    size = max(resize.from_nodes, resize.to_nodes) if resize else state.attempt_nodes
    if size is None:
        return set()
    kept = {pod_name(job.name, r) for r in range(size)}
    return {name for name in lost if name not in kept}


def _in_place_request(state: RunState, num_nodes: int) -> dict[str, Any]:
    """The Decision fields of the current attempt's in-place request for ``num_nodes`` nodes: the
    rollout pool's (the trainer nodes kept) when the attempt has one, else the whole gang's (a
    synchronous job: an asynchronous one is resized in place only with its rollout nodes recorded)."""
    if state.attempt_rollout_nodes is None:
        return {"resize_request": num_nodes, "resize_in_place": True}
    rollout = state.attempt_rollout_nodes + num_nodes - (state.attempt_nodes or 0)
    return {"resize_request": num_nodes, "resize_rollout_nodes": rollout}


def _in_place(job: JobView, current: Sequence[PodView], state: RunState, left: Sequence[PodView],
              now: datetime) -> Decision | None:
    """The running attempt resized in place: a synchronous job's whole gang, or an asynchronous job's
    rollout pool alone (``distflow.pools.elastic``). Request it, create the joining pods (grow),
    delete the pods that left (shrink), withdraw a whole gang's the spec no longer asks for; None when
    that is not the case."""
    resize = _in_place_now(state)
    if resize is None:
        resize = _start_in_place(job, current, state, now)
        if resize is None:
            return None
        state = replace(state, resizing=resize)
    elif _withdrawn(job, current, resize):
        state = replace(state, resizing=None)
        beyond = tuple(p for p in current if p.rank is not None and p.rank >= resize.from_nodes and not p.deleting)
        return Decision(state, delete_pods=beyond, **_in_place_request(state, resize.from_nodes))
    request = _in_place_request(state, resize.to_nodes)
    if resize.to_nodes > resize.from_nodes:
        present = {p.rank for p in current if not p.deleting}
        missing = tuple(r for r in range(resize.from_nodes, resize.to_nodes) if r not in present)
        return Decision(state, create_ranks=missing, joining=bool(missing), **request)
    return Decision(state, delete_pods=tuple(p for p in left if not p.deleting), **request)


def _start_in_place(job: JobView, current: Sequence[PodView], state: RunState, now: datetime) -> Resize | None:
    """A new in-place resize while the whole gang runs: a synchronous job's (with the hf rollout
    engine) to any new cluster.numNodes; an asynchronous job's when the spec changes the rollout pool and
    cluster.numNodes by the same amount. None otherwise (then a size change stops the gang)."""
    size, num_nodes = state.attempt_nodes, job.spec.cluster.num_nodes
    if size is None or num_nodes == size or state.succeeded_ranks or state.resizing is not None:
        return None
    if job.spec.async_.enable:
        rollout = state.attempt_rollout_nodes
        if rollout is None or num_nodes - _rollout_nodes(job) != size - rollout:
            return None
    elif job.spec.rollout.engine != "hf":  # a colocated vLLM engine's gang stops (distflow.gang_resize)
        return None
    if len(current) != size or any(p.phase != "Running" or p.deleting for p in current):
        return None
    return Resize(size, num_nodes, now, attempt=state.attempt, in_place=True)


def _withdrawn(job: JobView, current: Sequence[PodView], resize: Resize) -> bool:
    """Whether a synchronous job's in-place resize in flight is withdrawn: the spec's size is the
    attempt's again, and, for a shrink, no leaving rank has left yet (a shrink the workers carried out
    is done first; the grow back is the next resize). A grow whose joiners are not all created is
    withdrawn for a third size too: they would be created for that size, not the requested one."""
    if job.spec.async_.enable:
        return False
    num_nodes = job.spec.cluster.num_nodes
    beyond = [p for p in current if p.rank is not None and p.rank >= min(resize.from_nodes, resize.to_nodes)]
    if resize.to_nodes > resize.from_nodes:
        created = len({p.rank for p in beyond}) == resize.to_nodes - resize.from_nodes
        return num_nodes == resize.from_nodes or (num_nodes != resize.to_nodes and not created)
    return (num_nodes == resize.from_nodes and len(beyond) == resize.from_nodes - resize.to_nodes
            and all(p.phase == "Running" and not p.deleting for p in beyond))


def _keep_request(decision: Decision) -> Decision:
    """After an in-place resize, the ConfigMap keeps its request (the attempt's sizes: no change for
    the workers): a rank that reads it late still re-forms with the others."""
    state = decision.state
    if decision.resize_request is not None or decision.restart or not _had_in_place(state):
        return decision
    return replace(decision, **_in_place_request(state, state.attempt_nodes))


def _resize_stop(job: JobView, pods: Sequence[PodView], current: Sequence[PodView], state: RunState,
                 now: datetime) -> Decision | None:
    """A worker exited with EXIT_RESIZE while a resize is requested: the new attempt at the spec's size.
    During or after an in-place resize of a synchronous job's gang, that is a worker image that
    stops instead (one without in-place resize): it takes the same path."""
    pending = state.resizing if state.resizing is not None and state.resizing.attempt is None else None
    resize = pending or _gang_in_place(job, state)
    stopped = sorted(p.name for p in current if p.phase == "Failed" and p.exit_code == EXIT_RESIZE)
    if resize is None or not stopped:
        return None
    instead = " instead of resizing in place (a worker image without it)" if resize.in_place else ""
    num_nodes = job.spec.cluster.num_nodes
    resize = replace(resize, to_nodes=num_nodes, stopped_at=now, resumed_at=None, attempt=state.attempt + 1,
                     cost_seconds=None, in_place=False)
    state = _new_attempt(state, resizing=resize)
    return Decision(state, restart=Outcome("Restarting", "Resizing", (
        f"node pod {stopped[0]} stopped at a step boundary{instead} for a resize from {resize.from_nodes} to "
        f"{num_nodes} nodes (checkpoint saved); starting attempt {state.attempt} at {num_nodes} nodes "
        "(not a restart)")), delete_pods=tuple(p for p in pods if not p.deleting))


def _resize(job: JobView, pods: Sequence[PodView], current: Sequence[PodView], state: RunState,
            now: datetime) -> Decision | None:
    """spec.cluster.numNodes differs from the running attempt's size: ask the workers to stop, or
    replace a gang that has not started; None when there is nothing to resize."""
    num_nodes = job.spec.cluster.num_nodes
    size = _attempt_nodes(job, current, state)
    pending = state.resizing if state.resizing is not None and state.resizing.attempt is None else None
    if num_nodes == size or not current or state.succeeded_ranks:
        # Nothing to resize, an attempt not created yet (it starts at the spec's size), or ranks
        # that already finished training.
        return None
    if beyond := [p for p in current if p.rank is not None and p.rank >= size]:
        # A withdrawn in-place grow's joiners: the next resize starts in place once they are gone.
        stuck, stuck_in = stuck_terminating(job, [p for p in beyond if p.deleting], now)
        return Decision(state, delete_pods=tuple(p for p in beyond if not p.deleting), force_delete_pods=stuck,
                        requeue_after=stuck_in)
    if len(current) < size or any(p.phase != "Running" for p in current):
        resize = Resize(size, num_nodes, pending.requested_at if pending else now, now, attempt=state.attempt + 1)
        state = _new_attempt(state, resizing=resize)
        return Decision(state, restart=Outcome("Restarting", "Resizing", (
            f"cluster.numNodes changed from {size} to {num_nodes} before the gang ran; replacing its pods "
            f"as attempt {state.attempt} at {num_nodes} nodes (not a restart)")),
            delete_pods=tuple(p for p in pods if not p.deleting))
    if pending is None or pending.to_nodes != num_nodes:
        pending = Resize(size, num_nodes, pending.requested_at if pending else now)
    return Decision(replace(state, resizing=pending), resize_request=num_nodes)


def decide(job: JobView, pods: Sequence[PodView], now: datetime, lost: Collection[str] = (),
           rejected: Rejection | None = None, disrupted: Collection[str] = ()) -> Decision:
    """What to do for ``job`` given its observed node pods (only pods it controls).

    Args:
        lost: names of pods of the status's attempt seen earlier that are gone now.
        rejected: the API server's refusals of the node pods since the last pod it accepted.
        disrupted: names of lost pods whose last observed state was a disruption (eviction, preemption).
    """
    state = run_state(job.status, pods)
    prev_phase = job.status.get("phase")
    if job.deleting:
        return Decision(state)
    if prev_phase in TERMINAL_PHASES:
        return _finish(job, pods, state, now, Outcome(
            prev_phase, job.status.get("reason", prev_phase), job.status.get("message", "")))
    if job.spec is None and (state.start_time is not None or pods):
        # A resize request is withdrawn meanwhile: workers that stopped could not be restarted.
        if state.attempt_nodes is not None and job.requested_nodes not in (None, state.attempt_nodes):
            return Decision(state, held=Outcome(prev_phase or "Pending", "ResizeRefused", (
                f"spec.cluster.numNodes={job.requested_nodes} cannot be applied; the job keeps running at "
                f"{state.attempt_nodes} nodes: " + "; ".join(job.problems))))
        return Decision(state, held=Outcome(prev_phase or "Pending", "UnreadableSpec", (
            "this operator cannot read the spec (operator and CRD versions differ?); the running "
            "job is left as it is until the spec or the operator is fixed: " + "; ".join(job.problems))))
    if job.spec is None:
        return _finish(job, pods, state, now, Outcome("Failed", "InvalidSpec", "; ".join(job.problems)))
    if job.spec.run_policy.suspend:
        return Decision(state, suspended=True, delete_pods=tuple(p for p in pods if not p.deleting))
    if prev_phase == "Suspended" and state.start_time is not None:
        state = _new_attempt(state, start_time=None)
        lost = ()  # the pods the suspension deleted belong to the previous attempt
    past_deadline, deadline_left = _deadline(job, state, now)
    if past_deadline:
        return _finish(job, pods, state, now, past_deadline)
    current = [p for p in pods if p.attempt == state.attempt]
    state = _settle(job, _observe(state, current, now), current, now)
    if stop := _resize_stop(job, pods, current, state, now):
        return stop
    left = _outside(current, state)
    failures = _failures(job, [p for p in current if p not in left], state, now,
                         set(lost) - _departed(job, state, lost), disrupted)
    fatal = next((f for f in failures if f[0] == "FailJob"), None)
    if fatal:
        return _finish(job, pods, replace(state, last_failure=fatal[2]), now, fatal[1])
    refused, refused_left = _refusal(job, rejected, now) if rejected is not None else (None, None)
    if refused is not None and refused.phase == "Failed":
        return _finish(job, pods, state, now, refused)
    if failures:
        counted = [f for f in failures if f[0] == "Count"]
        _, why, failure = (counted or failures)[0]
        return _restart(job, pods, replace(state, last_failure=failure), now, why, counted=bool(counted))
    if done := _gang_succeeded(job, state):
        return _finish(job, pods, state, now, Outcome(
            "Succeeded", "Completed", f"all {done} nodes exited 0 (attempt {state.attempt})"))
    if resize := _in_place(job, current, state, left, now) or _resize(job, pods, current, state, now):
        return replace(resize, requeue_after=_min(resize.requeue_after, deadline_left))
    decision = _keep_request(_advance(job, pods, state, now, deadline_left))
    if refused is not None:
        decision = _hold_refused(decision, refused, refused_left, rejected, now)
    grace_left = _grace_left(state, job, now)
    return replace(decision, requeue_after=_min(decision.requeue_after, grace_left)) if grace_left else decision


def _gang_succeeded(job: JobView, state: RunState) -> int:
    """The nodes of a gang whose every rank exited 0, or 0 while one has not: the spec's, or, with an
    in-place resize in flight, the attempt's own (the gang trained its last step before it re-formed:
    a shrink's leaving ranks exited 0 too, a grow's new pods never joined; the finish deletes those
    still running)."""
    sizes = [job.spec.cluster.num_nodes]
    if _in_place_now(state) is not None and state.attempt_nodes:
        sizes.append(state.attempt_nodes)
    return max((n for n in sizes if state.succeeded_ranks >= set(range(n))), default=0)


def _failures(job: JobView, current: Sequence[PodView], state: RunState, now: datetime,
              lost: Collection[str], disrupted: Collection[str]) -> list[tuple[str, Outcome, NodeFailure]]:
    """(action, why, record) for every pod of the current attempt that failed, is failing or vanished."""
    out = []
    for pod in sorted(current, key=lambda p: p.name):
        if found := _pod_failure(pod, job, state, now):
            out.append((*found, _node_failure(state, pod, pod.name, found[1], now)))
    present = {p.name for p in current} | {pod_name(job.name, r) for r in state.succeeded_ranks}
    for name in sorted(set(lost) - present):
        action, why = (("Ignore", Outcome("Restarting", "NodeDisrupted", f"node pod {name} was disrupted"))
                       if name in disrupted else ("Count", _lost(name)))
        out.append((action, why, _node_failure(state, None, name, why, now)))
    return out


def _hold_refused(decision: Decision, refused: Outcome, fatal_in: float | None, rejected: Rejection,
                  now: datetime) -> Decision:
    """Report the refusal; try the pods again only once the retry delay since the last refusal is over."""
    retry_in = refused_retry_delay(rejected.tries) - (now - rejected.last).total_seconds()
    requeue = _min(decision.requeue_after, fatal_in)
    if decision.create_ranks and retry_in > 0:
        decision, requeue = replace(decision, create_ranks=()), _min(requeue, retry_in)
    return replace(decision, waiting=(refused.reason, refused.message), requeue_after=requeue)
