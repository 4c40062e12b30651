"""Pure pieces of a node pod from spec.template and the job's Kueue queue.

render.build_node_pod assembles the pod; this module turns the typed template
fields into Kubernetes fields (security contexts, volumes, spread constraints)
and the job's ``kueue.x-k8s.io/queue-name`` label into Kueue's pod-group
metadata.

Kueue (plain pod integration) admits a *pod group* as one Workload: every pod
carries the group name and the total count, Kueue's webhook gates each pod
(``kueue.x-k8s.io/admission``), and Kueue lifts the gates of all of them
together once the whole group fits the queue's quota. One group per gang
attempt, marked not retriable: a failed attempt's Workload finishes when its
pods stop, so its quota is released, and the next attempt queues afresh as
a new gang (the operator, not Kueue, replaces failed pods).
"""

from __future__ import annotations

from typing import Any

from distflow.spec import JobSpec
from distflow.spec.pod import PvcVolumeSpec, SecurityContextSpec, TopologySpreadSpec

KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_TOTAL_COUNT = "kueue.x-k8s.io/pod-group-total-count"
KUEUE_RETRIABLE = "kueue.x-k8s.io/retriable-in-group"
KUEUE_KEYS = (KUEUE_QUEUE_LABEL, KUEUE_GROUP_LABEL, KUEUE_TOTAL_COUNT, KUEUE_RETRIABLE,
              "kueue.x-k8s.io/managed", "kueue.x-k8s.io/role-hash")
"""Metadata keys Kueue or the operator set for Kueue; spec.template may not set them."""


def kueue_group_name(job: str, attempt: int) -> str:
    """Pod group (and Kueue Workload) of one gang attempt; at most 53 + 5 characters."""
    return f"{job}-a{attempt}"


def kueue_metadata(queue: str | None, job: str, attempt: int,
                   num_nodes: int) -> tuple[dict[str, str], dict[str, str]]:
    """(labels, annotations) that make the attempt's node pods one Kueue pod group; empty without a queue."""
    if not queue:
        return {}, {}
    labels = {KUEUE_QUEUE_LABEL: queue, KUEUE_GROUP_LABEL: kueue_group_name(job, attempt)}
    annotations = {KUEUE_TOTAL_COUNT: str(num_nodes), KUEUE_RETRIABLE: "false"}
    return labels, annotations


def security_contexts(sc: SecurityContextSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod securityContext, container securityContext); capabilities: drop ALL, add the listed."""
    pod: dict[str, Any] = {"runAsNonRoot": sc.run_as_non_root, "seccompProfile": {"type": sc.seccomp_profile}}
    for key, value in (("runAsUser", sc.run_as_user), ("runAsGroup", sc.run_as_group),
                       ("fsGroup", sc.fs_group)):
        if value is not None:
            pod[key] = value
    capabilities: dict[str, Any] = {"drop": ["ALL"]}
    if sc.add_capabilities:
        capabilities["add"] = list(sc.add_capabilities)
    container = {"allowPrivilegeEscalation": sc.allow_privilege_escalation, "privileged": sc.privileged,
                 "readOnlyRootFilesystem": sc.read_only_root_filesystem, "capabilities": capabilities}
    return pod, container


def shm_volume(name: str, size: str | None) -> dict[str, Any]:
    """Memory-backed /dev/shm (NCCL and the node buffer use it; the runtime's default 64Mi is too small)."""
    empty_dir: dict[str, Any] = {"medium": "Memory"}
    if size:
        empty_dir["sizeLimit"] = size
    return {"name": name, "emptyDir": empty_dir}


def pvc_volumes(pvcs: list[PvcVolumeSpec]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(pod volumes, container volumeMounts) of the typed PVC entries."""
    volumes, mounts = [], []
    for pvc in pvcs:
        volumes.append({"name": pvc.name, "persistentVolumeClaim": {"claimName": pvc.claim_name,
                                                                    "readOnly": pvc.read_only}})
        mount: dict[str, Any] = {"name": pvc.name, "mountPath": pvc.mount_path, "readOnly": pvc.read_only}
        if pvc.sub_path:
            mount["subPath"] = pvc.sub_path
        mounts.append(mount)
    return volumes, mounts


def spread_constraints(items: list[TopologySpreadSpec], selector: dict[str, str],
                       attempt_label: str) -> list[dict[str, Any]]:
    """topologySpreadConstraints over this job's node pods; matchLabelKeys on the attempt label
    keeps pods of an older attempt that are still terminating out of the count."""
    out = []
    for item in items:
        constraint: dict[str, Any] = {"maxSkew": item.max_skew, "topologyKey": item.topology_key,
                                      "whenUnsatisfiable": item.when_unsatisfiable,
                                      "labelSelector": {"matchLabels": dict(selector)},
                                      "matchLabelKeys": [attempt_label]}
        if item.min_domains is not None:
            constraint["minDomains"] = item.min_domains
        out.append(constraint)
    return out


def host_fields(spec: JobSpec) -> dict[str, Any]:
    """Pod fields for pull secrets, host networking and the runtime class (absent when unset)."""
    tpl = spec.template
    fields: dict[str, Any] = {}
    if tpl.image_pull_secrets:
        fields["imagePullSecrets"] = [{"name": name} for name in tpl.image_pull_secrets]
    if tpl.host_network:
        # Rank DNS (<pod>.<job>.<ns>.svc) must still resolve through the cluster DNS.
        fields["hostNetwork"] = True
        fields["dnsPolicy"] = "ClusterFirstWithHostNet"
    if tpl.runtime_class_name:
        fields["runtimeClassName"] = tpl.runtime_class_name
    return fields


def metadata_problems(spec: JobSpec, operator_keys: tuple[str, ...]) -> list[str]:
    """spec.template.labels/annotations keys the operator or Kueue own, each naming its field."""
    problems = []
    reserved = set(operator_keys) | set(KUEUE_KEYS)
    for field, items in (("labels", spec.template.labels), ("annotations", spec.template.annotations)):
        for key in items:
            if key in reserved:
                problems.append(f"spec.template.{field}.{key}: set by the operator; remove it (for Kueue, "
                                f"label the RLPostTrainJob itself with {KUEUE_QUEUE_LABEL})")
    return problems


def pvc_problems(spec: JobSpec, taken: tuple[str, ...]) -> list[str]:
    """PVC volume names that clash with the operator's or another volume's."""
    problems = []
    names = list(taken) + [v.get("name") for v in spec.template.volumes]
    for i, pvc in enumerate(spec.template.persistent_volume_claims):
        if pvc.name in names:
            problems.append(f"spec.template.persistentVolumeClaims[{i}].name: {pvc.name} is already a "
                            f"volume of the pod; pick another name")
        names.append(pvc.name)
    return problems
