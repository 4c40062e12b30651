"""What the operator observes, reduced to small immutable views.

``pod_view`` keeps only what policy and status need from a Pod (a few hundred
bytes instead of the whole object): the operator's pod index holds these, which
keeps its memory flat in the number of pods. ``job_view`` validates the job's
spec once per reconcile with the same model ``distflow run`` uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from distflow.errors import DistflowConfigError
from distflow.spec import JobSpec, parse_spec_ignoring_unknown

from distflow_operator.podspec import KUEUE_QUEUE_LABEL
from distflow_operator.render import CONTAINER_NAME, LABEL_ATTEMPT, LABEL_RANK, template_problems


DISRUPTION_REASONS = ("Evicted", "Preempted", "Preempting", "Terminated")
"""Pod status reasons a kubelet or scheduler sets when it, not the workload, ended the pod."""
DISRUPTION_CONDITIONS = ("DisruptionTarget", "TerminationTarget")
"""Pod conditions that mark a stop the workload did not cause: DisruptionTarget (scheduler preemption,
eviction, taint manager, pod GC) and TerminationTarget, which Kueue's pod integration sets when it
preempts or evicts a workload (sigs.k8s.io/kueue pkg/controller/jobs/pod, ConditionTypeTerminationTarget)."""


def format_time(value: datetime) -> str:
    """RFC 3339 in UTC with second precision, as Kubernetes writes times."""
    return value.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def _int_label(labels: Mapping[str, str], key: str) -> int | None:
    try:
        return int(labels[key])
    except (KeyError, ValueError):
        return None


@dataclass(frozen=True)
class PodView:
    """One node pod as observed."""

    name: str
    uid: str = ""
    owner_uid: str | None = None
    """uid of the controlling owner (the job), if any."""
    rank: int | None = None
    attempt: int | None = None
    phase: str = "Pending"
    """Pending, Running, Succeeded, Failed or Unknown."""
    scheduled: bool = False
    ready: bool = False
    deleting: bool = False
    """deletionTimestamp is set."""
    deletion_time: datetime | None = None
    """deletionTimestamp: when the grace period of a deleted pod ends."""
    created: datetime | None = None
    disrupted: bool = False
    """A DISRUPTION_CONDITIONS condition is True (preemption, eviction, Kueue) or the pod was evicted."""
    waiting_reason: str | None = None
    """Why the node container is not started yet (ErrImagePull, ...)."""
    exit_code: int | None = None
    """The node container's exit code once terminated."""
    reason: str | None = None
    """Pod reason (Evicted) or the container's terminated reason (OOMKilled, Error)."""
    message: str = ""
    """Pod message or the container's termination message (first 400 characters)."""
    pod_ip: str | None = None
    metrics_port: int | None = None
    num_nodes: int | None = None
    """The gang size the pod was created for (its node container's PET_NNODES)."""


def _conditions(status: Mapping[str, Any]) -> dict[str, str]:
    return {c.get("type"): c.get("status") for c in status.get("conditions") or []}


def _node_container_status(status: Mapping[str, Any]) -> Mapping[str, Any]:
    statuses = status.get("containerStatuses") or []
    for item in statuses:
        if item.get("name") == CONTAINER_NAME:
            return item
    return statuses[0] if statuses else {}


def _metrics_port(spec: Mapping[str, Any]) -> int | None:
    for container in spec.get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "metrics":
                return port.get("containerPort")
    return None


def _num_nodes(spec: Mapping[str, Any]) -> int | None:
    for container in spec.get("containers") or []:
        if container.get("name") == CONTAINER_NAME:
            value = next((e.get("value") for e in container.get("env") or [] if e.get("name") == "PET_NNODES"), None)
            return int(value) if isinstance(value, str) and value.isdigit() else None
    return None


