"""Pods that hold this job's names but belong to an earlier job of the same name. Pure.

A job deleted and applied again under its old name gets a new uid while the
old job's pods may still be there: Terminating (their grace period, a
NotReady node whose kubelet never confirms) or not yet reached by the garbage
collector. A pod name is unique in a namespace, so the new job's create of
``<job>-node-<rank>`` answers 409 until the old pod is gone; without this
step the job would sit Pending with nothing said.

What is done: an old pod whose controller is another uid (the earlier job,
which cannot still exist under this name) is deleted with a uid
precondition; one still Terminating ``runPolicy.terminatingTimeoutSeconds``
past its grace period is force-deleted, as a gang restart does with its own
pods. A pod with this job's label and no controller is someone else's: the
job waits and says so. Meanwhile the status gives the reason and the pod
names, and the ranks whose names are held are not created.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime

from distflow_operator.observed import JobView, PodView
from distflow_operator.policy import Decision, stuck_terminating
from distflow_operator.render import pod_name

STALE_REASON = "StalePodsOfEarlierJob"
UNOWNED_REASON = "PodNamesTaken"


def _names(pods: Sequence[PodView]) -> str:
    names = sorted(p.name for p in pods)
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def clear_stale_pods(job: JobView, stale: Sequence[PodView], decision: Decision, now: datetime) -> Decision:
    """``decision`` extended to remove ``stale`` (pods with this job's label that it does not control).

    Returns ``decision`` unchanged when there are none or the job is finished, held or unreadable.
    """
    if not stale or job.spec is None or decision.terminal or decision.held:
        return decision
    owned = [p for p in stale if p.owner_uid]
    unowned = [p for p in stale if not p.owner_uid]
    stuck, stuck_in = stuck_terminating(job, [p for p in owned if p.deleting], now)
    if unowned:
        waiting = UNOWNED_REASON, (f"pods {_names(unowned)} carry this job's labels and names but no owner: "
                                   "delete them; the job creates those ranks once they are gone")
    else:
        owners = ", ".join(sorted({p.owner_uid or "" for p in owned}))
        waiting = STALE_REASON, (
            f"pods {_names(owned)} belong to an earlier job of this name (uid {owners}); deleting them "
            f"(force-deleted runPolicy.terminatingTimeoutSeconds={job.spec.run_policy.terminating_timeout_seconds}"
            " after their grace period) before this job's pods of those names are created")
    held = {p.name for p in stale}
    requeue = [t for t in (decision.requeue_after, stuck_in) if t is not None]
    return replace(
        decision,
        create_ranks=tuple(r for r in decision.create_ranks if pod_name(job.name, r) not in held),
        delete_pods=decision.delete_pods + tuple(p for p in owned if not p.deleting),
        force_delete_pods=decision.force_delete_pods + stuck,
        waiting=waiting, requeue_after=min(requeue) if requeue else None)
