"""Pure builders: a job spec and its owner -> the Kubernetes objects of the job.

Children of a job ``<job>`` in its namespace:

    ConfigMap  <job>-config        spec.yaml = the spec every pod reads (fields not at their default,
                                   and the schema version: distflow.spec.render_spec_document)
    Service    <job>               headless, publishNotReadyAddresses (rank DNS before readiness)
    Pod        <job>-node-<rank>   one per node; hostname/subdomain give
                                   <job>-node-<rank>.<job>.<ns>.svc
    PodGroup   <job>               only with scheduling.batchScheduler (gang scheduling);
               <job>-trainer       with async.enable: one per pool, each pod in its pool's group
               <job>-rollout

With ``async.enable`` the nodes form two pools (:func:`node_pools`): the trainer
pool is ranks 0 .. N-R-1 (rank 0 trains: it logs and checkpoints), the rollout
pool the last R = ``async.rolloutPool.numNodes`` ranks. Each pod is labelled
``distflow.io/pool``; rollout pods take the pool's resources, nodeSelector and
tolerations where the spec gives them, else the template's.

A job labelled ``kueue.x-k8s.io/queue-name`` gets Kueue pod-group metadata on
its pods instead (see podspec): Kueue admits each gang attempt as one Workload,
both pools in it (one gang: see docs/operations.md for why).

Nothing here reads the environment or the cluster: same spec, same objects.
User errors in ``spec.template`` raise :class:`DistflowConfigError` naming the
field; :func:`template_problems` lists them without raising (the operator marks
the job Failed with them; the CRD's CEL rules reject most of them earlier).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import json

import yaml

from distflow.errors import DistflowConfigError
from distflow.resize import JOIN_ENV, RESIZE_KEY
from distflow.spec import API_GROUP, API_VERSION, KIND, JobSpec, render_spec_document
from distflow.spec.validation import GPU_RESOURCE

from distflow_operator import MANAGER
from distflow_operator import podspec

SPEC_MOUNT_DIR = "/etc/distflow"
SPEC_FILE = "spec.yaml"
CONFIG_PATH = f"{SPEC_MOUNT_DIR}/{SPEC_FILE}"
"""Where a pod finds its spec (``DISTFLOW_CONFIG``)."""
MASTER_PORT = 29500
"""torch.distributed rendezvous port on node 0 (torchrun's default)."""
DEFAULT_METRICS_PORT = 9400
CONTAINER_NAME = "node"

LABEL_JOB = f"{API_GROUP}/job-name"
LABEL_RANK = f"{API_GROUP}/node-rank"
LABEL_ATTEMPT = f"{API_GROUP}/attempt"
LABEL_POOL = f"{API_GROUP}/pool"
TRAINER_POOL = "trainer"
ROLLOUT_POOL = "rollout"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"

OPERATOR_ENV_NAMES = (
    "PET_NNODES", "PET_NODE_RANK", "PET_NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT",
    "WORLD_SIZE", "DISTFLOW_JOB_NAME", "DISTFLOW_ATTEMPT", "DISTFLOW_CONFIG", "DISTFLOW_METRICS_PORT",
    "DISTFLOW_TERMINATION_LOG",
)
"""Env the operator sets on every node; spec.template.env may not set these."""
SPEC_VOLUME = "distflow-spec"
SHM_VOLUME = "dshm"
RESERVED_VOLUMES = (SPEC_VOLUME, SHM_VOLUME)

GANG_METADATA_KEYS = ("scheduling.k8s.io/group-name", "scheduling.x-k8s.io/pod-group")
"""Pod label/annotation keys of the batch schedulers' PodGroups (set in _scheduling_fields)."""
# Gang scheduling: (PodGroup apiVersion, default schedulerName) per batch scheduler.
POD_GROUP_APIS = {
    "volcano": ("scheduling.volcano.sh/v1beta1", "volcano"),
    "scheduler-plugins": ("scheduling.x-k8s.io/v1alpha1", "scheduler-plugins-scheduler"),
}


@dataclass(frozen=True)
class NodePool:
    """A contiguous range of node ranks that run one part of the plan."""

    name: str | None
    """trainer or rollout with async.enable; None for a synchronous job (one pool, no pool label)."""
    first_rank: int
    num_nodes: int

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.num_nodes)


