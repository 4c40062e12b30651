"""Run policy: from an observed job and its pods, decide what to do next. Pure.

The gang is the unit: a job runs as attempt ``a`` (1-based), all node pods
labelled ``distflow.io/attempt=a``. Decisions, in order:

1. A finished job (Succeeded/Failed) never gets children again; its still
   running pods are deleted (finished pods stay for their logs) and
   ``ttlSecondsAfterFinished`` deletes the job itself.
2. An invalid spec fails the job (reason InvalidSpec) without children.
3. ``suspend``: every pod deleted, the job kept. Resuming starts a new attempt
   (so pods still terminating from before are never mistaken for failures) but
   counts no restart; the deadline clock restarts, as for a Kubernetes Job.
4. ``activeDeadlineSeconds`` since the pods were first created: Failed.
5. A node that fails with an error that will repeat (image pull, invalid
   config: exit code 2) fails the job at once. Any other failure, eviction or
   loss of a node pod restarts the whole gang as attempt a+1 after a backoff
   of ``backoffSeconds * 2**(restarts-1)`` (capped at an hour), until
   ``maxRestarts``; the runtime resumes from its last checkpoint.
6. All nodes exited 0: Succeeded.
7. Otherwise pods of older attempts are deleted first, then, once they are gone
   and the backoff has passed, missing ranks are created.

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
EXIT_INVALID_CONFIG = 2
"""`distflow node` exits 2 when its spec is invalid: restarting cannot help."""
FAIL_FAST_WAITING_REASONS = {
    "ErrImagePull": "ImagePullFailed",
    "ImagePullBackOff": "ImagePullFailed",
    "InvalidImageName": "ImagePullFailed",
    "CreateContainerConfigError": "InvalidPodConfig",
}
"""Container waiting reasons that will repeat on every attempt -> job Failed reason."""
MAX_BACKOFF_SECONDS = 3600.0


@dataclass(frozen=True)
class RunState:
    """The run-policy state the operator keeps in the job's status."""

    attempt: int = 1
    restarts: int = 0
    """Gang restarts caused by failures (resuming from suspend is not one)."""
    start_time: datetime | None = None
    last_restart_time: datetime | None = None
    completion_time: datetime | None = None


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
    create_ranks: tuple[int, ...] = ()
    delete_pods: tuple[PodView, ...] = ()
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


def _pod_failure(pod: PodView) -> tuple[bool, Outcome] | None:
    """(fatal, why) when this current-attempt pod has failed or is gone, else None."""
    if pod.waiting_reason in FAIL_FAST_WAITING_REASONS:
        return True, Outcome("Failed", FAIL_FAST_WAITING_REASONS[pod.waiting_reason],
                             f"node pod {pod.name}: {pod.waiting_reason}; {pod.message}".rstrip("; "))
    if pod.phase == "Failed":
        detail = f"node pod {pod.name} failed ({pod.reason or 'Error'}, exit code {pod.exit_code})"
        if pod.message:
            detail += f": {pod.message}"
        if pod.exit_code == EXIT_INVALID_CONFIG:
            return True, Outcome("Failed", "InvalidConfig", detail)
        reason = "NodeEvicted" if pod.reason == "Evicted" else "NodeFailed"
        return False, Outcome("Restarting", reason, detail)
    if pod.deleting:
        return False, _lost(pod.name)
    return None


def _lost(name: str) -> Outcome:
    return Outcome("Restarting", "NodeLost", f"node pod {name} was deleted while running")


def _restart(job: JobView, pods: Sequence[PodView], state: RunState, now: datetime,
             why: Outcome) -> Decision:
    policy = job.spec.run_policy
    if state.restarts >= policy.max_restarts:
        return _finish(job, pods, state, now, Outcome(
            "Failed", "MaxRestartsExceeded",
            f"{why.message}; {state.restarts} restarts used, runPolicy.maxRestarts={policy.max_restarts}"))
    state = replace(state, attempt=state.attempt + 1, restarts=state.restarts + 1, last_restart_time=now)
    delay = restart_backoff(policy.backoff_seconds, state.restarts)
    message = (f"{why.message}; restarting all {job.spec.cluster.num_nodes} nodes as attempt "
               f"{state.attempt} (restart {state.restarts} of {policy.max_restarts}) in {delay:g}s")
    return Decision(state, restart=Outcome("Restarting", why.reason, message),
                    delete_pods=tuple(p for p in pods if not p.deleting), requeue_after=delay or None)


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
        return Decision(state, delete_pods=tuple(p for p in stale if not p.deleting),
                        requeue_after=deadline_left)
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


def decide(job: JobView, pods: Sequence[PodView], now: datetime,
           lost: Collection[str] = ()) -> Decision:
    """What to do for ``job`` given its observed node pods (only pods it controls).

    Args:
        lost: names of pods of the status's attempt seen earlier that are gone now.
    """
    state = run_state(job.status, pods)
    prev_phase = job.status.get("phase")
    if job.deleting:
        return Decision(state)
    if prev_phase in TERMINAL_PHASES:
        return _finish(job, pods, state, now, Outcome(
            prev_phase, job.status.get("reason", prev_phase), job.status.get("message", "")))
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
    failures = [f for f in (_pod_failure(p) for p in sorted(current, key=lambda p: p.name)) if f]
    present = {p.name for p in current}
    failures += [(False, _lost(name)) for name in sorted(lost) if name not in present]
    fatal = next((why for is_fatal, why in failures if is_fatal), None)
    if fatal:
        return _finish(job, pods, state, now, fatal)
    if failures:
        return _restart(job, pods, state, now, failures[0][1])
    done = {p.rank for p in current if p.phase == "Succeeded"}
    if len(done) == job.spec.cluster.num_nodes:
        return _finish(job, pods, state, now, Outcome(
            "Succeeded", "Completed", f"all {len(done)} nodes exited 0 (attempt {state.attempt})"))
    return _advance(job, pods, state, now, deadline_left)
