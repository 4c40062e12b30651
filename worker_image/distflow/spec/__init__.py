"""The RLPostTrainJob spec: one source of truth for `distflow run` and the CRD.

Both sides import this package: the operator renders pods from it and
generates the CRD's OpenAPI schema from it; the runtime plans and trains from
it. It imports pydantic and yaml only (never torch, kopf or kubernetes).

    names (distflow.names)  the algorithm, reward, workflow and role names, shared with the runtime
    base                    SpecBase: camelCase aliases, unknown fields rejected, frozen
    models                  the sections (ModelSpec ... JobSpec) with per-field bounds
    multiturn               rollout.multiTurn: tools (OpenAI tool format) and environments, checked by name
    pod, ray                the operator's sections (scheduling, template) and the Ray launcher's
    validation              checks across fields (sizes that divide, choices that agree)
    defaults                the device-dependent defaults (bf16, TF32, HSDP, KV-sized rollout batches) on the worker
    loading                 YAML files, --set overrides, manifests; errors with field paths; the
                            operator/worker version-skew contract (what is rendered, what is ignored)

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
    SPEC_SCHEMA_VERSION,
    apply_overrides,
    dump_spec,
    dump_spec_portable,
    load_job_spec,
    load_rendered_spec,
    parse_spec,
    parse_spec_ignoring_unknown,
    render_spec_document,
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
from distflow.spec.multiturn import MultiTurnSpec, ToolSpec
from distflow.spec.pod import PodTemplateSpec, PvcVolumeSpec, SchedulingSpec, SecurityContextSpec, TopologySpreadSpec
from distflow.spec.pools import AsyncSpec, RolloutPoolSpec
from distflow.spec.ray import RaySpec

__all__ = [
    "ADVANTAGE_ESTIMATORS", "API_GROUP", "API_VERSION", "ARITHMETIC_SPLITS", "BUILTIN_REWARDS",
    "BUILTIN_WORKFLOWS", "GROUP_ESTIMATORS", "KIND", "KL_ESTIMATORS", "LOSS_AGG_MODES", "NODE_KINDS",
    "NODE_ROLES", "POLICY_LOSSES", "SPEC_SCHEMA_VERSION", "TINY_TOKENIZERS", "WORKFLOW_DEFAULTS",
    "ActorSpec", "AlgorithmSpec", "CheckpointSpec", "ClusterSpec", "CriticSpec", "DataPlaneSpec", "DataSpec",
    "DatasetSpec", "ExitCodeRule", "FilterGroupsSpec", "JobSpec", "KLControlSpec", "ModelSpec",
    "MultiTurnSpec", "ToolSpec",
    "AsyncSpec", "OverlongBufferSpec", "PodTemplateSpec", "PvcVolumeSpec", "RaySpec", "RolloutPoolSpec", "RolloutSpec", "RunPolicySpec",
    "SchedulingSpec", "SecurityContextSpec", "SpecBase", "TopologySpreadSpec", "TrainerSpec",
    "ValSamplingSpec", "WorkflowNodeSpec", "WorkflowSpec",
    "apply_overrides", "dump_spec", "dump_spec_portable", "load_job_spec", "load_rendered_spec", "parse_spec",
    "parse_spec_ignoring_unknown", "render_spec_document", "spec_from_manifest",
]
