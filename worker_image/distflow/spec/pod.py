"""The operator's sections of the spec: how node pods are scheduled and what they look like.

``spec.scheduling`` and ``spec.template`` mean nothing to a local run; the
operator renders them into each node pod (distflow_operator.render). Typed
fields cover what platform teams set on every training pod: metadata, a
security context that passes the Pod Security Standards "restricted" profile
by default, pull secrets, host networking and a runtime class (RDMA), spread
constraints, a sized /dev/shm and PVC mounts. ``volumes``/``volumeMounts``
stay free-form for volume types the typed fields do not cover.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from distflow.spec.base import SpecBase

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
QUANTITY = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$"
"""A Kubernetes resource quantity in the forms people write for sizes (``16Gi``, ``512M``)."""


class SchedulingSpec(SpecBase):
    batch_scheduler: Literal["none", "volcano", "scheduler-plugins"] = "none"
    """Gang scheduling through a PodGroup of this scheduler."""
    scheduler_name: str | None = None
    """Pod schedulerName (defaults to the batch scheduler's)."""
    priority_class_name: str | None = None
    """Pod priority class."""
    queue: str | None = None
    """Volcano queue."""


class SecurityContextSpec(SpecBase):
    """Pod and container security settings. The defaults satisfy the Pod Security
    Standards "restricted" profile: non-root, no privilege escalation, every
    capability dropped, the runtime's default seccomp profile."""

    run_as_non_root: bool = True
    """The kubelet refuses to start the container as uid 0 (the worker image runs as 10001)."""
    run_as_user: int | None = Field(default=None, ge=0)
    """Container uid (default: the image's USER)."""
    run_as_group: int | None = Field(default=None, ge=0)
    """Container gid (default: the image's)."""
    fs_group: int | None = Field(default=None, ge=0)
    """Group that owns mounted volumes (PVCs written by the workers)."""
    seccomp_profile: Literal["RuntimeDefault", "Unconfined"] = "RuntimeDefault"
    """Seccomp profile type; "restricted" allows RuntimeDefault only of these."""
    allow_privilege_escalation: bool = False
    """setuid binaries may not gain privileges."""
    privileged: bool = False
    """Privileged container (device plugins without a runtime class may need it; not "restricted")."""
    read_only_root_filesystem: bool = False
    """Mount the image read-only (caches then need volumes)."""
    add_capabilities: list[str] = Field(default_factory=list)
    """Capabilities kept after dropping ALL (e.g. IPC_LOCK for RDMA; "restricted" allows only NET_BIND_SERVICE)."""

    @model_validator(mode="after")
    def _root_consistent(self) -> "SecurityContextSpec":
        if self.run_as_non_root and self.run_as_user == 0:
            raise ValueError("runAsUser: 0 contradicts runAsNonRoot: true; set runAsNonRoot: false "
                             "to run as root, or pick a non-zero uid")
        return self


class TopologySpreadSpec(SpecBase):
    """Spread this job's node pods over a topology domain (zone, rack, node);
    the operator adds the label selector (this job's pods of the current attempt)."""

    topology_key: str = Field(min_length=1)
    """Node label that defines a domain, e.g. topology.kubernetes.io/zone."""
    max_skew: int = Field(default=1, ge=1)
    """Largest allowed difference in node pods between two domains."""
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"] = "DoNotSchedule"
    """Hard (DoNotSchedule) or soft (ScheduleAnyway) constraint."""
    min_domains: int | None = Field(default=None, ge=1)
    """Domains that must exist before pods pile into fewer (DoNotSchedule only)."""


class PvcVolumeSpec(SpecBase):
    """A PersistentVolumeClaim mounted into the node container (checkpoints, datasets)."""

    name: str = Field(pattern=DNS_LABEL, max_length=63)
    """Volume name in the pod."""
    claim_name: str = Field(min_length=1)
    """The PVC in the job's namespace."""
    mount_path: str = Field(pattern=r"^/")
    """Absolute path in the container."""
    read_only: bool = False
    """Mount read-only."""
    sub_path: str | None = None
    """Mount only this sub-directory of the volume."""


class PodTemplateSpec(SpecBase):
    image: str = "distflow/worker:0.1.0"
    """Worker image."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """Image pull policy."""
    image_pull_secrets: list[str] = Field(default_factory=list)
    """Names of Secrets in the job's namespace to pull the image with."""
    # The bound keeps the CRD's CEL check on label keys within the API server's cost budget.
    labels: dict[str, str] = Field(default_factory=dict, max_length=64)
    """Extra labels on every node pod (keys the operator sets are rejected)."""
    annotations: dict[str, str] = Field(default_factory=dict, max_length=64)
    """Extra annotations on every node pod."""
    resources: dict[str, Any] = Field(default_factory=dict)
    """Container resources (requests/limits); accelerators are added from cluster.acceleratorsPerNode."""
    env: list[dict[str, Any]] = Field(default_factory=list)
    """Extra container env (names the operator sets are rejected)."""
    security_context: SecurityContextSpec = Field(default_factory=SecurityContextSpec)
    """Pod and container security; the defaults pass Pod Security "restricted"."""
    host_network: bool = False
    """Use the node's network namespace (RDMA/RoCE without a CNI for it). Needs a namespace
    whose Pod Security level is "privileged"; DNS then uses ClusterFirstWithHostNet."""
    runtime_class_name: str | None = None
    """RuntimeClass of the pods (e.g. one that exposes RDMA devices or the NVIDIA runtime)."""
    shm_size: str | None = Field(default=None, pattern=QUANTITY)
    """Size limit of /dev/shm (memory-backed; counts against the container's memory limit).
    Unset: no limit beyond the pod's memory."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Pod nodeSelector."""
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    """Pod tolerations."""
    affinity: dict[str, Any] = Field(default_factory=dict)
    """Pod affinity."""
    topology_spread_constraints: list[TopologySpreadSpec] = Field(default_factory=list)
    """Spread of the node pods over zones, racks or nodes."""
    persistent_volume_claims: list[PvcVolumeSpec] = Field(default_factory=list)
    """PVCs mounted into the node container."""
    volumes: list[dict[str, Any]] = Field(default_factory=list)
    """Extra pod volumes of other types (free-form Kubernetes Volume objects)."""
    volume_mounts: list[dict[str, Any]] = Field(default_factory=list)
    """Extra container volume mounts."""
    service_account_name: str | None = None
    """Pod service account."""
