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
   ``backoffSeconds * 2**(restarts-1)`` (capped at an hour), until
   ``maxRestarts``. Disruptions (preemption, eviction: the DisruptionTarget
   condition) and ``Ignore`` exit codes restart the gang without using up
   ``maxRestarts``, as a Job's podFailurePolicy does. The runtime resumes
   from its last checkpoint.
6. All nodes exited 0: Succeeded.
7. Otherwise pods of older attempts are deleted first, then, once they are gone
   and the backoff has passed, missing ranks are created. A pod still
   Terminating ``terminatingTimeoutSeconds`` after its grace period (its node
   is gone and no kubelet confirms) is force-deleted; meanwhile the status
   says which pods the restart waits for. When the API server refuses the
   pods, the status says why at once; a refusal as invalid (400, 422) fails
   the job after three passes in a row, a 403 (quota, Pod Security, RBAC)
   once it has lasted ``podErrorGraceSeconds`` (see :class:`Rejection`).

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

from distflow_operator.observed import JobView, PodView, parse_time

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
MAX_BACKOFF_SECONDS = 3600.0


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


@dataclass(frozen=True)
class Rejection:
    """The API server refused to create the node pods on every pass since ``since``.

    Why two clocks: 400 and 422 say the pod itself is invalid, which only a spec
    edit fixes, so a few tries suffice. 403 is a verdict on the cluster's state
    (quota in use, the namespace's Pod Security level, RBAC, or an admission
    plugin whose discovery lags a CRD installed moments ago), which can change
    without any edit: it fails the job only after ``podErrorGraceSeconds``.
    """

    tries: int
    status: int
    """HTTP status of the last refusal."""
    message: str
    since: datetime
    """When the first refusal of this run happened."""


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


def run_state(status: Mapping[str, Any], pods: Sequence[PodView]) -> RunState:
    """The run state from the last written status; pods of a newer attempt win
    (their status write may have been lost)."""
    attempt = max([status.get("attempt") or 1] + [p.attempt for p in pods if p.attempt])
    return RunState(
        attempt=attempt,
        restarts=status.get("restarts") or 0,
        disruptions=status.get("disruptions") or 0,
        start_time=parse_time(status.get("startTime")),
        last_restart_time=parse_time(status.get("lastRestartTime")),
        completion_time=parse_time(status.get("completionTime")),
    )


def restart_backoff(backoff_seconds: float, restarts: int) -> float:
    """Delay before gang restart number ``restarts`` (1-based), in seconds."""
    if restarts < 1:
        return 0.0
    return min(backoff_seconds * 2.0 ** (restarts - 1), MAX_BACKOFF_SECONDS)


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


def _pod_failure(pod: PodView, job: JobView, now: datetime) -> Failure | None:
    """What this current-attempt pod's state means, or None when it is fine (or within a grace period)."""
    detail = f"node pod {pod.name}: {pod.waiting_reason}; {pod.message}".rstrip("; ")
    if pod.waiting_reason in FAIL_FAST_WAITING_REASONS:
        return "FailJob", Outcome("Failed", FAIL_FAST_WAITING_REASONS[pod.waiting_reason], detail)
    if pod.waiting_reason in GRACE_WAITING_REASONS and pod.created is not None:
        grace = job.spec.run_policy.pod_error_grace_seconds
        if (now - pod.created).total_seconds() >= grace:
            return "FailJob", Outcome("Failed", GRACE_WAITING_REASONS[pod.waiting_reason],
                                      f"{detail} (still after runPolicy.podErrorGraceSeconds={grace})")
    if pod.phase == "Failed":
        detail = f"node pod {pod.name} failed ({pod.reason or 'Error'}, exit code {pod.exit_code})"
        if pod.message:
            detail += f": {pod.message}"
        if pod.disrupted:
            return "Ignore", Outcome("Restarting", "NodeDisrupted", detail)
        rule = next((r for r in job.spec.run_policy.exit_code_rules if pod.exit_code in r.exit_codes), None)
        if rule is not None and rule.action == "FailJob":
            reason = "InvalidConfig" if pod.exit_code == 2 else "FailJobExitCode"
            return "FailJob", Outcome("Failed", reason, f"{detail}; runPolicy.exitCodeRules: FailJob")
        return (rule.action if rule else "Count"), Outcome("Restarting", "NodeFailed", detail)
    if pod.deleting:
        if pod.disrupted:
            return "Ignore", Outcome("Restarting", "NodeDisrupted", f"node pod {pod.name} was disrupted")
        return "Count", _lost(pod.name)
    return None


def _grace_left(pods: Sequence[PodView], job: JobView, now: datetime) -> float | None:
    """Seconds until the first pod error in its grace period becomes fatal."""
    grace = job.spec.run_policy.pod_error_grace_seconds
    left = [grace - (now - p.created).total_seconds() for p in pods
            if p.waiting_reason in GRACE_WAITING_REASONS and p.created is not None]
    return max(0.0, min(left)) if left else None


def _lost(name: str) -> Outcome:
    return Outcome("Restarting", "NodeLost", f"node pod {name} was deleted while running")


