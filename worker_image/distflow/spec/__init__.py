"""The RLPostTrainJob spec: one source of truth for `distflow run` and the CRD.

Both sides import this package: the operator renders pods from it and
generates the CRD's OpenAPI schema from it; the runtime plans and trains from
it. It imports pydantic and yaml only (never torch, kopf or kubernetes).

    names (distflow.names)  the algorithm, reward, workflow and role names, shared with the runtime
    base                    SpecBase: camelCase aliases, unknown fields rejected, frozen
    models                  the sections (ModelSpec ... JobSpec) with per-field bounds
    pod, ray                the operator's sections (scheduling, template) and the Ray launcher's
    validation              checks across fields (sizes that divide, choices that agree)
    loading                 YAML files, --set overrides, manifests; errors with field paths

A local run config is the same spec in a file: either a whole
``RLPostTrainJob`` manifest or just its ``spec``.
"""

from distflow.names import (
    ADVANTAGE_ESTIMATORS,
    ARITHMETIC_SPLITS,
    BUILTIN_REWARDS,
    BUILTIN_WORKFLOWS,
    GROUP_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    NODE_KINDS,
    NODE_ROLES,
    POLICY_LOSSES,
    TINY_TOKENIZERS,
)
from distflow.spec.base import SpecBase
from distflow.spec.loading import (
    API_GROUP,
    API_VERSION,
    KIND,
    apply_overrides,
    dump_spec,
    load_job_spec,
    parse_spec,
    spec_from_manifest,
)
from distflow.spec.models import (
    WORKFLOW_DEFAULTS,
    ActorSpec,
    AlgorithmSpec,
    CheckpointSpec,
    ClusterSpec,
    CriticSpec,
    DataPlaneSpec,
    DataSpec,
    DatasetSpec,
    ExitCodeRule,
    FilterGroupsSpec,
    JobSpec,
    KLControlSpec,
    ModelSpec,
    OverlongBufferSpec,
    RolloutSpec,
    RunPolicySpec,
    TrainerSpec,
    ValSamplingSpec,
    WorkflowNodeSpec,
    WorkflowSpec,
)
from distflow.spec.pod import PodTemplateSpec, PvcVolumeSpec, SchedulingSpec, SecurityContextSpec, TopologySpreadSpec
from distflow.spec.ray import RaySpec

__all__ = [
    "ADVANTAGE_ESTIMATORS", "API_GROUP", "API_VERSION", "ARITHMETIC_SPLITS", "BUILTIN_REWARDS",
    "BUILTIN_WORKFLOWS", "GROUP_ESTIMATORS", "KIND", "KL_ESTIMATORS", "LOSS_AGG_MODES", "NODE_KINDS",
    "NODE_ROLES", "POLICY_LOSSES", "TINY_TOKENIZERS", "WORKFLOW_DEFAULTS",
    "ActorSpec", "AlgorithmSpec", "CheckpointSpec", "ClusterSpec", "CriticSpec", "DataPlaneSpec", "DataSpec",
    "DatasetSpec", "ExitCodeRule", "FilterGroupsSpec", "JobSpec", "KLControlSpec", "ModelSpec",
    "OverlongBufferSpec", "PodTemplateSpec", "PvcVolumeSpec", "RaySpec", "RolloutSpec", "RunPolicySpec",
    "SchedulingSpec", "SecurityContextSpec", "SpecBase", "TopologySpreadSpec", "TrainerSpec",
    "ValSamplingSpec", "WorkflowNodeSpec", "WorkflowSpec",
    "apply_overrides", "dump_spec", "load_job_spec", "parse_spec", "spec_from_manifest",
]