def node_pools(spec: JobSpec) -> tuple[NodePool, ...]:
    """The job's pools in rank order: one unnamed pool, or (trainer, rollout) with async.enable.

    Same layout as the planner's (distflow.planner: the trainer pool first, so rank 0 trains).
    The spec's validation guarantees 1 <= async.rolloutPool.numNodes < cluster.numNodes.
    """
    nodes = spec.cluster.num_nodes
    if not spec.async_.enable:
        return (NodePool(None, 0, nodes),)
    rollout = spec.async_.rollout_pool.num_nodes
    return NodePool(TRAINER_POOL, 0, nodes - rollout), NodePool(ROLLOUT_POOL, nodes - rollout, rollout)


def node_pool(spec: JobSpec, rank: int) -> NodePool:
    """The pool node ``rank`` belongs to."""
    return next(pool for pool in node_pools(spec) if rank in pool.ranks)


@dataclass(frozen=True)
class JobRef:
    """The owning RLPostTrainJob: what every child's owner reference points at."""

    name: str
    namespace: str
    uid: str
    kueue_queue: str | None = None
    """The job's ``kueue.x-k8s.io/queue-name`` label: its pods form Kueue pod groups."""

    def owner_reference(self) -> dict[str, Any]:
        # controller=true lets the garbage collector and `kubectl describe` attribute children;
        # blockOwnerDeletion keeps foreground deletion of the job waiting for them.
        return {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND, "name": self.name,
                "uid": self.uid, "controller": True, "blockOwnerDeletion": True}


def config_map_name(job: str) -> str:
    return f"{job}-config"


def service_name(job: str) -> str:
    return job


def pod_name(job: str, rank: int) -> str:
    return f"{job}-node-{rank}"


def master_addr(job: str, namespace: str) -> str:
    """DNS name of node 0 through the headless Service."""
    return f"{pod_name(job, 0)}.{service_name(job)}.{namespace}.svc"


def metrics_port(spec: JobSpec) -> int:
    """The node's Prometheus port: trainer.metricsPort, or 9400 when that is 0 (off locally)."""
    return spec.trainer.metrics_port or DEFAULT_METRICS_PORT


def job_labels(job: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "distflow",
        "app.kubernetes.io/instance": job,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "distflow",
        LABEL_MANAGED_BY: MANAGER,
        LABEL_JOB: job,
    }


def node_labels(job: str, rank: int, attempt: int, pool: str | None = None) -> dict[str, str]:
    """A node pod's labels; ``distflow.io/pool`` only for a pool of an asynchronous job."""
    labels = {**job_labels(job, "node"), LABEL_RANK: str(rank), LABEL_ATTEMPT: str(attempt)}
    if pool:
        labels[LABEL_POOL] = pool
    return labels


NODE_LABEL_KEYS = tuple(node_labels("job", 0, 1, ROLLOUT_POOL))
"""Label keys the operator sets on node pods: spec.template.labels may not set them."""


def _metadata(name: str, owner: JobRef, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": owner.namespace, "labels": labels,
            "ownerReferences": [owner.owner_reference()]}


def build_config_map(spec: JobSpec, owner: JobRef, resize_request: str | None = None) -> dict[str, Any]:
    """ConfigMap ``<job>-config`` holding the spec as ``spec.yaml``: only what differs from the defaults,
    so that a worker image of the previous release reads it (the version-skew contract). With
    ``resize_request`` (:func:`resize_request_value`), the key ``resize`` holds it too: an in-place
    resize (of the rollout pool or the whole gang) writes the spec at the new size and the request in
    one update."""
    text = yaml.safe_dump(render_spec_document(spec), sort_keys=False)
    data = {SPEC_FILE: text} | ({RESIZE_KEY: resize_request} if resize_request is not None else {})
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _metadata(config_map_name(owner.name), owner, job_labels(owner.name, "config")),
            "data": data}