def pod_view(pod: Mapping[str, Any]) -> PodView:
    """Reduce a Pod (as returned by the API) to a :class:`PodView`."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    labels = meta.get("labels") or {}
    owner_uid = next((o.get("uid") for o in meta.get("ownerReferences") or [] if o.get("controller")), None)
    conditions = _conditions(status)
    state = _node_container_status(status).get("state") or {}
    waiting = state.get("waiting") or {}
    terminated = state.get("terminated") or {}
    return PodView(
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        owner_uid=owner_uid,
        rank=_int_label(labels, LABEL_RANK),
        attempt=_int_label(labels, LABEL_ATTEMPT),
        phase=status.get("phase") or "Pending",
        scheduled=conditions.get("PodScheduled") == "True" or bool(spec.get("nodeName")),
        ready=conditions.get("Ready") == "True",
        deleting=bool(meta.get("deletionTimestamp")),
        deletion_time=parse_time(meta.get("deletionTimestamp")),
        created=parse_time(meta.get("creationTimestamp")),
        disrupted=(any(conditions.get(c) == "True" for c in DISRUPTION_CONDITIONS)
                   or status.get("reason") in DISRUPTION_REASONS),
        waiting_reason=waiting.get("reason"),
        exit_code=terminated.get("exitCode"),
        reason=status.get("reason") or terminated.get("reason"),
        message=(status.get("message") or terminated.get("message") or "").strip()[:400],
        pod_ip=status.get("podIP"),
        metrics_port=_metrics_port(spec),
        num_nodes=_num_nodes(spec),
    )


@dataclass(frozen=True)
class JobView:
    """One RLPostTrainJob as observed, with its spec validated."""

    name: str
    namespace: str
    uid: str
    generation: int = 1
    created: datetime | None = None
    deleting: bool = False
    spec: JobSpec | None = None
    """None when the spec is invalid (see problems)."""
    problems: tuple[str, ...] = ()
    """Why the spec can never work, each naming its field."""
    unknown_fields: tuple[str, ...] = ()
    """Spec fields this operator does not know (a newer CRD); ignored, reported in a condition."""
    status: Mapping[str, Any] = field(default_factory=dict)
    """The status as last written (by this operator)."""
    kueue_queue: str | None = None
    """The job's kueue.x-k8s.io/queue-name label (its pods then form Kueue pod groups)."""
    requested_nodes: int | None = None
    """spec.cluster.numNodes as written, even when the spec is invalid (a resize the operator refuses)."""


def _requested_nodes(spec: Any) -> int | None:
    cluster = spec.get("cluster") if isinstance(spec, Mapping) else None
    nodes = cluster.get("numNodes") if isinstance(cluster, Mapping) else None
    return nodes if isinstance(nodes, int) and not isinstance(nodes, bool) else None


def job_view(body: Mapping[str, Any], status: Mapping[str, Any] | None = None) -> JobView:
    """Build a :class:`JobView` from a job object; ``status`` overrides body.status
    (the operator passes the status it wrote last, which a watch may not have delivered yet)."""
    meta = body.get("metadata") or {}
    spec: JobSpec | None = None
    problems: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()
    try:
        # A CRD newer than this operator (upgrade order, or a rolled-back operator) serves fields it
        # does not know; failing a running job over a field it cannot act on would turn skew into an outage.
        spec, unknown = parse_spec_ignoring_unknown(body.get("spec"), root="spec")
    except DistflowConfigError as err:
        problems = tuple(err.problems)
    if spec is not None and (template := template_problems(spec) or workflow_problems(spec)):
        spec, problems = None, tuple(template)
    return JobView(
        name=meta.get("name", ""),
        namespace=meta.get("namespace", ""),
        uid=meta.get("uid", ""),
        generation=meta.get("generation") or 1,
        created=parse_time(meta.get("creationTimestamp")),
        deleting=bool(meta.get("deletionTimestamp")),
        spec=spec,
        problems=problems,
        unknown_fields=unknown,
        status=dict(status if status is not None else body.get("status") or {}),
        kueue_queue=(meta.get("labels") or {}).get(KUEUE_QUEUE_LABEL) or None,
        requested_nodes=_requested_nodes(body.get("spec")),
    )


def workflow_problems(spec: JobSpec) -> list[str]:
    """What the planner rejects in a custom workflow (a cycle, a node reading what nothing upstream
    produces): every pod's pre-flight would fail on it, so the job fails before any pod exists.
    Built-in workflows always plan once the schema's size rules hold, and are not planned here."""
    if not spec.workflow.nodes:
        return []
    from distflow.planner import build_plan

    try:
        build_plan(spec)
    except DistflowConfigError as err:
        return list(err.problems)
    return []