def _restart(job: JobView, pods: Sequence[PodView], state: RunState, now: datetime,
             why: Outcome, counted: bool = True) -> Decision:
    policy = job.spec.run_policy
    if counted and state.restarts >= policy.max_restarts:
        return _finish(job, pods, state, now, Outcome(
            "Failed", "MaxRestartsExceeded",
            f"{why.message}; {state.restarts} restarts used, runPolicy.maxRestarts={policy.max_restarts}"))
    state = replace(state, attempt=state.attempt + 1, restarts=state.restarts + counted,
                    disruptions=state.disruptions + (not counted), last_restart_time=now)
    delay = restart_backoff(policy.backoff_seconds, state.restarts) if counted else 0.0
    which = f"restart {state.restarts} of {policy.max_restarts}" if counted else "not counted in maxRestarts"
    message = (f"{why.message}; restarting all {job.spec.cluster.num_nodes} nodes as attempt "
               f"{state.attempt} ({which}) in {delay:g}s")
    return Decision(state, restart=Outcome("Restarting", why.reason, message),
                    delete_pods=tuple(p for p in pods if not p.deleting), requeue_after=delay or None)


def _refusal(job: JobView, rejected: Rejection, now: datetime) -> tuple[Outcome, float | None]:
    """(what the refusals mean, seconds until a 403 fails the job); the outcome is Failed once they do."""
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


def _stuck(job: JobView, pods: Sequence[PodView], now: datetime) -> tuple[tuple[PodView, ...], float | None]:
    """(pods Terminating past the timeout, seconds until the next one is)."""
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
        stuck, stuck_in = _stuck(job, [p for p in stale if p.deleting], now)
        waiting = None
        if terminating:
            waiting = "WaitingForTermination", (f"waiting for {len(terminating)} pods of earlier attempts to terminate "
                       f"({', '.join(terminating[:4])}); force-deleted "
                       f"runPolicy.terminatingTimeoutSeconds={job.spec.run_policy.terminating_timeout_seconds}"
                       " after their grace period")
        return Decision(state, delete_pods=tuple(p for p in stale if not p.deleting), force_delete_pods=stuck,
                        waiting=waiting, requeue_after=_min(deadline_left, stuck_in))
    wait = 0.0
    if state.last_restart_time is not None:
        delay = restart_backoff(job.spec.run_policy.backoff_seconds, state.restarts)
        wait = max(0.0, delay - (now - state.last_restart_time).total_seconds())
    missing = tuple(r for r in range(num_nodes) if r not in current)
    if wait > 0 or not missing:
        return Decision(state, requeue_after=_min(wait or None, deadline_left))
    state = replace(state, start_time=state.start_time or now)
    limit = job.spec.run_policy.active_deadline_seconds
    return Decision(state, create_ranks=missing, requeue_after=_min(deadline_left, limit))


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
        return Decision(state, held=Outcome(prev_phase or "Pending", "UnreadableSpec", (
            "this operator cannot read the spec (operator and CRD versions differ?); the running "
            "job is left as it is until the spec or the operator is fixed: " + "; ".join(job.problems))))
    if job.spec is None:
        return _finish(job, pods, state, now, Outcome("Failed", "InvalidSpec", "; ".join(job.problems)))
    if job.spec.run_policy.suspend:
        return Decision(state, suspended=True, delete_pods=tuple(p for p in pods if not p.deleting))
    if prev_phase == "Suspended" and state.start_time is not None:
        state = replace(state, attempt=state.attempt + 1, start_time=None)
        lost = ()  # the pods the suspension deleted belong to the previous attempt
    past_deadline, deadline_left = _deadline(job, state, now)
    if past_deadline:
        return _finish(job, pods, state, now, past_deadline)
    current = [p for p in pods if p.attempt == state.attempt]
    failures = [f for f in (_pod_failure(p, job, now) for p in sorted(current, key=lambda p: p.name)) if f]
    present = {p.name for p in current}
    failures += [("Ignore", Outcome("Restarting", "NodeDisrupted", f"node pod {name} was disrupted"))
                 if name in disrupted else ("Count", _lost(name)) for name in sorted(lost) if name not in present]
    fatal = next((why for action, why in failures if action == "FailJob"), None)
    if fatal:
        return _finish(job, pods, state, now, fatal)
    refused, refused_left = _refusal(job, rejected, now) if rejected is not None else (None, None)
    if refused is not None and refused.phase == "Failed":
        return _finish(job, pods, state, now, refused)
    if failures:
        counted = [why for action, why in failures if action == "Count"]
        return _restart(job, pods, state, now, (counted or [failures[0][1]])[0], counted=bool(counted))
    done = {p.rank for p in current if p.phase == "Succeeded"}
    if len(done) == job.spec.cluster.num_nodes:
        return _finish(job, pods, state, now, Outcome(
            "Succeeded", "Completed", f"all {len(done)} nodes exited 0 (attempt {state.attempt})"))
    decision = _advance(job, pods, state, now, deadline_left)
    if refused is not None:
        decision = replace(decision, waiting=(refused.reason, refused.message),
                           requeue_after=_min(decision.requeue_after, refused_left))
    grace_left = _grace_left(current, job, now)
    return replace(decision, requeue_after=_min(decision.requeue_after, grace_left)) if grace_left else decision