def resize_request_value(num_nodes: int, rollout_nodes: int | None = None, in_place: bool = False) -> str:
    """The ConfigMap key ``resize``'s value asking the workers to stop for ``num_nodes`` nodes; with
    ``rollout_nodes``, to resize the rollout pool in place to it; with ``in_place`` (a synchronous job),
    to resize the whole gang in place to ``num_nodes`` (``{"numNodes": N, "inPlace": true}``: new ranks
    join, the last ranks leave). ``distflow.resize`` reads it at every step boundary."""
    assert rollout_nodes is None or not in_place, "an in-place request names the rollout pool or the gang"
    if rollout_nodes is not None:
        return json.dumps({"numNodes": num_nodes, "rolloutNodes": rollout_nodes})
    if in_place:
        return json.dumps({"numNodes": num_nodes, "inPlace": True})
    return json.dumps({"numNodes": num_nodes})


def build_headless_service(spec: JobSpec, owner: JobRef) -> dict[str, Any]:
    """Headless Service ``<job>``: per-rank DNS, published before pods are ready
    (ranks must find node 0 while they are all still starting)."""
    port = metrics_port(spec)
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _metadata(service_name(owner.name), owner, job_labels(owner.name, "rendezvous")),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {LABEL_JOB: owner.name, LABEL_MANAGED_BY: MANAGER},
            "ports": [{"name": "rendezvous", "port": MASTER_PORT, "targetPort": MASTER_PORT},
                      {"name": "metrics", "port": port, "targetPort": port}],
        },
    }


def pod_group_name(job: str, pool: str | None) -> str:
    """PodGroup of a pool: ``<job>`` for a synchronous job, ``<job>-<pool>`` per pool otherwise."""
    return f"{job}-{pool}" if pool else job


def build_pod_groups(spec: JobSpec, owner: JobRef) -> list[dict[str, Any]]:
    """PodGroups for Volcano or scheduler-plugins coscheduling, one per pool; [] without a batch scheduler.

    minMember = the pool's nodes: the scheduler binds all of a pool's pods or none of them.
    minResources = the pool's GPUs (cluster.acceleratorsPerNode per node), when it has any.
    """
    sched = spec.scheduling
    if sched.batch_scheduler == "none":
        return []
    api_version, _ = POD_GROUP_APIS[sched.batch_scheduler]
    groups = []
    for pool in node_pools(spec):
        group_spec: dict[str, Any] = {"minMember": pool.num_nodes}
        gpus = spec.cluster.accelerators_per_node * pool.num_nodes
        if gpus:
            group_spec["minResources"] = {GPU_RESOURCE: str(gpus)}
        if sched.batch_scheduler == "volcano":
            if sched.queue:
                group_spec["queue"] = sched.queue
            if sched.priority_class_name:
                group_spec["priorityClassName"] = sched.priority_class_name
        labels = job_labels(owner.name, "podgroup")
        if pool.name:
            labels[LABEL_POOL] = pool.name
        groups.append({"apiVersion": api_version, "kind": "PodGroup",
                       "metadata": _metadata(pod_group_name(owner.name, pool.name), owner, labels),
                       "spec": group_spec})
    return groups


def _env_problems(spec: JobSpec) -> list[str]:
    problems = []
    for i, item in enumerate(spec.template.env):
        name = item.get("name")
        if not isinstance(name, str) or not name:
            problems.append(f"spec.template.env[{i}].name: each env entry needs a name; add one")
        elif name in OPERATOR_ENV_NAMES:
            problems.append(f"spec.template.env[{i}].name: {name} is set by the operator "
                            f"(rank variables: {', '.join(OPERATOR_ENV_NAMES)}); remove it")
    return problems


def _volume_problems(spec: JobSpec) -> list[str]:
    problems = podspec.pvc_problems(spec, RESERVED_VOLUMES)
    for field, items in (("volumes", spec.template.volumes), ("volumeMounts", spec.template.volume_mounts)):
        for i, item in enumerate(items):
            if item.get("name") in RESERVED_VOLUMES:
                problems.append(f"spec.template.{field}[{i}].name: {item['name']} is used by the "
                                f"operator; pick another name")
    return problems


def template_problems(spec: JobSpec) -> list[str]:
    """Problems in spec.template that make the pods impossible to render, each naming its field."""
    operator_keys = (*NODE_LABEL_KEYS, *GANG_METADATA_KEYS)
    return (_env_problems(spec) + _volume_problems(spec)
            + podspec.metadata_problems(spec, operator_keys))


def _node_env(spec: JobSpec, owner: JobRef, rank: int, attempt: int) -> list[dict[str, str]]:
    values = {
        "PET_NNODES": spec.cluster.num_nodes,
        "PET_NODE_RANK": rank,
        "PET_NPROC_PER_NODE": spec.cluster.procs_per_node,
        "MASTER_ADDR": master_addr(owner.name, owner.namespace),
        "MASTER_PORT": MASTER_PORT,
        # torchrun's meaning: worker processes in the whole job, not pods.
        "WORLD_SIZE": spec.world_size,
        "DISTFLOW_JOB_NAME": owner.name,
        "DISTFLOW_ATTEMPT": attempt,
        "DISTFLOW_CONFIG": CONFIG_PATH,
        "DISTFLOW_METRICS_PORT": metrics_port(spec),
        "DISTFLOW_TERMINATION_LOG": "/dev/termination-log",
    }
    assert tuple(values) == OPERATOR_ENV_NAMES
    return [{"name": k, "value": str(v)} for k, v in values.items()]


def _pod_fields(spec: JobSpec, pool: NodePool) -> tuple[dict[str, Any], dict[str, str], list[dict[str, Any]]]:
    """(container resources, nodeSelector, tolerations) of a pool's pods: the rollout pool's own
    where async.rolloutPool gives them, else spec.template's. Copies: a pod never aliases the spec."""
    tpl = spec.template
    resources, selector, tolerations = tpl.resources, tpl.node_selector, tpl.tolerations
    if pool.name == ROLLOUT_POOL:
        own = spec.async_.rollout_pool
        resources = own.resources or resources
        selector = own.node_selector or selector
        tolerations = own.tolerations or tolerations
    return copy.deepcopy(resources), dict(selector), copy.deepcopy(tolerations)


def _resources(spec: JobSpec, pool: NodePool) -> dict[str, Any]:
    resources, _, _ = _pod_fields(spec, pool)
    gpus = spec.cluster.accelerators_per_node
    if gpus:
        for kind in ("requests", "limits"):
            resources.setdefault(kind, {})[GPU_RESOURCE] = str(gpus)
    return resources


def _container(spec: JobSpec, owner: JobRef, rank: int, attempt: int, pool: NodePool,
               joining: bool = False) -> dict[str, Any]:
    tpl = spec.template
    port = metrics_port(spec)
    _, security = podspec.security_contexts(tpl.security_context)
    _, pvc_mounts = podspec.pvc_volumes(tpl.persistent_volume_claims)
    return {
        "name": CONTAINER_NAME,
        "image": tpl.image,
        "imagePullPolicy": tpl.image_pull_policy,
        "command": ["distflow", "node", "--config", CONFIG_PATH],
        "env": _node_env(spec, owner, rank, attempt) + ([{"name": JOIN_ENV, "value": "1"}] if joining else [])
               + copy.deepcopy(tpl.env),
        "ports": [{"name": "metrics", "containerPort": port, "protocol": "TCP"},
                  {"name": "rendezvous", "containerPort": MASTER_PORT, "protocol": "TCP"}],
        "resources": _resources(spec, pool),
        "volumeMounts": [{"name": SPEC_VOLUME, "mountPath": SPEC_MOUNT_DIR, "readOnly": True},
                         {"name": SHM_VOLUME, "mountPath": "/dev/shm"}]
                        + pvc_mounts + copy.deepcopy(tpl.volume_mounts),
        "securityContext": security,
        # Ready = the node's metrics endpoint answers, i.e. its runtime is up.
        "readinessProbe": {"httpGet": {"path": "/metrics", "port": "metrics"},
                           "periodSeconds": 10, "failureThreshold": 3},
        # `distflow node` writes its exit reason here; the operator reads it without pod logs rights.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def _scheduling_fields(spec: JobSpec, owner: JobRef,
                       pool: NodePool) -> tuple[dict[str, Any], dict[str, str], dict[str, str]]:
    """(pod spec fields, extra labels, annotations) for the scheduler and gang scheduling:
    the pod joins its pool's PodGroup."""
    group = pod_group_name(owner.name, pool.name)
    sched = spec.scheduling
    fields: dict[str, Any] = {}
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    if sched.batch_scheduler != "none":
        fields["schedulerName"] = POD_GROUP_APIS[sched.batch_scheduler][1]
        if sched.batch_scheduler == "volcano":
            annotations["scheduling.k8s.io/group-name"] = group
        else:
            labels["scheduling.x-k8s.io/pod-group"] = group
    if sched.scheduler_name:
        fields["schedulerName"] = sched.scheduler_name
    if sched.priority_class_name:
        fields["priorityClassName"] = sched.priority_class_name
    return fields, labels, annotations


def _pod_metadata(spec: JobSpec, owner: JobRef, rank: int, attempt: int, pool: NodePool) -> dict[str, Any]:
    """Labels and annotations: the template's first, so the operator's and Kueue's win.
    Kueue gets one pod group of all cluster.numNodes pods, both pools (docs/operations.md)."""
    _, sched_labels, sched_annotations = _scheduling_fields(spec, owner, pool)
    kueue_labels, kueue_annotations = podspec.kueue_metadata(owner.kueue_queue, owner.name, attempt,
                                                            spec.cluster.num_nodes)
    labels = {**spec.template.labels, **node_labels(owner.name, rank, attempt, pool.name), **sched_labels,
              **kueue_labels}
    metadata = _metadata(pod_name(owner.name, rank), owner, labels)
    annotations = {**spec.template.annotations, **sched_annotations, **kueue_annotations}
    if annotations:
        metadata["annotations"] = annotations
    return metadata


def build_node_pod(spec: JobSpec, owner: JobRef, rank: int, attempt: int, joining: bool = False) -> dict[str, Any]:
    """Pod ``<job>-node-<rank>`` of gang attempt ``attempt`` (1-based), in the pool of its rank.
    ``joining``: the node joins the running attempt (``DISTFLOW_JOIN=1``): an in-place grow of the
    rollout pool (``distflow.pools.elastic``) or of a synchronous job's whole gang.

    Raises:
        DistflowConfigError: spec.template sets an operator env name, a reserved
            volume name, label or annotation (see :func:`template_problems`; an nvidia.com/gpu count
            the spec's own checks refuse, ``distflow.spec.validation``).
    """
    assert 0 <= rank < spec.cluster.num_nodes and attempt >= 1
    problems = template_problems(spec)
    if problems:
        raise DistflowConfigError(problems)
    tpl = spec.template
    name = pod_name(owner.name, rank)
    pool = node_pool(spec, rank)
    sched_fields, _, _ = _scheduling_fields(spec, owner, pool)
    _, node_selector, tolerations = _pod_fields(spec, pool)
    pod_security, _ = podspec.security_contexts(tpl.security_context)
    pvc_volumes, _ = podspec.pvc_volumes(tpl.persistent_volume_claims)
    pod_spec: dict[str, Any] = {
        "hostname": name,
        "subdomain": service_name(owner.name),
        # A failed node fails the gang; the operator, not the kubelet, restarts it.
        "restartPolicy": "Never",
        # Hundreds of service env vars per pod help nobody and slow startup.
        "enableServiceLinks": False,
        "securityContext": pod_security,
        "containers": [_container(spec, owner, rank, attempt, pool, joining)],
        "volumes": [{"name": SPEC_VOLUME, "configMap": {"name": config_map_name(owner.name)}},
                    podspec.shm_volume(SHM_VOLUME, tpl.shm_size)]
                   + pvc_volumes + copy.deepcopy(tpl.volumes),
        **sched_fields,
        **podspec.host_fields(spec),
    }
    if tpl.service_account_name:
        pod_spec["serviceAccountName"] = tpl.service_account_name
    else:
        # Nodes need no API access (progress is scraped from them), so they get no token.
        pod_spec["automountServiceAccountToken"] = False
    for key, value in (("nodeSelector", node_selector), ("tolerations", tolerations),
                       ("affinity", tpl.affinity)):
        if value:
            pod_spec[key] = copy.deepcopy(value)
    if tpl.topology_spread_constraints:
        selector = {LABEL_JOB: owner.name, LABEL_MANAGED_BY: MANAGER}
        pod_spec["topologySpreadConstraints"] = podspec.spread_constraints(
            tpl.topology_spread_constraints, selector, LABEL_ATTEMPT)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": _pod_metadata(spec, owner, rank, attempt, pool),
            "spec": pod_spec}
